"""The datasets' move from the jobs app to catalog (issue 22) keeps every row: a database migrated
as it was before the move (jobs 0018, no catalog), filled, then migrated forward, holds the same
datasets, versions, files and uploads, with every link between them and from the jobs that pinned
them, and the content types (with their permissions) that pointed at them now name catalog.

The migrations keep the tables (catalog/migrations/0001_initial.py): a CreateModel in their
place would fail on the tables already there, a table created afresh would come up empty.
"""

import pytest
from django.contrib.contenttypes.models import ContentType
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from catalog.models import Dataset, DatasetFile, DatasetUpload, DatasetVersion
from jobs.models import FolderUpload, Job, JobInput

# Before the move: jobs as it was, catalog not there at all.
JOBS_BEFORE = ("jobs", "0018_job_stop_requested")
BEFORE = [JOBS_BEFORE, ("catalog", None)]
MOVED = ["dataset", "datasetversion", "datasetfile", "datasetupload"]


def migrate_back():
    """The database as it was before the move, and its models: every migration's applied now."""
    MigrationExecutor(connection).migrate(BEFORE)
    loader = MigrationExecutor(connection).loader
    assert JOBS_BEFORE in loader.applied_migrations and ("catalog", "0001_initial") not in loader.applied_migrations
    return loader.project_state(list(loader.applied_migrations), at_end=True).apps


def migrate_forward():
    """The database migrated to the latest migrations, as the code's models have it."""
    executor = MigrationExecutor(connection)
    executor.migrate(executor.loader.graph.leaf_nodes())
    ContentType.objects.clear_cache()


def fill(apps):
    """A team's dataset as the old models held it: two versions, their files, an upload into the
    open one, a folder's file, and a job pinning the versions (as its sets and a named input)."""
    get = apps.get_model
    user = get("auth", "User").objects.create(username="alice")
    team = get("accounts", "Team").objects.create(name="Team A")
    dataset = get("jobs", "Dataset").objects.create(team=team, name="digits", description="handwritten")
    Version, File, Upload = get("jobs", "DatasetVersion"), get("jobs", "DatasetFile"), get("jobs", "DatasetUpload")
    v1 = Version.objects.create(dataset=dataset, number=1, state="ready", file_count=2, total_bytes=30)
    v2 = Version.objects.create(dataset=dataset, number=2, parent=v1, state="open")
    files = [File.objects.create(version=v, path=path, key=f"blobs/{path}", size=15, sha256="a" * 64) for v in (v1, v2) for path in ("a.csv", "b.csv")]
    upload = Upload.objects.create(version=v2, path="c.csv", size=10, chunk_size=8, received=8, key="incoming/c", created_by=user)
    folder = get("jobs", "FolderUpload").objects.create(team=team, created_by=user, file_count=1, total_bytes=3)
    folder_file = Upload.objects.create(folder=folder, path="myproj/train.py", size=3, chunk_size=8, key="incoming/t")
    job = get("jobs", "Job").objects.create(team=team, created_by=user, name="train", gpus=1, train_version=v1, heldout_version=v2, train_label="digits@1")
    get("jobs", "JobInput").objects.create(job=job, name="extra", version=v1, label="digits@1")
    return {"dataset": dataset, "versions": (v1, v2), "files": files, "upload": upload, "folder": folder, "folder_file": folder_file, "job": job}


def old_content_types(apps):
    """The moved models' content types as the old database has them, with a permission granted
    on one (what must keep pointing at its model), and a stale catalog twin of one, as a
    post_migrate of an earlier migrate forward (then back) leaves."""
    ContentType = apps.get_model("contenttypes", "ContentType")
    kept = {model: ContentType.objects.get_or_create(app_label="jobs", model=model)[0].pk for model in MOVED}
    ContentType.objects.filter(app_label="catalog").delete()
    ContentType.objects.create(app_label="catalog", model="dataset")
    permission = apps.get_model("auth", "Permission").objects.create(content_type_id=kept["dataset"], codename="audit_dataset", name="Can audit dataset")
    permission.group_set.create(name="auditors")
    return kept


@pytest.mark.django_db(transaction=True)
def test_moving_the_datasets_to_catalog_keeps_every_row_and_link():
    old = migrate_back()
    with pytest.raises(LookupError):
        old.get_model("catalog", "Dataset")
    before = fill(old)
    content_types = old_content_types(old)
    migrate_forward()

    dataset = Dataset.objects.get(pk=before["dataset"].pk)
    assert (dataset.team.name, dataset.name, dataset.description) == ("Team A", "digits", "handwritten")
    v1, v2 = (DatasetVersion.objects.get(pk=v.pk) for v in before["versions"])
    assert (v1.dataset, v1.number, v1.state, v1.file_count, v1.total_bytes) == (dataset, 1, "ready", 2, 30)
    assert (v2.dataset, v2.parent, v2.state) == (dataset, v1, "open")
    assert list(dataset.versions.all()) == [v2, v1]
    assert sorted(DatasetFile.objects.values_list("pk", "version_id", "path", "key")) == sorted((f.pk, f.version_id, f.path, f.key) for f in before["files"])
    assert [f.path for f in v1.files.all()] == ["a.csv", "b.csv"]
    upload = DatasetUpload.objects.get(pk=before["upload"].pk)
    assert (upload.version, upload.path, upload.received, upload.created_by.username) == (v2, "c.csv", 8, "alice")
    assert list(v2.uploads.all()) == [upload]
    # A folder's file stays its folder's (a job's code, in jobs), through the relation by name.
    folder = FolderUpload.objects.get(pk=before["folder"].pk)
    assert [f.pk for f in folder.files.all()] == [before["folder_file"].pk]
    assert DatasetUpload.objects.get(pk=before["folder_file"].pk).folder == folder

    job = Job.objects.get(pk=before["job"].pk)
    assert (job.train_version, job.heldout_version, job.train_label) == (v1, v2, "digits@1")
    assert JobInput.objects.get(job=job).version == v1
    assert Job.objects.filter(train_version__dataset=dataset).get() == job

    # The content types are the same rows, now catalog's; the stale twin is gone.
    for model, pk in content_types.items():
        moved = ContentType.objects.get(pk=pk)
        assert (moved.app_label, moved.model) == ("catalog", model)
        assert moved.model_class() is {"dataset": Dataset, "datasetversion": DatasetVersion, "datasetfile": DatasetFile, "datasetupload": DatasetUpload}[model]
    assert not ContentType.objects.filter(app_label="jobs", model__in=MOVED).exists()
    assert ContentType.objects.get_for_model(Dataset).pk == content_types["dataset"]
    permission = ContentType.objects.get(pk=content_types["dataset"]).permission_set.get(codename="audit_dataset")
    assert [g.name for g in permission.group_set.all()] == ["auditors"]


@pytest.mark.django_db(transaction=True)
def test_the_move_is_undone_as_it_was_done():
    """Migrating back to before the move gives the old models their rows and content types again."""
    dataset_type = ContentType.objects.get_for_model(Dataset).pk
    old = migrate_back()
    try:
        assert old.get_model("contenttypes", "ContentType").objects.get(pk=dataset_type).app_label == "jobs"
        before = fill(old)
        assert old.get_model("jobs", "Dataset").objects.get().versions.count() == 2
    finally:
        migrate_forward()  # the next tests' database, whatever happened here
    assert DatasetVersion.objects.filter(dataset_id=before["dataset"].pk).count() == 2
    assert ContentType.objects.get(pk=dataset_type).app_label == "catalog"
