"""Pages for jobs made from jobs: retrain a finished job, compare a fine-tuning with its start,
and the comparison's verdict (see jobs.lineage and jobs.evaluation)."""

import json
import shlex

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404, JsonResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from accounts import audit
from accounts.access import require_team
from e31web.parsers import read_json
from e31web.storage import get_storage
from jobs import evaluation, lineage, spec
from jobs.forms import MultipleFileInput, RequestForm, WorkTextFields, keep_uploads
from jobs.models import Job, Upload
from jobs.views import get_job
from scheduler import launch

EVALUATION_FILE = "evaluation.json"
MAX_EVALUATION_BYTES = 8 * 2**20  # a table of models and metrics: kilobytes


def plain(number):
    """A Decimal as a person writes it: 1.0000 as "1", 0.2500 as "0.25"."""
    if number is None:
        return None
    text = f"{number:f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


class RetrainForm(WorkTextFields, RequestForm):
    """Retrain a finished job overnight: the same work, its weights as the starting model, its
    training data plus new files, and a request (prefilled from the job)."""

    name = forms.CharField(max_length=200, required=False, help_text="Defaults to the job's name, retrained.")
    data = forms.FileField(
        required=False,
        widget=MultipleFileInput,
        label="New training files",
        help_text="Added to the old training data; only these are staged again.",
    )
    kept_data = forms.ModelMultipleChoiceField(queryset=Upload.objects.none(), required=False, widget=forms.MultipleHiddenInput)
    # The work's settings, prefilled with the job's: what is left as it was is copied.
    args = forms.CharField(
        max_length=4000, required=False, label="Arguments", help_text="As on a command line; $E31_DATA_DIR and the like are the job's folders."
    )
    hyperparameters = forms.CharField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 2}),
        label="Hyperparameters",
        help_text="JSON or YAML, one level; each is passed as --name value.",
    )
    config = forms.CharField(required=False, widget=forms.Textarea(attrs={"rows": 3}), help_text="JSON or YAML; the job reads it from $E31_CONFIG.")
    inputs = forms.CharField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 2, "class": "mono"}),
        label="Named inputs to replace",
        help_text="name: dataset@N, one a line: that input reads this version instead (or is added). The others stay as they were.",
    )

    def __init__(self, *args, team, job=None, upload_errors=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.job, self.team = job, team
        self.upload_errors = upload_errors or {}
        self.fields["kept_data"].queryset = Upload.objects.filter(team=team, job__isnull=True, role=Upload.TRAIN)

    def work_changes(self):
        """The work as the retraining runs it: the job's arguments, hyperparameters and config,
        as changed on the form (a field not sent is the job's)."""
        cleaned, job = self.cleaned_data, self.job
        return {field: cleaned[field] if field in self.data else getattr(job, field) for field in ("args", "hyperparameters", "config")}

    def _clean_work(self, cleaned):
        """A changed config is checked as a submitted one is: a recipe's by the recipe; the
        arguments' variables must be the job's."""
        if any(version is None for version in (cleaned.get("inputs") or {}).values()):
            self.add_error("inputs", "A retraining reads datasets as its named inputs (name: dataset@N), not files.")
        if self.job is None or any(f in self.errors for f in ("args", "hyperparameters", "config")):
            return
        work = self.work_changes()
        if self.job.recipe and "config" in self.data:
            from e31.recipes import validate

            clean, errors = validate(self.job.recipe, {**work["config"], "mode": (self.job.config or {}).get("mode", "train")})
            for key, message in errors.items():
                self.add_error("config", f"{key}: {message}")
            cleaned["config"] = clean
        known = launch.known_variables(self.job.env or {}, work["hyperparameters"])
        try:
            spec.check_variables(work["args"], known)
        except spec.SpecError as error:
            self.add_error("args", str(error))
        if reason := next(
            (launch.refused_env_name(n, work["hyperparameters"]) for n in self.job.env or {} if launch.refused_env_name(n, work["hyperparameters"])), None
        ):
            self.add_error("hyperparameters", f"With these hyperparameters, the job's own environment clashes: {reason}.")

    @classmethod
    def initial_from(cls, job):
        mode = job.mode
        initial = {
            "gpus": job.gpus,
            "gpu_type": job.gpu_type,
            "mode": mode,
            "span_hours": plain(job.span_hours),
            "preemptible": job.preemptible,
            "name": f"{job.name} (retrained)",
            "args": shlex.join(str(a) for a in job.args or []),
            "hyperparameters": json.dumps(job.hyperparameters) if job.hyperparameters else "",
            "config": json.dumps({k: v for k, v in (job.config or {}).items() if not (job.recipe and k == "mode")}) if job.config else "",
        }
        if mode == "until_done":
            initial.update(
                ceiling_kind="money" if job.ceiling_amount is not None else "gpu_hours",
                ceiling=plain(job.ceiling_amount if job.ceiling_amount is not None else job.ceiling_gpu_hours),
            )
        return initial

    def clean(self):
        cleaned = super().clean()
        for field, errors in self.upload_errors.items():
            for error in errors:
                # Files this form does not take (a crafted post) are refused, not a 500.
                self.add_error(field if field in self.fields else None, error)
        if self._errors.pop("kept_data", None):
            self.add_error("data", "An earlier upload is no longer available: please upload it again.")
        names = [u.name for u in cleaned.get("kept_data") or []]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            self.add_error("data", f"Two new files are named {', '.join(dupes)}.")
        self._clean_work(cleaned)
        return cleaned

    def request_fields(self):
        cleaned, request = self.cleaned_data, self.meter_request()
        return {
            "gpus": cleaned["gpus"],
            "gpu_type": cleaned.get("gpu_type") or "",
            "span_hours": request.span_hours,
            "ceiling_amount": request.ceiling_amount,
            "ceiling_gpu_hours": request.ceiling_gpu_hours,
            "not_before": cleaned.get("not_before"),
            "deadline": cleaned.get("deadline"),
            "preemptible": bool(cleaned.get("preemptible")),
        }


@login_required
@require_http_methods(["GET", "POST"])
def job_retrain(request, job_id):
    job = get_job(request, job_id)
    team = require_team(request.user)
    problem = None
    try:
        lineage.weights_of(job)
    except lineage.LineageError as error:
        problem = str(error)
    if request.method == "POST" and problem is None:
        data, upload_errors, _ = keep_uploads(request.FILES, request.POST, team, request.user)
        form = RetrainForm(data, team=team, job=job, upload_errors=upload_errors)
        if form.is_valid():
            try:
                new = lineage.retrain(
                    job,
                    request.user,
                    new_data=form.cleaned_data.get("kept_data") or [],
                    name=form.cleaned_data.get("name") or "",
                    request=form.request_fields(),
                    work=form.work_changes(),
                    inputs=form.cleaned_data.get("inputs"),
                )
            except lineage.LineageError as error:
                form.add_error(None, str(error))
            else:
                audit.record(request, "job.retrain", job, label=f"{job.name} -> {new.name} ({new.pk})")
                messages.success(request, f"Retraining submitted as {new.name}: it starts from the weights of {job.short_id}.")
                return redirect("jobs:detail", job_id=new.pk)
    else:
        form = RetrainForm(initial=RetrainForm.initial_from(job), team=team, job=job)
    kept = form.fields["kept_data"].queryset.filter(pk__in=form.data.getlist("kept_data")) if form.is_bound else []
    old_files = job.train_version.files.all() if job.train_version else job.uploads.filter(role=Upload.TRAIN)
    return render(
        request,
        "jobs/retrain.html",
        {"job": job, "form": form, "problem": problem, "kept_data": kept, "old_files": old_files},
        status=400 if request.method == "POST" else 200,
    )


@login_required
@require_POST
def job_compare(request, job_id):
    job = get_job(request, job_id)
    try:
        new = lineage.compare(job, request.user)
    except lineage.LineageError as error:
        messages.error(request, str(error))
        return redirect("jobs:detail", job_id=job.pk)
    audit.record(request, "job.compare", job, label=f"{job.name} -> {new.name} ({new.pk})")
    messages.success(request, f"Comparison submitted: {new.name}.")
    return redirect("jobs:detail", job_id=new.pk)


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


@login_required
@require_GET
def job_comparison_json(request, job_id):
    job = get_job(request, job_id)
    found = comparison(job)
    if found is None:
        raise Http404("This job has no evaluation.")
    response = JsonResponse(comparison_json(job, found), json_dumps_params={"indent": 2})
    response["Content-Disposition"] = f'attachment; filename="comparison-{job.short_id}.json"'
    return response
