"""Datasets: made from uploaded files, or registered from a team's own bucket.

Uploaded files are kept as content-addressed blobs, so versions share unchanged files for free.
A registered bucket is scanned once per version: every object's size and SHA-256 go into the
manifest, which staging later checks the bytes against.
"""

import hashlib
import io
import logging
import re

from django.db import transaction
from django.utils import timezone

from e31web.secrets_box import seal
from e31web.storage import CHUNK, get_storage
from jobs.models import Dataset, DatasetVersion

log = logging.getLogger(__name__)

S3_URI = re.compile(r"^s3://([a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])(?:/(.*))?$")


class DatasetError(ValueError):
    pass


def clean_path(path):
    """A file's path inside a dataset: relative, '/'-separated, nothing that climbs out."""
    path = (path or "").replace("\\", "/").strip()
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if not parts or ".." in parts or any(ord(c) < 32 for c in path) or len(path) > 500:
        raise DatasetError(f"{path!r} is not a usable file path")
    return "/".join(parts)


@transaction.atomic
def create_dataset(team, name, files, description=""):
    """A dataset whose first version holds files: {path: bytes or binary file}."""
    if Dataset.objects.filter(team=team, name=name).exists():
        raise DatasetError(f"your team already has a dataset named {name!r}")
    dataset = Dataset.objects.create(team=team, name=name, description=description)
    add_files(dataset, files)
    return dataset


def add_files(dataset, files):
    """A new version: the latest one's files plus (or replaced by) these."""
    version = dataset.new_version()
    storage = get_storage()
    for path, content in files.items():
        stream = io.BytesIO(content) if isinstance(content, bytes) else content
        key, size, sha256 = storage.save_blob(stream)
        version.add_file(clean_path(path), size, sha256, key)
    return version.seal()


def parse_s3_uri(uri):
    match = S3_URI.match((uri or "").strip())
    if not match:
        raise DatasetError("give the bucket as s3://bucket/prefix (a bucket name of 3-63 lowercase letters, digits, dots or dashes)")
    return match.group(1), (match.group(2) or "").strip("/")


@transaction.atomic
def register_s3(team, name, uri, access_key_id, secret_access_key, endpoint_url="", region="", description=""):
    """A dataset whose files live in the team's bucket. Its first version is scanned next."""
    bucket, prefix = parse_s3_uri(uri)
    if Dataset.objects.filter(team=team, name=name).exists():
        raise DatasetError(f"your team already has a dataset named {name!r}")
    dataset = Dataset.objects.create(
        team=team,
        name=name,
        description=description,
        source=Dataset.S3,
        s3_bucket=bucket,
        s3_prefix=prefix,
        s3_endpoint_url=endpoint_url or "",
        s3_region=region or "",
        s3_credentials=seal({"access_key_id": access_key_id, "secret_access_key": secret_access_key}),
    )
    dataset.new_version(state=DatasetVersion.SCANNING)
    return dataset


def rescan(dataset):
    """A new version of a registered dataset, read afresh from its bucket."""
    if dataset.source != Dataset.S3:
        raise DatasetError("only a dataset registered from a bucket can be scanned again")
    return dataset.new_version(state=DatasetVersion.SCANNING)


def scan(version):
    """Read every object under the dataset's prefix: path, size and SHA-256 into the manifest.
    The version is sealed when done, or failed with the reason."""
    from scheduler.staging import team_bucket_client

    dataset = version.dataset
    client = team_bucket_client(dataset)
    prefix = f"{dataset.s3_prefix}/" if dataset.s3_prefix else ""
    try:
        # A rescan replaces the copied manifest with what the bucket holds now.
        version.files.all().delete()
        paginator = client.get_paginator("list_objects_v2")
        count = 0
        for page in paginator.paginate(Bucket=dataset.s3_bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                key = obj["Key"]
                if key.endswith("/"):
                    continue
                body = client.get_object(Bucket=dataset.s3_bucket, Key=key)["Body"]
                digest, size = hashlib.sha256(), 0
                for chunk in iter(lambda: body.read(CHUNK), b""):
                    digest.update(chunk)
                    size += len(chunk)
                version.add_file(clean_path(key[len(prefix):]), size, digest.hexdigest(), key)
                count += 1
        if count == 0:
            raise DatasetError(f"there are no objects under s3://{dataset.s3_bucket}/{prefix}")
    except Exception as error:  # noqa: BLE001 - the reason is shown on the dataset's page
        log.warning("scan of %s failed: %s", version, error)
        version.fail(_reason(error))
        return version
    return version.seal()


def _reason(error):
    from botocore.exceptions import ClientError, EndpointConnectionError

    if isinstance(error, ClientError):
        code = error.response.get("Error", {}).get("Code", "")
        known = {
            "NoSuchBucket": "the bucket does not exist",
            "InvalidAccessKeyId": "the access key is not known to that endpoint",
            "SignatureDoesNotMatch": "the secret key does not match the access key",
            "AccessDenied": "the credentials may not read that bucket",
        }
        return known.get(code, f"the bucket refused: {code}")
    if isinstance(error, EndpointConnectionError):
        return "the endpoint cannot be reached"
    return str(error)


def claim_scans(limit=1):
    """Versions waiting to be scanned, claimed (one worker each)."""
    claimed = []
    for version in DatasetVersion.objects.filter(state=DatasetVersion.SCANNING, claimed_at__isnull=True)[:limit]:
        if DatasetVersion.objects.filter(pk=version.pk, claimed_at__isnull=True).update(claimed_at=timezone.now()) == 1:
            claimed.append(version)
    return claimed


def resolve(team, ref):
    """The version a job should pin for a dataset named by name or id, with an optional
    @version: "digits", "digits@2". Raises DatasetError."""
    ref = str(ref).strip()
    name, _, number = ref.rpartition("@") if "@" in ref else (ref, "", "")
    datasets = Dataset.objects.filter(team=team)
    dataset = datasets.filter(name=name).first()
    if dataset is None:
        import uuid

        try:
            dataset = datasets.filter(pk=uuid.UUID(name)).first()
        except ValueError:
            dataset = None
    if dataset is None:
        raise DatasetError(f"no dataset {name!r} in your team")
    if number:
        if not number.isdigit():
            raise DatasetError(f"{ref!r}: the version after @ must be a number")
        version = dataset.versions.filter(number=int(number)).first()
        if version is None or version.state != DatasetVersion.READY:
            raise DatasetError(f"{dataset.name} has no ready version {number}")
        return version
    version = dataset.latest_version()
    if version is None:
        raise DatasetError(f"{dataset.name} has no ready version yet")
    return version
