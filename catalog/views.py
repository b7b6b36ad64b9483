"""The dataset pages: the team's datasets, one dataset with its versions and manifest, a new
dataset (files uploaded in the browser, or a bucket registered by URI) and adding files.

Uploading is done in the browser by static/js/upload.js through the chunk API (catalog.api);
the pages say so when JavaScript is off. Registering a bucket is a plain form (catalog.forms).
"""

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.db.models import Prefetch
from django.http import Http404, HttpResponseForbidden
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from accounts import audit
from accounts.access import is_owner, require_team
from catalog import datasets
from catalog.access import OWNERS_ONLY, get_dataset, get_upload, get_version
from catalog.forms import CredentialsForm, DatasetForm, S3DatasetForm, sentence
from catalog.models import Dataset, DatasetUpload, DatasetVersion

MANIFEST_ROWS_ON_PAGE = 1000


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
