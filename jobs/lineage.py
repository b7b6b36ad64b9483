"""Jobs made from jobs: a fine-tuning that starts from a previous job's weights, a retraining
of a finished job on its old data plus new files, and an evaluation that compares a fine-tuned
model with the model it started from.

Models are pinned as files (storage keys of content-addressed blobs, with size and SHA-256)
when the job is submitted: the job carries its own starting point."""

from datetime import timedelta
from decimal import ROUND_DOWN, Decimal

from django.conf import settings
from django.db import models, transaction

from catalog.models import DatasetFile, DatasetVersion
from jobs import states
from jobs.models import Job, JobInput, JobModel, Upload
from jobs.specfile import JOB_WORK_FIELDS

# What of a job's output is its model: the files at the top of its output folder (weights, and
# the recipe.json that describes them); other outputs (SageMaker's data/ folder, a checkpoint
# returned in checkpoints/) are not.
WEIGHT_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin")


class LineageError(ValueError):
    pass


def model_files(artifacts):
    """Of a job's output files, those of its model (see WEIGHT_SUFFIXES), as JobModel files;
    [] when no weights are among them."""
    files = [{"name": a.name, "key": a.key, "size": a.size, "sha256": a.sha256} for a in artifacts if "/" not in a.name]
    return files if any(f["name"].endswith(WEIGHT_SUFFIXES) for f in files) else []


def weights_of(job):
    """The files of a finished job's model (its output), as JobModel files. LineageError if it
    has none."""
    if job.state not in (states.SUCCEEDED, states.STOPPED):
        raise LineageError(f"{job.name} ({job.short_id}) has not finished with weights: it is {job.state}.")
    files = model_files(job.artifacts.order_by("name"))
    if not files:
        raise LineageError(f"{job.name} ({job.short_id}) left no weights (no .safetensors, .pt, .pth or .bin file in its output).")
    return files


def files_of_uploads(uploads):
    return [{"name": u.name, "key": u.key, "size": u.size, "sha256": u.sha256} for u in uploads]


def pin_model(job, label, files, source_job=None, description=""):
    return JobModel.objects.create(job=job, label=label, files=files, source_job=source_job, description=description)


def copy_job(job, user, **changes):
    """A new queued job with the work and request of `job` (its script and data uploads are
    shared, not copied: the same blobs), with `changes` applied."""
    fields = {name: getattr(job, name) for name in ("team_id", *JOB_WORK_FIELDS, "train_version", "heldout_version", "ceiling_amount", "ceiling_gpu_hours")}
    fields.update(name=job.name, experiment=job.experiment, kind=job.kind, parent=job, created_by=user)
    fields.update(changes)
    new = Job.objects.create(**fields)
    JobInput.objects.bulk_create([JobInput(job=new, name=i.name, version=i.version, label=i.label) for i in job.inputs.all()])
    return new


def share_uploads(source, target, roles):
    """The uploads of `source` in roles, attached to `target` too (new rows, the same blobs)."""
    Upload.objects.bulk_create(
        Upload(
            team_id=target.team_id,
            uploaded_by=u.uploaded_by,
            job=target,
            role=u.role,
            channel=u.channel,
            name=u.name,
            key=u.key,
            size=u.size,
            sha256=u.sha256,
        )
        for u in source.uploads.filter(role__in=roles)
    )


def extend_version(version, uploads):
    """A new version of the dataset of `version`: its files plus the uploaded ones (an upload
    named like an old file replaces it). The unchanged files are shared, so a runner that staged
    the old version moves only the new bytes."""
    dataset = version.dataset
    if dataset.source != dataset.UPLOAD:
        raise LineageError(f"{dataset.name} is read from a bucket: add the new files to the bucket and rescan it, then retrain on its new version.")
    with transaction.atomic():
        locked = type(dataset).objects.select_for_update().get(pk=dataset.pk)
        number = (locked.versions.aggregate(n=models.Max("number"))["n"] or 0) + 1
        new = DatasetVersion.objects.create(dataset=dataset, number=number, parent=version, state=DatasetVersion.OPEN)
        DatasetFile.objects.bulk_create(DatasetFile(version=new, path=f.path, size=f.size, sha256=f.sha256, key=f.key) for f in version.files.all())
        for upload in uploads:
            new.add_file(upload.name, upload.size, upload.sha256, upload.key)
        return new.seal()


def deleted_data(job):
    """The dataset versions the job used that are gone (their dataset was deleted), as labels."""
    pinned = [(job.train_label, job.train_version), (job.heldout_label, job.heldout_version), *((i.label, i.version) for i in job.inputs.all())]
    return [label for label, version in pinned if label and version is None]


@transaction.atomic
def retrain(job, user, *, new_data=(), name="", experiment="", request=None, work=None, inputs=None):
    """A fine-tuning of `job`'s weights with its work and request, on its old training data
    plus `new_data` (kept uploads), in `experiment` (blank: the job's). request: overrides of the
    request fields (gpus, span_hours, ceiling_*, not_before, deadline, ...); work: of the work's
    (args, hyperparameters, config); inputs: {name: dataset version} read instead of the job's
    (train and heldout: its sets)."""
    weights = weights_of(job)
    gone = deleted_data(job)
    if gone:
        raise LineageError(
            f"{job.name} ({job.short_id}) used {' and '.join(gone)}, deleted since: it cannot be retrained on the same data. "
            "Submit a fine-tuning of its weights on data that exists."
        )
    changes = {**(work or {}), **(request or {})}
    changes.update(name=name or f"{job.name} (retrained)", experiment=experiment or job.experiment, kind=Job.KIND_FINETUNE)
    inputs = dict(inputs or {})
    for input_name, field in (("train", "train_version"), ("heldout", "heldout_version")):
        if input_name in inputs:
            changes[field] = inputs.pop(input_name)
    new_data = list(new_data)
    if job.train_version is not None and new_data:
        changes["train_version"] = extend_version(job.train_version, new_data)
    new = copy_job(job, user, **changes)
    for input_name, version in inputs.items():  # a named input replaced (or added)
        JobInput.objects.update_or_create(job=new, name=input_name, defaults={"version": version, "label": version.label})
    share_uploads(job, new, [Upload.CODE, Upload.TRAIN, Upload.HELDOUT, Upload.INPUT])
    if job.train_version is None and new_data:
        Upload.objects.filter(pk__in=[u.pk for u in new_data]).update(job=new)
    elif new_data:
        # Their files are in the new dataset version; the uploads are spent.
        Upload.objects.filter(pk__in=[u.pk for u in new_data]).delete()
    pin_model(new, "start", weights, source_job=job, description=f"the weights of {job.name} ({job.short_id})")
    new.record("state", at=new.created_at, data={"state": new.state, "from": None, "reason": f"retraining of {job.short_id}"})
    new.refresh_from_db()
    return new


@transaction.atomic
def compare(job, user):
    """An evaluation of a finished fine-tuning's new weights against the weights it started
    from, on its held-out data, as a batch job of its own in the queue (billed like any job)."""
    if job.kind != Job.KIND_FINETUNE:
        raise LineageError("Only a fine-tuning job can be compared with the model it started from.")
    start = job.models.filter(label="start").first()
    if start is None:
        raise LineageError(f"{job.name} ({job.short_id}) has no starting model to compare with.")
    weights = weights_of(job)
    if job.heldout_version is None and job.heldout_label:
        raise LineageError(f"{job.name} ({job.short_id}) has no held-out data to evaluate on: {job.heldout_label} was deleted.")
    if job.heldout_version is None and not job.uploads.filter(role=Upload.HELDOUT).exists():
        raise LineageError(f"{job.name} ({job.short_id}) has no held-out data to evaluate on.")
    config = dict(job.config)
    config["mode"] = "evaluate"
    new = copy_job(
        job,
        user,
        name=f"{job.name}: compare with previous",
        kind=Job.KIND_EVALUATE,
        config=config,
        gpus=1,
        train_version=None,
        early_stop_metric="",
        early_stop_patience=None,
        not_before=None,
        deadline=None,
    )
    share_uploads(job, new, [Upload.CODE, Upload.HELDOUT])
    pin_model(new, "new", weights, source_job=job, description=f"the weights {job.name} ({job.short_id}) trained")
    pin_model(new, "previous", start.files, source_job=start.source_job, description=f"what it started from: {start.description}")
    new.record("state", at=new.created_at, data={"state": new.state, "from": None, "reason": f"comparison of {job.short_id} with its start"})
    new.refresh_from_db()
    return new


SMOKE_SPAN_HOURS = Decimal("0.1")


def script_smoke_hours():
    """A script's smoke run's span: E31_SMOKE_MINUTES, in whole ten-thousandths of an hour (the
    span's unit), rounded down: at most that long."""
    hours = (Decimal(str(settings.E31_SMOKE_MINUTES)) / 60).quantize(Decimal("0.0001"), rounding=ROUND_DOWN)
    return max(hours, Decimal("0.0001"))


@transaction.atomic
def smoke_run(job):
    """The short run a job makes first, one GPU of the same type: a recipe's with its smoke
    option (a few steps on 1% of the data), at most a tenth of an hour; a script's on a sample
    of each input (agent/smoke.py, cut by the runner), at most E31_SMOKE_MINUTES, and
    passing if it has not failed by then. It is a job of its own, queued ahead, billed like
    any; `job` waits for it to succeed and fails if it does not."""
    config, limit = ({**job.config, "smoke": True}, SMOKE_SPAN_HOURS) if job.recipe else (job.config, script_smoke_hours())
    span = min(job.span_hours, limit) if job.span_hours is not None else limit
    smoke = copy_job(
        job,
        job.created_by,
        name=f"{job.name} (smoke run)",
        config=config,
        gpus=1,
        span_hours=span,
        ceiling_amount=None,
        ceiling_gpu_hours=None,
        not_before=None,
        deadline=None,
        early_stop_metric="",
        early_stop_patience=None,
        created_at=job.created_at - timedelta(microseconds=1),  # ahead of its job in the queue
    )
    share_uploads(job, smoke, [Upload.CODE, Upload.TRAIN, Upload.HELDOUT, Upload.INPUT])
    for model in job.models.all():
        pin_model(smoke, model.label, model.files, source_job=model.source_job, description=model.description)
    Job.objects.filter(pk=job.pk).update(smoke_run=smoke, wait_reason="waiting for its smoke run to succeed")
    smoke.record("state", at=smoke.created_at, data={"state": smoke.state, "from": None, "reason": f"smoke run of {job.short_id}"})
    job.refresh_from_db()
    return smoke


def settle_smoke_runs():
    """Jobs whose smoke run ended without success fail (they never held compute: nothing is
    billed); a cancelled job's smoke run is cancelled too. Returns the jobs failed."""
    failed = []
    for job in Job.objects.filter(state=states.QUEUED, smoke_run__state__in=states.TERMINAL - {states.SUCCEEDED}).select_related("smoke_run"):
        smoke = job.smoke_run
        why = f"its smoke run {smoke.short_id} {smoke.get_state_display().lower()}" + (f": {smoke.reason}" if smoke.reason else "")
        try:
            job.finish(states.FAILED, reason=why)
        except states.InvalidTransition:
            continue  # it moved on meanwhile
        failed.append(job)
    for job in Job.objects.filter(state=states.CANCELLED, smoke_run__state__in=states.ACTIVE).select_related("smoke_run"):
        job.smoke_run.request_cancel()
    return failed
