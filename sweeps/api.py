"""Sweeps under /api/sweeps/: start one from a job of the team's (the template), list them, and
follow one: its trials (parameters, state, objective, held time, cost), the best so far, and
its spend against its ceiling. The shapes are the serializers below, for the JSON and the
schema alike."""

from decimal import Decimal

from django.conf import settings
from django.urls import reverse
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers as s
from rest_framework import status
from rest_framework.decorators import api_view
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response

from accounts.access import get_for_team, require_team
from core.api import fields, page_of, sentence
from jobs.models import Job
from sweeps import search
from sweeps import services as sweeps
from sweeps.models import Sweep


class TrialSerializer(s.Serializer):
    number = s.IntegerField()
    params = s.JSONField(help_text="The parameters the sampler chose.")
    state = s.CharField(help_text="running (queued or running), complete (with its objective), pruned (stopped early: it fell behind) or failed.")
    value = s.FloatField(allow_null=True, help_text="The objective: the last value of the sweep's metric the trial logged.")
    job = s.UUIDField(source="job_id")
    job_state = s.CharField(source="job.state")
    held_seconds = s.IntegerField()
    cost = s.CharField(help_text="Billed so far, a decimal string (live while it holds compute).")


class SweepSerializer(s.Serializer):
    id = s.UUIDField()
    name = s.CharField()
    template = s.UUIDField(source="template_id", help_text="The job each trial copies.")
    space = s.JSONField(help_text="{parameter: spec}: float, int (low, high, log) or choice (choices), and target (config or hyperparameters).")
    method = s.CharField()
    objective = s.CharField()
    direction = s.CharField()
    max_trials = s.IntegerField()
    parallel = s.IntegerField()
    prune = s.BooleanField(help_text="Whether trials that fall behind are stopped early.")
    ceiling = s.CharField(source="ceiling_amount", help_text="The most the whole sweep may cost, a decimal string.")
    currency = s.CharField()
    state = s.CharField(help_text="running, done or ceiling reached.")
    reason = s.CharField(allow_blank=True)
    created_at = s.DateTimeField()
    finished_at = s.DateTimeField(allow_null=True)
    spent = s.CharField(help_text="What its trials have been billed so far.")
    committed = s.CharField(help_text="Spent, plus what its running trials may still spend: never above the ceiling.")
    best = TrialSerializer(allow_null=True)
    trials = TrialSerializer(many=True, required=False)


class SweepRequest(s.Serializer):
    name = s.CharField(max_length=200)
    template = s.UUIDField(help_text="One of the team's jobs: each trial is a copy of it with the trial's parameters.")
    space = s.DictField(help_text="{parameter: spec}, see docs/user-guide.md.")
    method = s.ChoiceField(choices=search.METHODS)
    objective = s.CharField(max_length=100)
    direction = s.ChoiceField(choices=["min", "max"], default="min")
    max_trials = s.IntegerField(min_value=1, max_value=1000)
    parallel = s.IntegerField(min_value=1, max_value=64, default=2)
    ceiling = s.DecimalField(max_digits=14, decimal_places=2, min_value=Decimal("0.01"))
    seed = s.IntegerField(min_value=0, max_value=2**31 - 1, default=0)
    prune = s.BooleanField(default=True, help_text="Stop trials that fall behind (asynchronous successive halving on the objective).")


def sweep_json(sweep, request, with_trials):
    seen = sweeps.summary(sweep)

    def row(r):
        fields = {f: getattr(r.trial, f) for f in ("number", "params", "state", "value", "job_id")}
        return {**fields, "job": r.trial.job, "held_seconds": r.held_seconds, "cost": f"{r.cost:f}"}

    data = {
        **{
            f: getattr(sweep, f)
            for f in (
                "id",
                "name",
                "template_id",
                "space",
                "method",
                "objective",
                "direction",
                "max_trials",
                "parallel",
                "prune",
                "state",
                "reason",
                "created_at",
                "finished_at",
            )
        },
        "ceiling_amount": f"{sweep.ceiling_amount:f}",
        "currency": settings.E31_CURRENCY,
        "spent": f"{seen.spent:f}",
        "committed": f"{seen.committed:f}",
        "best": row(seen.best) if seen.best else None,
    }
    if with_trials:
        data["trials"] = [row(r) for r in seen.rows]
    return SweepSerializer(data).data


@extend_schema(
    methods=["GET"],
    operation_id="sweeps_list",
    responses=inline_serializer(
        "SweepPage",
        {"count": s.IntegerField(), "next": s.URLField(allow_null=True), "previous": s.URLField(allow_null=True), "results": SweepSerializer(many=True)},
    ),
    description="The team's sweeps, newest first, paged (without their trials).",
)
@extend_schema(
    methods=["POST"],
    request=SweepRequest,
    responses={201: SweepSerializer},
    description="Start a sweep: its first trials are queued at the scheduler's next turn.",
)
@api_view(["GET", "POST"])
def sweep_list(request):
    team = require_team(request.user)
    if request.method == "GET":
        return Response(page_of(request, sweeps.with_trials(Sweep.objects.filter(team=team)), lambda sweep: sweep_json(sweep, request, False)))
    body = SweepRequest(data=fields(request))
    body.is_valid(raise_exception=True)
    data = body.validated_data
    template = Job.objects.filter(team=team, pk=data["template"]).first()
    if template is None:
        raise ValidationError({"template": ["No job of your team has that id."]})
    try:
        sweep = sweeps.create(
            team,
            request.user,
            name=data["name"],
            template=template,
            space=data["space"],
            method=data["method"],
            objective=data["objective"],
            direction=data["direction"],
            max_trials=data["max_trials"],
            parallel=data["parallel"],
            ceiling_amount=data["ceiling"],
            seed=data["seed"],
            prune=data["prune"],
        )
    except sweeps.SweepError as error:
        raise ValidationError({"non_field_errors": [str(error)]}) from None
    return Response(sweep_json(sweep, request, True), status=status.HTTP_201_CREATED)


@extend_schema(
    operation_id="sweeps_retrieve", responses=SweepSerializer, description="A sweep with its trials, the best so far, and its spend against its ceiling."
)
@api_view(["GET"])
def sweep_detail(request, sweep_id):
    sweep = get_for_team(sweeps.with_trials(Sweep.objects.all()), request.user, pk=sweep_id)
    return Response(sweep_json(sweep, request, True))


class RerunRequest(s.Serializer):
    name = s.CharField(max_length=200, required=False, allow_blank=True)
    config = s.DictField(required=False, help_text="Config keys to change (say, more epochs), over the best trial's.")
    hyperparameters = s.DictField(required=False, help_text="Hyperparameters to change, over the best trial's.")


@extend_schema(
    operation_id="sweeps_rerun",
    request=RerunRequest,
    responses={201: inline_serializer("SweepRerun", {"job": s.UUIDField(), "url": s.URLField()})},
    description="Run the best trial's configuration again as a job of its own, with these changes; 409 while no trial has completed.",
)
@api_view(["POST"])
def sweep_rerun(request, sweep_id):
    sweep = get_for_team(Sweep.objects.select_related("template"), request.user, pk=sweep_id)
    body = RerunRequest(data=fields(request))
    body.is_valid(raise_exception=True)
    data = body.validated_data
    try:
        job = sweeps.run_best_again(sweep, request.user, name=data.get("name", ""), config=data.get("config"), hyperparameters=data.get("hyperparameters"))
    except sweeps.SweepError as error:
        return Response({"detail": sentence(f"Nothing to run again: {error}")}, status=status.HTTP_409_CONFLICT)
    return Response({"job": job.pk, "url": request.build_absolute_uri(reverse("api:job", args=[job.pk]))}, status=status.HTTP_201_CREATED)
