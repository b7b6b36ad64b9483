"""The form that starts a sweep from one of the team's jobs: what POST /api/sweeps/ takes, with the
space written as YAML or JSON, checked as the API checks it (sweeps.services.create)."""

import yaml
from django import forms

from jobs.models import Job
from sweeps import search

EXAMPLE_SPACE = """lr: {type: float, low: 0.0001, high: 0.1, log: true}
hidden: {type: choice, choices: [64, 128, 256]}"""


class SweepForm(forms.Form):
    name = forms.CharField(max_length=200)
    template = forms.ModelChoiceField(queryset=Job.objects.none(), help_text="Each trial is a copy of this job with the trial's parameters.")
    space = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 5, "class": "mono", "placeholder": EXAMPLE_SPACE}),
        help_text="YAML or JSON: each parameter a float or int (low, high, log) or a choice (choices); target: config or hyperparameters.",
    )
    method = forms.ChoiceField(
        choices=[(search.GRID, "grid: every combination, once"), (search.RANDOM, "random"), (search.TPE, "model-based (TPE)")], initial=search.TPE
    )
    objective = forms.CharField(max_length=100, help_text="A metric the trials log (e31.log_metric); a trial's value is its last one.")
    direction = forms.ChoiceField(choices=[("min", "lower is better"), ("max", "higher is better")])
    max_trials = forms.IntegerField(min_value=1, max_value=1000, initial=16)
    parallel = forms.IntegerField(min_value=1, max_value=64, initial=2, help_text="Trials queued or running at once, at most.")
    ceiling = forms.DecimalField(max_digits=14, decimal_places=2, min_value=0.01, help_text="The most the whole sweep may cost.")
    prune = forms.BooleanField(required=False, initial=True, help_text="Stop trials that fall behind (asynchronous successive halving).")

    def __init__(self, team, *args, **kwargs):
        super().__init__(*args, **kwargs)
        field = self.fields["template"]
        field.queryset = Job.objects.filter(team=team).order_by("-created_at")
        field.label_from_instance = lambda job: f"{job.name} ({str(job.pk)[:8]}, {job.state})"

    def clean_space(self):
        try:
            space = yaml.safe_load(self.cleaned_data["space"])
        except yaml.YAMLError as error:
            raise forms.ValidationError(f"This is not YAML or JSON: {error}") from None
        if not isinstance(space, dict) or not space:
            raise forms.ValidationError("Give at least one parameter, as name: {type: ..., ...}.")
        return space

    def clean(self):
        data = super().clean()
        if "space" in data and "method" in data:
            try:
                search.check(data["space"], data["method"])
            except search.SpaceError as error:
                self.add_error("space", str(error))
        return data
