"""The dataset forms of the pages and the API: a dataset to upload into, a bucket registered by
URI, and new credentials for a registered bucket."""

from urllib.parse import urlparse

from django import forms

from catalog import datasets
from core.endpoints import check_endpoint


def sentence(error):
    """An error message as a sentence: 'Your team already has ...'."""
    text = str(error).strip()
    text = text[:1].upper() + text[1:]
    return text if text.endswith((".", "?", "!")) else f"{text}."


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
    (core/endpoints.py): the scanner and the runners connect to it from inside."""

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
