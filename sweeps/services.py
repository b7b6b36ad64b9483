"""A sweep's steps over the database, once per scheduler cycle (advance_all): settle the trials
that ended (their objective from their metrics), then start new trials while they fit under
the sweep's money ceiling (sweeps.ceiling) and its trial counts, and end the sweep when nothing
is left to run. The parameters come from Optuna (sweeps.search); the trials are jobs, copies of
the template (jobs.lineage), queued, held, run and billed like any other."""

import logging
import math
from dataclasses import dataclass
from decimal import Decimal

from django.db import IntegrityError, transaction
from django.db.models import Prefetch
from django.utils import timezone

from billing import budgets, meter
from billing.budget_service import Rates
from jobs import lineage, states
from jobs.metrics import series_from_events
from jobs.models import Job, Upload
from sweeps import ceiling, search
from sweeps.models import Sweep, Trial

log = logging.getLogger(__name__)


class SweepError(ValueError):
    pass


def trial_worst_case(template, now=None):
    """The most one trial may cost: the template's own money ceiling, else what its span or GPU
    hours buy at the rate in force. A template that nothing bounds cannot be swept under a
    ceiling (SweepError)."""
    if template.ceiling_amount is not None:
        return Decimal(template.ceiling_amount)
    rate = Rates(now or timezone.now()).for_job(template)
    if rate is None:
        raise SweepError("no rate is in force for the template's devices")
    limit, cap = meter.remaining_allowance(template.meter_request(), rate)
    worst = budgets.worst_case(template.gpus, rate, limit, cap)
    if worst is None:
        raise SweepError("the template's cost is unbounded: give it a span or a ceiling")
    return meter.round_money(worst)


def objective_points(job, name):
    """[(step, value)] of the job's objective metric, finite values only, in step order."""
    events = job.events.filter(kind="metric").order_by("seq").values("data", "at", "seq")
    return _finite(series_from_events(events, names=[name]).get(name) or [])


def _finite(points):
    return [(int(x), float(v)) for x, v, *_ in points if isinstance(v, int | float) and math.isfinite(v)]


def objective_of(job, name):
    """The last value of the job's objective metric, or None (not logged, or not finite)."""
    points = objective_points(job, name)
    return points[-1][1] if points else None


def catch_up(trial, name):
    """Carry trial.intermediate on with the objective points its job logged since the last look,
    reading only the metric events after the last one read: a look costs what the trial logged
    since, not all it ever logged, and gives the series a whole read gives (a resumed run's
    repeated steps rewind it; a non-finite point is kept as None, a gap). Returns whether there
    were any new events; the caller saves CAUGHT_UP."""
    events = list(trial.job.events.filter(kind="metric", seq__gt=trial.seen_seq).order_by("seq").values("data", "at", "seq"))
    if not events:
        return False
    prior = [[x, v, None] for x, v in sorted((int(k), v) for k, v in trial.intermediate.items())]
    series = series_from_events(events, names=[name], offset=trial.seen_points, into={name: prior})[name]
    trial.intermediate = {str(x): (float(v) if isinstance(v, int | float) and math.isfinite(v) else None) for x, v, *_ in series}
    trial.seen_seq, trial.seen_points = events[-1]["seq"], trial.seen_points + len(events)
    return True


def finite(intermediate):
    """{step: value} of a trial's finite objective points (what the pruner compares)."""
    return {int(k): v for k, v in intermediate.items() if v is not None}


CAUGHT_UP = ["intermediate", "seen_seq", "seen_points"]


def settle(trial):
    """A trial whose job ended: complete with its objective, or failed (a pruned one keeps its
    state, and the last objective its job logged)."""
    job = trial.job
    if trial.state not in (Trial.RUNNING, Trial.PRUNED) or job.state not in states.TERMINAL or trial.value is not None:
        return
    catch_up(trial, trial.sweep.objective)  # its last points, which the pruner compares against
    value = objective_of(job, trial.sweep.objective) if job.state in (states.SUCCEEDED, states.STOPPED) else None
    if trial.state == Trial.PRUNED:
        trial.value = value
    else:
        trial.value, trial.state = value, Trial.COMPLETE if value is not None else Trial.FAILED
    trial.save(update_fields=["value", "state", *CAUGHT_UP])


def holding(trial):
    """Queued or running: it may still spend (a pruned trial too, until its job has stopped)."""
    return trial.job.state not in states.TERMINAL


def costs(trials, now):
    return [ceiling.TrialCost(spent=t.job.held(now)[1], worst=Decimal(t.job.ceiling_amount or 0), running=holding(t)) for t in trials]


def past_of(trials):
    return [search.Past(t.params, t.system_attrs, t.state, t.value, finite(t.intermediate)) for t in trials]


def prune(sweep, trials, now):
    """Stop the running trials that fall behind (search.should_prune): their jobs are stopped as
    early stopping stops a job (SIGTERM, the grace period, weights kept), billed only for the
    seconds held. A trial is looked at when it has logged since the last look (each turn of the
    scheduler: a pruned trial stops within a turn of the point that condemned it). Returns the
    trials pruned."""
    pruned = []
    for trial in trials:
        if trial.state != Trial.RUNNING or trial.job.state != states.RUNNING or not catch_up(trial, sweep.objective):
            continue
        fields = list(CAUGHT_UP)
        if points := finite(trial.intermediate):
            stop, attrs = search.should_prune(sweep.space, sweep.method, sweep.direction, sweep.seed, past_of(trials), trials.index(trial))
            trial.system_attrs = attrs  # the rungs it passed: the next look is on a rebuilt study
            fields.append("system_attrs")
            if stop:
                step, value = max(points.items())
                reason = f"pruned by its sweep: {sweep.objective} {value:g} at step {step} is behind the other trials there"
                Job.objects.filter(pk=trial.job_id, stop_requested_at__isnull=True).update(stop_requested_at=now, stop_reason=reason)
                trial.job.record("notice", data={"text": reason})
                trial.state = Trial.PRUNED
                fields.append("state")
                pruned.append(trial)
        trial.save(update_fields=fields)
    return pruned


def copy_of(source, template, user, *, name, experiment, config, hyperparameters, ceiling_amount, ceiling_gpu_hours):
    """A queued job doing the template's work with these config and hyperparameters (a trial, or
    the best trial run again): its code, data and starting weights shared, not copied."""
    job = lineage.copy_job(
        source,
        user,
        name=name,
        experiment=experiment,
        config=config,
        hyperparameters=hyperparameters,
        ceiling_amount=ceiling_amount,
        ceiling_gpu_hours=ceiling_gpu_hours,
    )
    lineage.share_uploads(template, job, [Upload.CODE, Upload.TRAIN, Upload.HELDOUT, Upload.INPUT])
    for model in template.models.all():
        lineage.pin_model(job, model.label, model.files, source_job=model.source_job, description=model.description)
    return job


def run_best_again(sweep, user, *, name="", config=None, hyperparameters=None):
    """The best trial's configuration as a job of its own (say, on all the data, or longer):
    the template's work and compute request and its own ceiling, the best trial's parameters,
    then these changes. SweepError when no trial has completed yet."""
    best_trial = best(sweep)
    if best_trial is None:
        raise SweepError("no trial has completed with its objective yet")
    template = sweep.template
    job = copy_of(
        best_trial.job,
        template,
        user,
        name=name or f"{sweep.name} best (trial {best_trial.number})",
        experiment=sweep.name,
        config={**(best_trial.job.config or {}), **(config or {})},
        hyperparameters={**(best_trial.job.hyperparameters or {}), **(hyperparameters or {})},
        ceiling_amount=template.ceiling_amount,
        ceiling_gpu_hours=template.ceiling_gpu_hours,
    )
    job.record(
        "state", at=job.created_at, data={"state": job.state, "from": None, "reason": f"the best trial ({best_trial.number}) of sweep {sweep.name}, run again"}
    )
    return job


def start_trial(sweep, number, past, worst):
    """Ask the sampler for the next parameters and queue the trial's job (a copy of the
    template, under its own money ceiling: its worst case)."""
    template = sweep.template
    params, attrs = search.ask(sweep.space, sweep.method, sweep.direction, sweep.seed, past)
    config, hyperparameters = search.split(sweep.space, params, bool(template.recipe))
    job = copy_of(
        template,
        template,
        sweep.created_by or template.created_by,
        name=f"{sweep.name} #{number}",
        experiment=sweep.name,
        config={**(template.config or {}), **config},
        hyperparameters={**(template.hyperparameters or {}), **hyperparameters},
        ceiling_amount=worst,
        ceiling_gpu_hours=None,
    )
    job.record("state", at=job.created_at, data={"state": job.state, "from": None, "reason": f"trial {number} of sweep {sweep.name}"})
    return Trial.objects.create(sweep=sweep, number=number, params=params, system_attrs=attrs, job=job)


def advance(sweep, now=None):
    """One step of a running sweep; returns the trials started."""
    now = now or timezone.now()
    with transaction.atomic():
        sweep = Sweep.objects.select_for_update().get(pk=sweep.pk)  # one scheduler at a time
        if sweep.state != Sweep.RUNNING:
            return []
        trials = list(sweep.trials.select_related("job"))
        for trial in trials:
            settle(trial)
        if sweep.prune:
            prune(sweep, trials, now)
        try:
            worst = trial_worst_case(sweep.template, now)
        except SweepError as error:
            return _finish(sweep, Sweep.DONE, f"stopped: {error}", now, trials)
        limit = sweep.max_trials
        if sweep.method == search.GRID:
            limit = min(limit, search.grid_size(sweep.space))
        started = []
        while len(trials) < limit and sum(holding(t) for t in trials) < sweep.parallel:
            if not ceiling.may_start(costs(trials, now), worst, Decimal(sweep.ceiling_amount)):
                break
            try:
                trial = start_trial(sweep, len(trials) + 1, past_of(trials), worst)
            except IntegrityError:  # another scheduler made this number first
                return started
            trials.append(trial)
            started.append(trial)
        if not any(holding(t) for t in trials):
            if len(trials) >= limit:
                _finish(sweep, Sweep.DONE, f"{len(trials)} trial{'s' if len(trials) != 1 else ''} run", now, trials)
            else:
                spent = ceiling.spent(costs(trials, now))
                _finish(sweep, Sweep.CEILING, f"another trial (up to {worst}) would pass the ceiling; {spent} spent of {sweep.ceiling_amount}", now, trials)
        return started


def _finish(sweep, state, reason, now, trials):
    sweep.state, sweep.reason, sweep.finished_at = state, reason, now
    sweep.save(update_fields=["state", "reason", "finished_at"])
    log.info("sweep %s ended (%s): %s", sweep.pk, state, reason)
    return []


def advance_all(now=None):
    """Every running sweep one step (the scheduler's cycle)."""
    started = []
    for sweep in Sweep.objects.filter(state=Sweep.RUNNING):
        try:
            started += advance(sweep, now)
        except Exception:  # noqa: BLE001 - one sweep's trouble never stops the others or the scheduler
            log.exception("sweep %s could not advance", sweep.pk)
    return started


def with_trials(sweeps):
    """The sweeps with their trials, the trials' jobs and the jobs' allocations, in a number of
    queries that does not grow with the sweeps or their trials (summary() reads all of them)."""
    trials = Trial.objects.select_related("job").prefetch_related("job__allocations")
    return sweeps.prefetch_related(Prefetch("trials", queryset=trials))


@dataclass(frozen=True)
class Row:
    """A trial as the pages and the API show it: held seconds and cost so far."""

    trial: Trial
    held_seconds: int
    cost: Decimal


@dataclass(frozen=True)
class Summary:
    """A sweep's trials, what they spent and may still spend, and the best complete one."""

    rows: list
    spent: Decimal
    committed: Decimal
    best: Row | None


def summary(sweep, now=None):
    """What the sweep's page and the API show of it (load it through with_trials)."""
    now = now or timezone.now()
    trials = list(sweep.trials.all())
    trial_costs = costs(trials, now)
    rows = [Row(t, t.job.held(now)[0], c.spent) for t, c in zip(trials, trial_costs, strict=True)]
    done = [r for r in rows if r.trial.state == Trial.COMPLETE and r.trial.value is not None]  # a pruned trial never ran its course
    top = (min if sweep.direction == "min" else max)(done, key=lambda r: r.trial.value) if done else None
    return Summary(rows, ceiling.spent(trial_costs), ceiling.committed(trial_costs), top)


def best(sweep):
    """The best complete trial (its objective in the sweep's direction), or None."""
    done = [t for t in sweep.trials.all() if t.state == Trial.COMPLETE and t.value is not None]  # a pruned trial never ran its course
    if not done:
        return None
    return (min if sweep.direction == "min" else max)(done, key=lambda t: t.value)


def create(team, user, *, name, template, space, method, objective, direction, max_trials, parallel, ceiling_amount, seed=0, prune=True):
    """A new sweep, checked (SweepError with the reason)."""
    if template.team_id != team.pk:
        raise SweepError("the template must be one of the team's jobs")
    try:
        search.check(space, method)
    except search.SpaceError as error:
        raise SweepError(str(error)) from None
    if direction not in ("min", "max"):
        raise SweepError("the direction must be min or max")
    if not objective:
        raise SweepError("name the objective: a metric the trials log")
    if max_trials < 1 or parallel < 1:
        raise SweepError("max_trials and parallel must be at least 1")
    ceiling_amount = Decimal(ceiling_amount)
    if ceiling_amount <= 0:
        raise SweepError("the ceiling must be above 0")
    worst = trial_worst_case(template)
    if worst > ceiling_amount:
        raise SweepError(f"one trial may cost up to {worst}, more than the sweep's ceiling of {ceiling_amount}")
    return Sweep.objects.create(
        team=team,
        created_by=user,
        name=name,
        template=template,
        space=space,
        method=method,
        objective=objective,
        direction=direction,
        max_trials=max_trials,
        parallel=parallel,
        ceiling_amount=ceiling_amount,
        seed=seed,
        prune=prune,
    )
