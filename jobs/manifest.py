"""A job's manifest: every file it needs in its folder (its code and uploads, the models it starts
from, the dataset versions it pinned), each by size and SHA-256 and where its bytes are. The
scheduler prefers nodes whose cache holds them; the runner stages them (agent.staging)."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Item:
    dest: str  # relative to the job's folder: "code/.../train.py", "data/train/part-0.csv"
    size: int
    sha256: str
    source: tuple  # ("storage", key) or ("s3", dataset_id, object_key)
    role: str  # "code", "train", "heldout", "model"


def job_manifest(job):
    """Every file the job needs, from its uploads and the dataset versions it pinned (its
    training and held-out sets, and its named inputs, each in data/<name>/)."""
    items = []
    for upload in job.uploads.all():
        if upload.role == "model":
            continue  # pinned into the job's models when it was submitted
        folder = "code" if upload.role == "code" else f"data/{upload.channel}" if upload.role == "input" else f"data/{upload.role}"
        items.append(Item(f"{folder}/{upload.name}", upload.size, upload.sha256, ("storage", upload.key), upload.role))
    for model in job.models.all():
        for f in model.files:
            items.append(Item(f"model/{model.label}/{f['name']}", f["size"], f["sha256"], ("storage", f["key"]), "model"))
    named = [(i.name, i.version) for i in job.inputs.select_related("version__dataset")]
    for role, version in (("train", job.train_version), ("heldout", job.heldout_version), *named):
        if version is None:
            continue
        dataset = version.dataset
        for f in version.files.all():
            source = ("s3", str(dataset.pk), f.key) if dataset.source == dataset.S3 else ("storage", f.key)
            items.append(Item(f"data/{role}/{f.path}", f.size, f.sha256, source, role))
    return items


def manifest_digests(items):
    return {item.sha256 for item in items}
