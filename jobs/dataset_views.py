"""The dataset pages: the team's datasets, one dataset with its versions and manifest, a new
dataset (files uploaded in the browser, or a bucket registered by URI) and adding files.

Uploading is done in the browser by static/js/upload.js through the chunk API (dataset_api);
the pages say so when JavaScript is off. Registering a bucket is a plain form.
"""

from urllib.parse import urlparse

from django import forms
from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.db.models import Prefetch
from django.http import Http404, HttpResponseForbidden
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from accounts import audit
from accounts.access import get_for_team, is_owner, require_team
from e31web.endpoints import check_endpoint
from jobs import datasets
from jobs.models import Dataset, DatasetUpload, DatasetVersion

MANIFEST_ROWS_ON_PAGE = 1000


def sentence(error):
    """An error message as a sentence: 'Your team already has ...'."""
    text = str(error).strip()
    text = text[:1].upper() + text[1:]
    return text if text.endswith((".", "?", "!")) else f"{text}."


# Permission helpers: another team's dataset, version or upload is a 404 --------------------------


def get_dataset(request, dataset_id):
    return get_for_team(Dataset.objects.all(), request.user, pk=dataset_id)


def get_version(dataset, number):
    version = dataset.versions.select_related("dataset", "parent").filter(number=number).first()
    if version is None:
        raise Http404(f"{dataset.name} has no version {number}.")
    return version


def get_upload(request, upload_id):
    # A folder's file (jobs/folder_uploads.py) is no dataset's upload: not found here.
    uploads = DatasetUpload.objects.filter(version__isnull=False).select_related("version__dataset")
    return get_for_team(uploads, request.user, "version__dataset__team", pk=upload_id)


# Forms -----------------------------------------------------------------------------------------


class DatasetForm(forms.Form):
    """A dataset to upload files into: its version 1 is open until sealed."""

    name = forms.CharField(max_length=200, help_text="Jobs name it: name, or name@2 for version 2.")
    description = forms.CharField(required=False, widget=forms.Textarea(attrs={"rows": 2}))

    def __init__(self, *args, team, **kwargs):
        super().__init__(*args, **kwargs)
        self.team = team

    def clean_name(self):
        try:
            name = datasets.clean_name(self.cleaned_data["name"])
            datasets.check_name_free(self.team, name)
        except datasets.DatasetError as error:
            raise forms.ValidationError(sentence(error)) from None
        return name

    def save(self):
        return datasets.create_upload_dataset(self.team, self.cleaned_data["name"], self.cleaned_data["description"])


class BucketAccessForm(forms.Form):
    """Where a team's bucket is and the credentials it is read with (kept encrypted, never
    shown back). The endpoint must be at a public address unless the network allows it
    (e31web/endpoints.py): the scanner and the runners connect to it from inside."""

    endpoint_url = forms.URLField(
        label="Endpoint URL",
        required=False,
        assume_scheme="https",
        max_length=500,
        help_text="Blank for AWS; the store's address for others, e.g. https://minio.example.com:9000.",
    )
    region = forms.CharField(required=False, max_length=64, help_text="Blank: us-east-1.")
    access_key_id = forms.CharField(label="Access key ID", max_length=128)
    secret_access_key = forms.CharField(
        label="Secret access key",
        max_length=256,
        strip=False,
        widget=forms.PasswordInput(render_value=False),
        help_text="Stored encrypted; never shown again, never given to a job's process.",
    )

    def clean_endpoint_url(self):
        url = self.cleaned_data["endpoint_url"]
        if url and urlparse(url).scheme not in ("http", "https"):
            raise forms.ValidationError("Give an http:// or https:// address.")
        reason = check_endpoint(url)
        if reason:
            raise forms.ValidationError(sentence(reason))
        return url

    def clean_region(self):
        region = self.cleaned_data["region"].strip()
        if region and not all(c.isalnum() or c == "-" for c in region):
            raise forms.ValidationError("A region is letters, digits and dashes, like eu-west-1.")
        return region


class S3DatasetForm(DatasetForm, BucketAccessForm):
    """A dataset of the objects under a URI in the team's own bucket, on AWS or any S3-compatible
    store, read with credentials the team gives (kept encrypted, never shown back)."""

    uri = forms.CharField(label="S3 URI", max_length=1100, help_text="s3://bucket/prefix: every object under the prefix is a file.")

    field_order = ["name", "uri", "endpoint_url", "region", "access_key_id", "secret_access_key", "description"]

    def clean_uri(self):
        try:
            datasets.parse_s3_uri(self.cleaned_data["uri"])
        except datasets.DatasetError as error:
            raise forms.ValidationError(sentence(error)) from None
        return self.cleaned_data["uri"].strip()

    def save(self):
        data = self.cleaned_data
        return datasets.register_s3(
            self.team,
            data["name"],
            data["uri"],
            data["access_key_id"],
            data["secret_access_key"],
            endpoint_url=data["endpoint_url"],
            region=data["region"],
            description=data["description"],
        )


class CredentialsForm(BucketAccessForm):
    """New credentials for a registered bucket (a key rotated or revoked), and its endpoint and
    region; the page fills in the endpoint and region it has, never the keys."""

    rescan = forms.BooleanField(label="Scan the bucket again after saving", required=False, initial=True)

    def __init__(self, *args, dataset, **kwargs):
        kwargs.setdefault("initial", {"endpoint_url": dataset.s3_endpoint_url, "region": dataset.s3_region, "rescan": True})
        super().__init__(*args, **kwargs)
        self.dataset = dataset

    def save(self):
        """The dataset with its new credentials; and the version being scanned, if asked for."""
        data = self.cleaned_data
        dataset = datasets.update_credentials(
            self.dataset, data["access_key_id"], data["secret_access_key"], endpoint_url=data["endpoint_url"], region=data["region"]
        )
        return dataset, datasets.rescan(dataset) if data["rescan"] else None


OWNERS_ONLY = {
    "delete": "Only the team's owner can delete a dataset.",
    "credentials": "Only the team's owner can change a bucket's credentials.",
}


# Pages -----------------------------------------------------------------------------------------


@login_required
@require_GET
def dataset_list(request):
    team = require_team(request.user)
    queryset = Dataset.objects.filter(team=team).prefetch_related(Prefetch("versions", DatasetVersion.objects.order_by("-number")))
    rows = [(dataset, datasets.summarize(dataset)) for dataset in queryset]
    return render(request, "datasets/list.html", {"rows": rows})


@login_required
@require_http_methods(["GET", "POST"])
def dataset_new(request):
    """Two ways to a dataset: files uploaded by upload.js (through the API), or this page's form
    registering a bucket (POST)."""
    team = require_team(request.user)
    s3_form = S3DatasetForm(request.POST or None, team=team, prefix="s3")
    if request.method == "POST" and s3_form.is_valid():
        try:
            dataset = s3_form.save()
        except datasets.DatasetError as error:
            s3_form.add_error(None, sentence(error))
        else:
            audit.record(request, "dataset.create", dataset)
            messages.success(request, f"Dataset {dataset.name} registered: its objects are being scanned.")
            return redirect("datasets:detail", dataset_id=dataset.pk)
    context = {
        "upload_form": DatasetForm(team=team, prefix="upload"),
        "s3_form": s3_form,
        "chunk_size": settings.E31_UPLOAD_CHUNK_BYTES,
        "tab": "s3" if request.method == "POST" else "upload",
    }
    return render(request, "datasets/new.html", context)


@login_required
@require_GET
def dataset_detail(request, dataset_id):
    return render_detail(request, get_dataset(request, dataset_id))


def render_detail(request, dataset, credentials_form=None, status=200):
    summary = datasets.summarize(dataset)
    shown = summary["latest"]
    if request.GET.get("version", "").isdigit():
        shown = get_version(dataset, int(request.GET["version"]))
    elif shown is None and summary["versions"]:
        shown = summary["versions"][0]
    files = list(shown.files.all()[: MANIFEST_ROWS_ON_PAGE + 1]) if shown else []
    context = {
        "dataset": dataset,
        "summary": summary,
        "shown": shown,
        "files": files[:MANIFEST_ROWS_ON_PAGE],
        "more_files": len(files) > MANIFEST_ROWS_ON_PAGE,
        "scanning": any(v.state == DatasetVersion.SCANNING for v in summary["versions"]),
        "is_owner": is_owner(request.user),
        "credentials_form": credentials_form or (CredentialsForm(dataset=dataset, prefix="credentials") if dataset.source == Dataset.S3 else None),
    }
    # While a scan runs, htmx asks for the page again and takes its body (#dataset-body).
    return render(request, "datasets/detail.html", context, status=status)


@login_required
@require_POST
def dataset_add_files(request, dataset_id):
    """Open a version to add files to (the open one if there is one), and go upload them."""
    dataset = get_dataset(request, dataset_id)
    try:
        version, _ = datasets.open_version(dataset)
    except datasets.DatasetError as error:
        messages.error(request, sentence(error))
        return redirect("datasets:detail", dataset_id=dataset.pk)
    return redirect("datasets:upload", dataset_id=dataset.pk, number=version.number)


@login_required
@require_GET
def version_upload(request, dataset_id, number):
    """Upload files into an open version (upload.js), then seal it."""
    dataset = get_dataset(request, dataset_id)
    version = get_version(dataset, number)
    if version.state != DatasetVersion.OPEN:
        messages.info(request, f"Version {version.number} is {version.get_state_display().lower()}: it cannot change.")
        return redirect(f"{reverse('datasets:detail', args=[dataset.pk])}?version={version.number}")
    context = {
        "dataset": dataset,
        "version": version,
        "files": list(version.files.all()[:MANIFEST_ROWS_ON_PAGE]),
        "file_count": version.files.count(),
        "unfinished": list(version.uploads.filter(state__in=DatasetUpload.UNFINISHED)),
        "chunk_size": settings.E31_UPLOAD_CHUNK_BYTES,
    }
    return render(request, "datasets/upload.html", context)


@login_required
@require_POST
def version_seal(request, dataset_id, number):
    """Seal from the page (the same as upload.js does when its files are done)."""
    dataset = get_dataset(request, dataset_id)
    version = get_version(dataset, number)
    try:
        datasets.seal_version(version)
    except datasets.DatasetError as error:
        messages.error(request, sentence(error))
        return redirect("datasets:upload", dataset_id=dataset.pk, number=version.number)
    audit.record(request, "dataset.seal", version, label=f"{dataset.name}@{version.number}")
    messages.success(request, f"Version {version.number} of {dataset.name} is sealed: ready for jobs.")
    return redirect("datasets:detail", dataset_id=dataset.pk)


@login_required
@require_POST
def upload_abort(request, dataset_id, upload_id):
    """Give up a file's unfinished upload (so that the version can be sealed without it)."""
    dataset = get_dataset(request, dataset_id)
    upload = get_upload(request, upload_id)
    if upload.version.dataset_id != dataset.pk:
        raise Http404("No such upload.")
    try:
        datasets.abort_upload(upload, "given up on the upload page")
    except datasets.DatasetError as error:
        messages.error(request, sentence(error))
    else:
        messages.info(request, f"The upload of {upload.path} was given up.")
    return redirect("datasets:upload", dataset_id=dataset.pk, number=upload.version.number)


@login_required
@require_POST
def dataset_rescan(request, dataset_id):
    dataset = get_dataset(request, dataset_id)
    try:
        version = datasets.rescan(dataset)
    except datasets.DatasetError as error:
        messages.error(request, sentence(error))
    else:
        messages.success(request, f"Scanning the bucket again as version {version.number}.")
    return redirect("datasets:detail", dataset_id=dataset.pk)


@login_required
@require_POST
def dataset_credentials(request, dataset_id):
    """New credentials for a registered bucket, by the team's owner; scanned again if asked."""
    dataset = get_dataset(request, dataset_id)
    if not is_owner(request.user):
        return HttpResponseForbidden(OWNERS_ONLY["credentials"])
    if dataset.source != Dataset.S3:
        messages.error(request, "Only a dataset registered from a bucket has credentials to change.")
        return redirect("datasets:detail", dataset_id=dataset.pk)
    form = CredentialsForm(request.POST, dataset=dataset, prefix="credentials")
    if not form.is_valid():
        return render_detail(request, dataset, credentials_form=form, status=400)
    dataset, version = form.save()
    audit.record(request, "dataset.credentials", dataset)
    scanning = f" Scanning the bucket again as version {version.number}." if version else ""
    messages.success(request, f"The credentials of {dataset.name} are changed.{scanning}")
    return redirect("datasets:detail", dataset_id=dataset.pk)


@login_required
@require_POST
def dataset_delete(request, dataset_id):
    """Delete a dataset, by the team's owner, once the box saying so is ticked; refused while
    unfinished jobs use it."""
    dataset = get_dataset(request, dataset_id)
    if not is_owner(request.user):
        return HttpResponseForbidden(OWNERS_ONLY["delete"])
    if not request.POST.get("confirm"):
        messages.error(request, f"Tick the box to confirm that {dataset.name} is to be deleted.")
        return redirect("datasets:detail", dataset_id=dataset.pk)
    try:
        versions = datasets.delete_dataset(dataset)
    except datasets.DatasetError as error:
        messages.error(request, sentence(error))
        return redirect("datasets:detail", dataset_id=dataset.pk)
    audit.record(request, "dataset.delete", dataset, label=f"{dataset.name} ({versions} version{'s' if versions != 1 else ''})")
    messages.success(request, f"Dataset {dataset.name} is deleted. Jobs that used it still name it.")
    return redirect("datasets:list")
