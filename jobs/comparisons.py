"""An evaluation job's comparison of models as its page, its JSON download and the API show it:
the evaluation it wrote, read as a hostile body, its table and bars, and the verdict (jobs.evaluation)."""

from core.json_limits import read_json
from core.storage import get_storage
from jobs import evaluation
from jobs.models import Job

EVALUATION_FILE = "evaluation.json"
MAX_EVALUATION_BYTES = 8 * 2**20  # a table of models and metrics: kilobytes


def read_evaluation(job):
    """The evaluation a finished evaluation job wrote, or None. The job's code wrote it, so it
    is read as a hostile body: at most MAX_EVALUATION_BYTES, nested at most as deep as a request
    body may be (ValueError with the reason, never a RecursionError's 500)."""
    artifact = job.artifacts.filter(name=EVALUATION_FILE).first()
    if artifact is None:
        return None
    with get_storage().open(artifact.key) as stream:
        raw = stream.read(MAX_EVALUATION_BYTES + 1)
    if len(raw) > MAX_EVALUATION_BYTES:
        raise ValueError(f"larger than {MAX_EVALUATION_BYTES // 2**20} MiB")
    return read_json(raw.decode("utf-8"))


def comparison(job):
    """{"evaluation", "table", "verdict" (or "error")} for an evaluation job's page; None when
    it has written no evaluation (yet)."""
    if job.kind != Job.KIND_EVALUATE:
        return None
    try:
        result = read_evaluation(job)
    except (OSError, ValueError) as error:
        return {"error": f"its evaluation.json cannot be read: {error}"}
    if result is None:
        return None
    labels = list((result.get("models") or {}).keys())
    out = {"evaluation": result, "labels": labels, "table": evaluation.table(result), **bars(result)}
    if {"new", "previous"} <= set(labels):
        try:
            out["verdict"] = evaluation.compare(result)
        except evaluation.EvaluationError as error:
            out["error"] = str(error)
    return out


def bars(result, width=200):
    """A bar per model of the compared metric (its mean per example), for the page's chart."""
    means = {}
    for label, model in (result.get("models") or {}).items():
        values = [float(v) for v in model.get("per_example") or []]
        if values:
            means[label] = sum(values) / len(values)
    if not means:
        return {}
    top = max(abs(v) for v in means.values()) or 1.0
    return {
        "bars": [
            {"label": label, "value": value, "y": 4 + 28 * i, "width": max(1, round(width * abs(value) / top))}
            for i, (label, value) in enumerate(means.items())
        ],
        "bars_height": 8 + 28 * len(means),
        "bars_metric": f"{result.get('metric') or 'score'} (mean per example)",
    }


def comparison_json(job, found):
    """What the JSON download and the API give of a comparison: the evaluation and the verdict."""
    body = {"job": str(job.pk), "name": job.name, **{k: v for k, v in found.items() if k in ("evaluation", "error")}}
    if "verdict" in found:
        body["verdict"] = found["verdict"].as_dict()
    return body
