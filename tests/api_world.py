"""A team's worth of real objects for the API-wide tests (permissions, schema fuzzing): a job
with an artifact, logs and a usage record, a dataset with an open version and an unfinished
upload, and an issued invoice. Their names are unique words, to search answers for leaks."""

import io
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from billing import invoice_service, meter
from billing.models import UsageRecord
from catalog import datasets
from core.storage import get_storage
from e31web.demo import add_dataset
from jobs import folder_uploads
from jobs.models import Artifact, JobEvent
from scheduler.models import Allocation, Node
from sweeps.models import Sweep, Trial
from tests.conftest import make_job

UTC = UTC


@dataclass
class World:
    job: object
    artifact: object
    dataset: object
    upload: object
    invoice: object
    folder: object = None
    sweep: object = None

    def path_values(self):
        """A value for each path parameter of the API's routes, naming these objects."""
        return {
            "job_id": self.job.pk,
            "dataset_id": self.dataset.pk,
            "number": self.upload.version.number,
            "upload_id": self.upload.pk,
            "invoice_id": self.invoice.pk,
            "name": self.artifact.name,
            "folder_id": self.folder.pk,
            "file_id": self.folder.files.order_by("path").first().pk,
            "sweep_id": self.sweep.pk,
        }

    def secrets(self):
        """What must never appear in an answer to someone outside the team."""
        return [
            str(self.job.pk),
            self.job.name,
            str(self.dataset.pk),
            self.dataset.name,
            str(self.upload.pk),
            str(self.invoice.pk),
            self.job.team.name,
            str(self.folder.pk),
            str(self.sweep.pk),
            self.sweep.name,
        ]


def make_world(user, word):
    team = user.membership.team
    job = make_job(user, name=f"{word}-job")
    JobEvent.append(job.pk, [JobEvent(kind="log", at=datetime.now(UTC), stream="stdout", text=f"{word} says hello")])
    JobEvent.append(job.pk, [JobEvent(kind="metric", at=datetime.now(UTC), data={"step": 1, "values": {"loss": 0.5}})])
    key, size, sha256 = get_storage().save_blob(io.BytesIO(b"weights"))
    artifact = Artifact.objects.create(job=job, name="model.pt", key=key, size=size, sha256=sha256)
    dataset = add_dataset(team, f"{word}-data", {"numbers.csv": b"x,y\n1,2\n"})
    version, _ = datasets.open_version(dataset)
    upload = datasets.start_upload(version, "more.csv", 10, user=user)
    node, _ = Node.objects.get_or_create(name=f"{word}-node", defaults={"device_type": "cpu", "devices": 8})
    started = datetime(2026, 11, 3, tzinfo=UTC)
    ended = started + timedelta(hours=1)
    allocation = Allocation.objects.create(
        job=job, node=node, devices=[0], device_type="cpu", rate=Decimal("2.40"), started_at=started, ended_at=ended, end_reason=Allocation.EXITED
    )
    UsageRecord.objects.create(
        team=team,
        job=job,
        allocation=allocation,
        gpu_type="cpu",
        gpus=1,
        started_at=started,
        ended_at=ended,
        held_seconds=3600,
        rate=Decimal("2.40"),
        amount=meter.charge(1, 3600, Decimal("2.40")),
    )
    invoice = invoice_service.invoice_team_month(team, 2026, 11, now=datetime(2026, 12, 15, tzinfo=UTC))
    # A job's code folder on its way, one of its files part sent (jobs/folder_uploads.py).
    folder = folder_uploads.open_folder(team, user, [(f"{word}-code/train.py", 12), (f"{word}-code/pkg/m.py", 3)])
    # A sweep over the job's hyperparameters, its trial a job of its own (sweeps/).
    sweep = Sweep.objects.create(
        team=team, created_by=user, name=f"{word}-sweep", template=job, space={"lr": {"type": "choice", "choices": [0.1, 0.01]}},
        method="grid", objective="loss", max_trials=2, parallel=1, ceiling_amount=Decimal("10"),
    )  # fmt: skip
    Trial.objects.create(sweep=sweep, number=1, params={"lr": 0.1}, job=make_job(user, name=f"{word}-sweep #1", hyperparameters={"lr": 0.1}))
    return World(job=job, artifact=artifact, dataset=dataset, upload=upload, invoice=invoice, folder=folder, sweep=sweep)
