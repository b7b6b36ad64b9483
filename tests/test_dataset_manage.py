"""Managing datasets: deleting one (the team's owner, never under an unfinished job), changing a
registered bucket's credentials, the allow-list that keeps teams' endpoints off internal
addresses, and scans that hash several objects at once.

The endpoint decision is a pure function, tested here without network or database; the rest
runs against a real S3 server (SeaweedFS, tests/seaweed.py), no mocks of boto3.

Over 500 lines: every management operation against a real S3 server."""

import io
import threading

import pytest
from django.urls import reverse
from django.utils import timezone
from rest_framework.authtoken.models import Token

from accounts.models import AuditEvent
from agent.staging import StagingError, team_bucket_client
from catalog import datasets
from catalog.models import Dataset, DatasetFile, DatasetUpload, DatasetVersion
from core import endpoints
from core.secrets_box import unseal
from core.storage import blob_key, get_storage
from jobs import lineage
from jobs.models import Artifact, Job
from tests.conftest import make_job
from tests.test_datasets import Api as DatasetsApi
from tests.test_datasets import payload, sha
from tests.test_settings import check

WRONG_SECRET = "wrong-secret-0000000000000000000000000"


def api_of(user):
    """tests.test_datasets.Api for the user, with the user's one token (made once)."""
    api = DatasetsApi(None)
    api.headers = {"HTTP_AUTHORIZATION": f"Token {Token.objects.get_or_create(user=user)[0].key}"}
    return api


# The endpoint allow-list: a pure decision ------------------------------------------------------------


@pytest.mark.nodb
@pytest.mark.parametrize(
    "host,addresses,kind",
    [
        ("127.0.0.1", ["127.0.0.1"], "a loopback address"),
        ("localhost", ["127.0.0.1", "::1"], "localhost (127.0.0.1) is at a loopback address"),
        ("::1", ["::1"], "a loopback address"),
        ("10.0.0.5", ["10.0.0.5"], "a private address"),
        ("db.internal", ["192.168.1.20"], "db.internal (192.168.1.20) is at a private address"),
        ("169.254.169.254", ["169.254.169.254"], "a link-local address"),  # a cloud's metadata service
        ("fe80::1", ["fe80::1"], "a link-local address"),
        ("224.0.0.1", ["224.0.0.1"], "a multicast address"),
        ("0.0.0.0", ["0.0.0.0"], "an unspecified address"),
        ("240.0.0.1", ["240.0.0.1"], "a reserved address"),
        ("100.64.0.1", ["100.64.0.1"], "a non-public address"),  # carrier-grade NAT
        ("mapped.example", ["::ffff:127.0.0.1"], "a loopback address"),  # IPv4 in IPv6 clothing
        ("mixed.example", ["93.184.215.14", "10.1.2.3"], "(10.1.2.3) is at a private address"),  # one bad address is enough
    ],
)
def test_an_endpoint_at_an_internal_address_is_refused(host, addresses, kind):
    reason = endpoints.refusal(host, addresses)
    assert reason is not None and kind in reason and "must be at a public address" in reason


@pytest.mark.nodb
def test_a_public_endpoint_passes():
    assert endpoints.refusal("s3.example.com", ["93.184.215.14", "2606:2800:21f:cb07:6820:80da:af6b:8b2c"]) is None


@pytest.mark.nodb
def test_a_host_that_resolves_to_nothing_is_refused():
    assert "cannot be found" in endpoints.refusal("nowhere.invalid", [])


@pytest.mark.nodb
@pytest.mark.parametrize(
    "host,addresses,allow",
    [
        ("127.0.0.1", ["127.0.0.1"], ["127.0.0.1"]),
        ("minio.internal", ["10.1.2.3"], ["minio.internal"]),  # by name, whatever it resolves to
        ("MinIO.Internal.", ["10.1.2.3"], ["minio.internal"]),
        ("store", ["10.1.2.3"], ["10.1.0.0/16"]),  # by network
        ("::1", ["::1"], ["[::1]"]),
    ],
)
def test_the_allow_list_lets_an_internal_endpoint_through(host, addresses, allow):
    assert endpoints.refusal(host, addresses, allow) is None


@pytest.mark.nodb
def test_an_allowed_network_does_not_cover_other_addresses_of_the_host():
    assert "10.2.0.1" in endpoints.refusal("store", ["10.1.2.3", "10.2.0.1"], ["10.1.0.0/16"])


@pytest.mark.nodb
@pytest.mark.parametrize("entry", ["10.0.0.0/33", "a b", "host/path", ""])
def test_a_bad_allow_list_entry_is_an_error(entry):
    with pytest.raises(ValueError, match="neither a host name nor an address"):
        endpoints.parse_allow_list([entry])


@pytest.mark.nodb
@pytest.mark.parametrize(
    "url,reason",
    [
        ("ftp://s3.example.com", "must be an http:// or https:// address"),
        ("http://", "has no host"),
        ("http://s3.example.com:99999", "not a valid URL"),
    ],
)
def test_an_endpoint_url_of_the_wrong_form_is_refused(url, reason):
    assert reason in endpoints.check_endpoint(url, allow=[])


@pytest.mark.nodb
def test_check_endpoint_resolves_the_host():
    assert endpoints.check_endpoint("", allow=[]) is None  # AWS's default endpoint
    assert "loopback" in endpoints.check_endpoint("http://127.0.0.1:9000", allow=[])
    assert "loopback" in endpoints.check_endpoint("http://localhost:9000", allow=[])  # resolved (no network needed)
    assert "loopback" in endpoints.check_endpoint("http://[::1]:9000", allow=[])
    assert endpoints.check_endpoint("http://127.0.0.1:9000", allow=["127.0.0.0/8"]) is None
    assert endpoints.check_endpoint("http://localhost:9000", allow=["localhost"]) is None


@pytest.mark.nodb
def test_a_bad_allow_list_stops_start_up(tmp_path):
    result = check(tmp_path, E31_S3_ENDPOINT_ALLOW="minio.internal,10.0.0.0/33")
    assert result.returncode != 0
    assert "ImproperlyConfigured" in result.stderr and "E31_S3_ENDPOINT_ALLOW" in result.stderr and "10.0.0.0/33" in result.stderr


# The allow-list where endpoints are used ---------------------------------------------------------------


@pytest.fixture
def nothing_allowed(settings):
    settings.E31_S3_ENDPOINT_ALLOW = []


def register_body(seaweed, bucket, **fields):
    return {
        "name": "lake",
        "uri": f"s3://{bucket}/data",
        "endpoint_url": seaweed.endpoint,
        "region": "us-east-1",
        "access_key_id": seaweed.access_key,
        "secret_access_key": seaweed.secret_key,
        **fields,
    }


def test_registering_a_loopback_endpoint_is_refused_unless_allowed(alice, client, nothing_allowed):
    api = api_of(alice)
    body = {"name": "lake", "uri": "s3://lake/data", "endpoint_url": "http://127.0.0.1:9000", "access_key_id": "AKIAEXAMPLE", "secret_access_key": "x" * 40}
    response = api.post(reverse("api:dataset-register-s3"), body)
    assert response.status_code == 400
    [message] = response.json()["errors"]["endpoint_url"]
    assert "127.0.0.1 is at a loopback address" in message
    client.force_login(alice)
    page = client.post(reverse("datasets:new"), {f"s3-{k}": v for k, v in body.items()})
    assert page.status_code == 200 and "is at a loopback address" in page.content.decode()
    assert not Dataset.objects.exists()


def test_a_scan_judges_the_endpoint_again(team_a, seaweed, settings):
    """Registered while allowed; the allow-list (or the host's DNS) changed before the scan."""
    bucket = seaweed.bucket("team")
    seaweed.client().put_object(Bucket=bucket, Key="data/a.csv", Body=b"a")
    dataset = datasets.register_s3(team_a, "lake", f"s3://{bucket}/data", seaweed.access_key, seaweed.secret_key, endpoint_url=seaweed.endpoint)
    settings.E31_S3_ENDPOINT_ALLOW = []
    version = datasets.scan(dataset.versions.get())
    assert version.state == "failed" and "127.0.0.1 is at a loopback address" in version.error
    assert not version.files.exists()


def test_staging_judges_the_endpoint_again(team_a, seaweed, settings):
    dataset = datasets.register_s3(team_a, "lake", "s3://lake/data", seaweed.access_key, seaweed.secret_key, endpoint_url=seaweed.endpoint)
    settings.E31_S3_ENDPOINT_ALLOW = []
    with pytest.raises(StagingError, match="the bucket's endpoint is refused: .*loopback address"):
        team_bucket_client(dataset)
    settings.E31_S3_ENDPOINT_ALLOW = ["127.0.0.1"]
    assert team_bucket_client(dataset) is not None  # a refusal is not remembered


# Faster scans ----------------------------------------------------------------------------------------------


def test_a_scan_hashes_several_objects_at_once_and_keeps_the_listing_order(team_a, seaweed, monkeypatch):
    bucket = seaweed.bucket("team")
    s3 = seaweed.client()
    objects = {f"data/part-{i:02d}.bin": payload(1000 * i + i, seed=i) for i in range(12)}
    objects["data/big.bin"] = payload(3 * 256 * 1024 + 17, seed=99)  # several buffers' worth
    objects["data/empty"] = b""
    for key, body in objects.items():
        s3.put_object(Bucket=bucket, Key=key, Body=body)
    # The first two objects meet at a barrier: a scan reading one object after the other never
    # gets past it.
    barrier, real = threading.Barrier(2, timeout=20), datasets._hash_object
    calls = []

    def meeting(client, bucket_name, key):
        calls.append(threading.current_thread().name)
        if len(calls) <= 2:
            barrier.wait()
        return real(client, bucket_name, key)

    monkeypatch.setattr(datasets, "_hash_object", meeting)
    dataset = datasets.register_s3(team_a, "lake", f"s3://{bucket}/data", seaweed.access_key, seaweed.secret_key, endpoint_url=seaweed.endpoint)
    version = datasets.scan(dataset.versions.get())
    assert version.state == "ready", version.error
    assert len(set(calls)) > 1 and all(name.startswith("scan-read") for name in calls)
    expected = sorted((key.removeprefix("data/"), len(body), sha(body)) for key, body in objects.items())
    assert list(version.files.order_by("id").values_list("path", "size", "sha256")) == expected  # added in listing order
    assert (version.file_count, version.total_bytes) == (len(objects), sum(len(b) for b in objects.values()))


def test_an_object_gone_during_the_scan_fails_it_with_its_name(team_a, seaweed, monkeypatch):
    bucket = seaweed.bucket("team")
    s3 = seaweed.client()
    for i in range(3):
        s3.put_object(Bucket=bucket, Key=f"data/{i}.txt", Body=b"x" * 10)
    real = datasets._hash_object

    def vanishing(client, bucket_name, key):
        if key == "data/1.txt":
            s3.delete_object(Bucket=bucket, Key=key)
        return real(client, bucket_name, key)

    monkeypatch.setattr(datasets, "_hash_object", vanishing)
    dataset = datasets.register_s3(team_a, "lake", f"s3://{bucket}/data", seaweed.access_key, seaweed.secret_key, endpoint_url=seaweed.endpoint)
    version = datasets.scan(dataset.versions.get())
    assert version.state == "failed"
    assert version.error == f"s3://{bucket}/data/1.txt went away while the bucket was scanned; scan it again"


# Credentials -------------------------------------------------------------------------------------------------


@pytest.fixture
def bucket_with_wrong_key(team_a, seaweed):
    """A registered bucket whose secret is wrong (as after the team revoked the key): its scan failed."""
    bucket = seaweed.bucket("team")
    seaweed.client().put_object(Bucket=bucket, Key="data/a.csv", Body=b"x,y\n1,2\n")
    dataset = datasets.register_s3(team_a, "lake", f"s3://{bucket}/data", seaweed.access_key, WRONG_SECRET, endpoint_url=seaweed.endpoint)
    [version] = datasets.claim_scans()
    assert datasets.scan(version).error == "the secret key does not match the access key"
    return dataset


def test_new_credentials_are_sealed_and_the_next_scan_reads_with_them(alice, seaweed, bucket_with_wrong_key):
    dataset = bucket_with_wrong_key
    old_client = team_bucket_client(dataset)
    response = api_of(alice).post(
        reverse("api:dataset-credentials", args=[dataset.pk]),
        {"access_key_id": seaweed.access_key, "secret_access_key": seaweed.secret_key, "rescan": True},
    )
    assert response.status_code == 200, response.json()
    body = response.json()
    assert seaweed.secret_key not in response.content.decode() and body["s3"]["credentials"] == "stored"
    assert body["s3"]["endpoint_url"] == seaweed.endpoint  # left out: unchanged
    assert [(v["number"], v["state"]) for v in body["versions"]] == [(2, "scanning"), (1, "failed")]
    dataset.refresh_from_db()
    assert seaweed.secret_key not in dataset.s3_credentials
    assert unseal(dataset.s3_credentials) == {"access_key_id": seaweed.access_key, "secret_access_key": seaweed.secret_key}
    # The clients are keyed on the sealed credentials: the new ones make a new client.
    assert team_bucket_client(dataset) is not old_client
    [version] = datasets.claim_scans()
    version = datasets.scan(version)
    assert version.state == "ready", version.error
    assert list(version.files.values_list("path", "size")) == [("a.csv", 8)]
    event = AuditEvent.objects.get(action="dataset.credentials")
    assert (event.user, event.object_id, event.via) == (alice, str(dataset.pk), "api")


def test_credentials_may_move_the_endpoint_and_region_and_need_no_rescan(alice, seaweed, bucket_with_wrong_key):
    dataset = bucket_with_wrong_key
    response = api_of(alice).post(
        reverse("api:dataset-credentials", args=[dataset.pk]),
        {"access_key_id": "AKIANEW", "secret_access_key": "new-secret", "endpoint_url": "http://127.0.0.1:9", "region": "eu-west-1"},
    )
    assert response.status_code == 200, response.json()
    assert response.json()["s3"] == {"uri": dataset.s3_uri, "endpoint_url": "http://127.0.0.1:9", "region": "eu-west-1", "credentials": "stored"}
    assert dataset.versions.count() == 1  # no rescan asked for


@pytest.mark.parametrize(
    "fields,field,message",
    [
        ({"secret_access_key": "s"}, "access_key_id", "This field is required."),
        ({"access_key_id": "AKIA"}, "secret_access_key", "This field is required."),
        ({"access_key_id": "AKIA", "secret_access_key": "s", "endpoint_url": "ftp://x.example"}, "endpoint_url", "Give an http:// or https:// address."),
        ({"access_key_id": "AKIA", "secret_access_key": "s", "region": "eu west"}, "region", "A region is letters, digits and dashes"),
    ],
)
def test_bad_credentials_are_refused_on_their_field(alice, bucket_with_wrong_key, fields, field, message):
    response = api_of(alice).post(reverse("api:dataset-credentials", args=[bucket_with_wrong_key.pk]), fields)
    assert response.status_code == 400 and message in response.json()["errors"][field][0]
    assert unseal(Dataset.objects.get(pk=bucket_with_wrong_key.pk).s3_credentials)["secret_access_key"] == WRONG_SECRET


def test_credentials_cannot_point_at_an_internal_endpoint(alice, bucket_with_wrong_key, nothing_allowed):
    body = {"access_key_id": "AKIA", "secret_access_key": "s", "endpoint_url": "http://10.0.0.7:9000"}
    response = api_of(alice).post(reverse("api:dataset-credentials", args=[bucket_with_wrong_key.pk]), body)
    assert response.status_code == 400 and "10.0.0.7 is at a private address" in response.json()["errors"]["endpoint_url"][0]


def test_only_the_owner_changes_credentials_and_only_of_a_bucket(alice, bob, charlie, bucket_with_wrong_key, team_a, storage_dir):
    url = reverse("api:dataset-credentials", args=[bucket_with_wrong_key.pk])
    body = {"access_key_id": "AKIA", "secret_access_key": "s"}
    member = api_of(bob).post(url, body)
    assert member.status_code == 403 and member.json()["detail"] == "Only the team's owner can change a bucket's credentials."
    assert api_of(charlie).post(url, body).status_code == 404
    uploaded = datasets.create_dataset(team_a, "files", {"a.txt": b"a"})
    response = api_of(alice).post(reverse("api:dataset-credentials", args=[uploaded.pk]), body)
    assert response.status_code == 400 and response.json()["detail"] == "Only a dataset registered from a bucket has credentials to change."
    assert not AuditEvent.objects.filter(action="dataset.credentials").exists()


def test_the_page_changes_credentials_for_the_owner_only(client, alice, bob, seaweed, bucket_with_wrong_key):
    dataset = bucket_with_wrong_key
    url = reverse("datasets:detail", args=[dataset.pk])
    client.force_login(alice)
    page = client.get(url).content.decode()
    assert 'id="credentials"' in page and f'value="{seaweed.endpoint}"' in page and seaweed.access_key not in page
    bad = client.post(reverse("datasets:credentials", args=[dataset.pk]), {"credentials-access_key_id": "", "credentials-secret_access_key": "typed-secret"})
    assert bad.status_code == 400 and "The credentials were not changed." in bad.content.decode() and "typed-secret" not in bad.content.decode()
    fields = {
        "credentials-access_key_id": seaweed.access_key,
        "credentials-secret_access_key": seaweed.secret_key,
        "credentials-endpoint_url": seaweed.endpoint,
        "credentials-region": "",
        "credentials-rescan": "on",
    }
    response = client.post(reverse("datasets:credentials", args=[dataset.pk]), fields, follow=True)
    text = response.content.decode()
    assert "The credentials of lake are changed. Scanning the bucket again as version" in text and seaweed.secret_key not in text
    assert datasets.scan(datasets.claim_scans()[0]).state == "ready"
    client.force_login(bob)
    page = client.get(url).content.decode()
    assert 'id="credentials"' not in page and "Only the team's owner can change the bucket's credentials or delete this dataset." in page
    member = client.post(reverse("datasets:credentials", args=[dataset.pk]), fields)
    assert member.status_code == 403 and member.content.decode() == "Only the team's owner can change a bucket's credentials."


# Deleting --------------------------------------------------------------------------------------------------------


def finished(job, state="succeeded", weights=True):
    """The job, ended (with weights in its output, as a retraining needs)."""
    Job.objects.filter(pk=job.pk).update(state=state, finished_at=timezone.now())
    if weights:
        key, size, digest = get_storage().save_blob(io.BytesIO(b"weights"))
        Artifact.objects.create(job=job, name="model.pt", key=key, size=size, sha256=digest)
    job.refresh_from_db()
    return job


@pytest.fixture
def s3_dataset(team_a, alice, s3_storage):
    """An uploaded dataset on S3 storage: version 1 sealed, version 2 open with an unfinished upload."""
    dataset = datasets.create_dataset(team_a, "digits", {"train.csv": b"x,y\n1,2\n", "more.csv": b"3,4\n"})
    version, _ = datasets.open_version(dataset)
    upload = datasets.start_upload(version, "late.csv", 10, user=alice)
    return dataset, upload


def test_the_owner_deletes_a_dataset_with_its_versions_and_unfinished_uploads(alice, s3_dataset):
    dataset, upload = s3_dataset
    blobs = list(DatasetFile.objects.filter(version__dataset=dataset).values_list("key", flat=True))
    storage = get_storage()
    response = api_of(alice).delete(reverse("api:dataset", args=[dataset.pk]))
    assert response.status_code == 204
    assert not Dataset.objects.filter(pk=dataset.pk).exists()
    assert not DatasetVersion.objects.exists() and not DatasetFile.objects.exists() and not DatasetUpload.objects.exists()
    # The unfinished upload's multipart upload is aborted in storage; the blobs stay (the sweep's).
    parts = storage.client.list_multipart_uploads(Bucket=storage.bucket).get("Uploads", [])
    assert upload.multipart_id not in [u["UploadId"] for u in parts]
    assert blobs and all(storage.exists(key) for key in blobs)
    event = AuditEvent.objects.get(action="dataset.delete")
    assert (event.user, event.object_type, event.object_id, event.via) == (alice, "dataset", str(dataset.pk), "api")
    assert event.label == "digits (2 versions)"
    assert api_of(alice).get(reverse("api:dataset", args=[dataset.pk])).status_code == 404


def test_a_member_may_not_delete_and_an_outsider_finds_nothing(alice, bob, charlie, team_a, storage_dir):
    dataset = datasets.create_dataset(team_a, "digits", {"a.csv": b"a"})
    url = reverse("api:dataset", args=[dataset.pk])
    response = api_of(bob).delete(url)
    assert response.status_code == 403 and response.json()["detail"] == "Only the team's owner can delete a dataset."
    assert api_of(charlie).delete(url).status_code == 404
    assert Dataset.objects.filter(pk=dataset.pk).exists() and not AuditEvent.objects.filter(action="dataset.delete").exists()


@pytest.mark.parametrize("state", ["queued", "starting", "running"])
def test_a_dataset_an_unfinished_job_uses_is_not_deleted(alice, team_a, storage_dir, state):
    dataset = datasets.create_dataset(team_a, "digits", {"a.csv": b"a"})
    heldout = datasets.create_dataset(team_a, "digits-heldout", {"b.csv": b"b"})
    job = make_job(alice, name="the-run", train_version=dataset.latest_version(), heldout_version=heldout.latest_version())
    Job.objects.filter(pk=job.pk).update(state=state)
    for target in (dataset, heldout):
        response = api_of(alice).delete(reverse("api:dataset", args=[target.pk]))
        assert response.status_code == 409
        assert response.json()["detail"] == (
            f"The dataset {target.name} is used by 1 unfinished job(s): the-run ({job.short_id}, {state}); "
            "it can be deleted once they have finished (or are cancelled)."
        )
    assert Dataset.objects.count() == 2


@pytest.mark.nodb
def test_the_in_use_reason_names_at_most_five_jobs():
    jobs = [(f"run-{i}", f"{i:08d}", "queued") for i in range(7)]
    reason = datasets.in_use_refusal("digits", jobs)
    assert reason.startswith("the dataset digits is used by 7 unfinished job(s): run-0 (00000000, queued), run-1")
    assert "run-4 (00000004, queued) and 2 more;" in reason and "run-5" not in reason
    assert datasets.in_use_refusal("digits", []) is None


def test_a_finished_job_keeps_the_name_of_a_deleted_dataset(alice, team_a, client, storage_dir):
    dataset = datasets.create_dataset(team_a, "digits", {"a.csv": b"a"})
    heldout = datasets.create_dataset(team_a, "digits-heldout", {"b.csv": b"b"})
    job = finished(make_job(alice, name="the-run", train_version=dataset.latest_version(), heldout_version=heldout.latest_version()))
    assert datasets.delete_dataset(dataset) == 1
    assert datasets.delete_dataset(heldout) == 1
    job.refresh_from_db()
    assert (job.train_version, job.train_label, job.heldout_version, job.heldout_label) == (None, "digits@1", None, "digits-heldout@1")
    body = api_of(alice).get(reverse("api:job", args=[job.pk])).json()
    assert (body["train_dataset"], body["heldout_dataset"]) == ("digits@1", "digits-heldout@1")
    text = client_spec(client, alice, job)
    assert "digits@1" in text and "digits-heldout@1" in text
    client.force_login(alice)
    page = client.get(reverse("jobs:detail", args=[job.pk])).content.decode()
    assert 'digits@1 <span class="muted small">(deleted since)</span>' in page


def client_spec(client, user, job):
    client.force_login(user)
    response = client.get(reverse("jobs:spec", args=[job.pk]))
    assert response.status_code == 200
    return (b"".join(response.streaming_content) if response.streaming else response.content).decode()


def test_a_job_whose_dataset_was_deleted_cannot_be_retrained_or_compared(alice, team_a, rate, storage_dir):
    dataset = datasets.create_dataset(team_a, "digits", {"a.csv": b"a"})
    job = finished(make_job(alice, name="the-run", train_version=dataset.latest_version()))
    datasets.delete_dataset(dataset)
    job.refresh_from_db()
    with pytest.raises(lineage.LineageError, match=r"the-run \(\w+\) used digits@1, deleted since: it cannot be retrained on the same data"):
        lineage.retrain(job, alice)
    response = api_of(alice).post(reverse("api:job-retrain", args=[job.pk]), {})
    assert response.status_code == 409 and "deleted since" in response.json()["detail"], response.json()
    heldout = datasets.create_dataset(team_a, "held", {"b.csv": b"b"})
    tuned = finished(make_job(alice, name="tuned", kind=Job.KIND_FINETUNE, heldout_version=heldout.latest_version()))
    lineage.pin_model(tuned, "start", [{"name": "model.pt", "key": "k", "size": 1, "sha256": "0" * 64}])
    datasets.delete_dataset(heldout)
    tuned.refresh_from_db()
    with pytest.raises(lineage.LineageError, match="no held-out data to evaluate on: held@1 was deleted"):
        lineage.compare(tuned, alice)


def test_deleting_a_registered_bucket_s_dataset_leaves_the_bucket_alone(alice, team_a, seaweed):
    bucket = seaweed.bucket("team")
    s3 = seaweed.client()
    s3.put_object(Bucket=bucket, Key="data/a.csv", Body=b"a")
    dataset = datasets.register_s3(team_a, "lake", f"s3://{bucket}/data", seaweed.access_key, seaweed.secret_key, endpoint_url=seaweed.endpoint)
    assert datasets.scan(datasets.claim_scans()[0]).state == "ready"
    assert api_of(alice).delete(reverse("api:dataset", args=[dataset.pk])).status_code == 204
    assert s3.get_object(Bucket=bucket, Key="data/a.csv")["Body"].read() == b"a"


def test_a_scan_whose_dataset_is_deleted_meanwhile_stops_quietly(team_a, seaweed):
    bucket = seaweed.bucket("team")
    seaweed.client().put_object(Bucket=bucket, Key="data/a.csv", Body=b"a")
    dataset = datasets.register_s3(team_a, "lake", f"s3://{bucket}/data", seaweed.access_key, seaweed.secret_key, endpoint_url=seaweed.endpoint)
    [claimed] = datasets.claim_scans()
    claimed.dataset  # noqa: B018 - loaded, as by a scan under way
    datasets.delete_dataset(dataset)
    datasets.scan(claimed)  # neither raises nor brings anything back
    [unloaded] = [DatasetVersion(pk=claimed.pk, dataset_id=dataset.pk)]
    datasets.scan(unloaded)  # deleted before its scan began
    assert not DatasetVersion.objects.exists() and not DatasetFile.objects.exists()


def test_a_file_being_completed_holds_the_deletion_back(alice, team_a, storage_dir):
    dataset = datasets.create_upload_dataset(team_a, "digits")
    upload = datasets.start_upload(dataset.versions.get(), "a.csv", 3, user=alice)
    DatasetUpload.objects.filter(pk=upload.pk).update(state=DatasetUpload.COMPLETING)
    with pytest.raises(datasets.UploadConflict, match="the upload of a.csv is being completed; delete the dataset once it is done"):
        datasets.delete_dataset(dataset)
    assert Dataset.objects.filter(pk=dataset.pk).exists()


def test_the_page_deletes_for_the_owner_once_confirmed(client, alice, bob, team_a, storage_dir):
    dataset = datasets.create_dataset(team_a, "digits", {"a.csv": b"a"})
    blob = dataset.latest_version().files.get().key
    url = reverse("datasets:delete", args=[dataset.pk])
    client.force_login(bob)
    member = client.post(url, {"confirm": "yes"})
    assert member.status_code == 403 and member.content.decode() == "Only the team's owner can delete a dataset."
    client.force_login(alice)
    page = client.get(reverse("datasets:detail", args=[dataset.pk])).content.decode()
    assert 'id="delete"' in page and 'name="confirm"' in page
    unconfirmed = client.post(url, {}, follow=True)
    assert "Tick the box to confirm that digits is to be deleted." in unconfirmed.content.decode()
    assert Dataset.objects.filter(pk=dataset.pk).exists()
    job = make_job(alice, name="the-run", train_version=dataset.latest_version())
    refused = client.post(url, {"confirm": "yes"}, follow=True)
    assert f"The dataset digits is used by 1 unfinished job(s): the-run ({job.short_id}, queued)" in refused.content.decode()
    finished(job, weights=False)
    response = client.post(url, {"confirm": "yes"})
    assert response.status_code == 302 and response["Location"] == reverse("datasets:list")
    listing = client.get(response["Location"]).content.decode()
    assert "Dataset digits is deleted. Jobs that used it still name it." in listing
    assert not Dataset.objects.filter(pk=dataset.pk).exists() and get_storage().exists(blob)
    assert AuditEvent.objects.get(action="dataset.delete").via == "web"
    assert blob == blob_key(sha(b"a"))
