"""The retraining of a finished job, as a form: its work and request prefilled from the job, its
weights as the starting model, new training files added (the retrain page and the API's)."""

import json
import shlex

from django import forms

from e31.recipes import validate
from jobs import launch, spec_text
from jobs.forms import MultipleFileInput, RequestForm, WorkTextFields, experiment_field, one_line
from jobs.models import Upload


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
    experiment = experiment_field("Blank: the job's experiment. Runs of one experiment are compared side by side on the experiment page.")
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

    def clean_experiment(self):
        return one_line(self.cleaned_data["experiment"], "The experiment")

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
            clean, errors = validate(self.job.recipe, {**work["config"], "mode": (self.job.config or {}).get("mode", "train")})
            for key, message in errors.items():
                self.add_error("config", f"{key}: {message}")
            cleaned["config"] = clean
        known = launch.known_variables(self.job.env or {}, work["hyperparameters"])
        try:
            spec_text.check_variables(work["args"], known)
        except spec_text.SpecError as error:
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
            "experiment": job.experiment,
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
