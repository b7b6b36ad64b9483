"""A sweep's search space and search method, with Optuna's samplers (ask-and-tell).

The sweep's state lives in our database (sweeps.models.Trial: each trial's parameters, Optuna's
own attributes for it, its state and objective), never in Optuna's storage: each time a trial is
asked for, an in-memory study is rebuilt from those rows, so a scheduler that restarts goes on
with the same trials and never asks twice for one it already made.

A space is {name: spec}, each spec one of:
    {"type": "float", "low": 1e-4, "high": 1e-1, "log": true}
    {"type": "int", "low": 16, "high": 256, "log": false}
    {"type": "choice", "choices": [32, 64, 128]}
and, in any of them, "target": "config" or "hyperparameters" (where the trial's value goes; by
default a recipe's config, a script's hyperparameters).
"""

import math
from dataclasses import dataclass

import optuna
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

optuna.logging.set_verbosity(optuna.logging.WARNING)

GRID, RANDOM, TPE = "grid", "random", "tpe"
METHODS = (GRID, RANDOM, TPE)
TARGETS = ("config", "hyperparameters")
NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


class SpaceError(ValueError):
    pass


def _number(spec, key, name, kind):
    value = spec.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or (kind is int and not float(value).is_integer()):
        raise SpaceError(f"{name}: {key} must be {'an integer' if kind is int else 'a number'}")
    if not math.isfinite(value):
        raise SpaceError(f"{name}: {key} must be finite")
    return kind(value)


def distribution(name, spec):
    """The Optuna distribution of one parameter; SpaceError with the reason otherwise."""
    if not name or not set(name) <= NAME_CHARS:
        raise SpaceError(f"{name!r}: a parameter's name is letters, digits, '_', '-' and '.'")
    if not isinstance(spec, dict):
        raise SpaceError(f"{name}: expected a mapping with a type")
    kind = spec.get("type")
    if spec.get("target", "config") not in TARGETS:
        raise SpaceError(f"{name}: target must be config or hyperparameters")
    if kind == "choice":
        choices = spec.get("choices")
        if not isinstance(choices, list) or not choices or len(choices) > 1000:
            raise SpaceError(f"{name}: choices must be a list of 1 to 1000 values")
        if not all(c is None or isinstance(c, bool | int | float | str) for c in choices):
            raise SpaceError(f"{name}: each choice must be a number, a string, true, false or null")
        if len(set(map(repr, choices))) != len(choices):
            raise SpaceError(f"{name}: a choice is repeated")
        return CategoricalDistribution(choices)
    if kind in ("float", "int"):
        number = float if kind == "float" else int
        low, high, log = _number(spec, "low", name, number), _number(spec, "high", name, number), spec.get("log", False)
        if not isinstance(log, bool):
            raise SpaceError(f"{name}: log must be true or false")
        if low >= high:
            raise SpaceError(f"{name}: low must be below high")
        if log and low <= 0:
            raise SpaceError(f"{name}: a log scale needs low above 0")
        return FloatDistribution(low, high, log=log) if kind == "float" else IntDistribution(low, high, log=log)
    raise SpaceError(f"{name}: type must be float, int or choice")


def distributions(space):
    if not isinstance(space, dict) or not space:
        raise SpaceError("the space must name at least one parameter")
    if len(space) > 50:
        raise SpaceError("the space may name at most 50 parameters")
    return {name: distribution(name, spec) for name, spec in space.items()}


def grid_of(space):
    """{name: values} of a grid search: every parameter must be a choice."""
    grid = {}
    for name, spec in space.items():
        if spec.get("type") != "choice":
            raise SpaceError(f"{name}: a grid search takes choices only (list the values to try)")
        grid[name] = list(spec["choices"])
    return grid


def grid_size(space):
    return math.prod(len(values) for values in grid_of(space).values())


def check(space, method):
    """SpaceError unless the space and method make a search."""
    if method not in METHODS:
        raise SpaceError(f"the method must be one of {', '.join(METHODS)}")
    distributions(space)
    if method == GRID:
        grid_of(space)


def sampler(method, space, seed):
    if method == GRID:
        return optuna.samplers.GridSampler(grid_of(space), seed=seed)
    if method == RANDOM:
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=4, constant_liar=True)


@dataclass(frozen=True)
class Past:
    """A trial as the database holds it."""

    params: dict
    system_attrs: dict
    state: str  # "running", "complete", "failed", "pruned"
    value: float | None = None
    intermediate: dict | None = None  # {step: value} of its objective so far


STATES = {"running": TrialState.RUNNING, "complete": TrialState.COMPLETE, "failed": TrialState.FAIL, "pruned": TrialState.PRUNED}


def _study(space, method, direction, seed, past):
    dists = distributions(space)
    study = optuna.create_study(direction="minimize" if direction == "min" else "maximize", sampler=sampler(method, space, seed))
    for trial in past:
        state = STATES[trial.state]
        value = trial.value if state == TrialState.COMPLETE else None
        if state == TrialState.COMPLETE and value is None:
            state = TrialState.FAIL  # finished without reporting its objective
        study.add_trial(
            optuna.trial.create_trial(
                params=trial.params,
                distributions=dists,
                state=state,
                value=value,
                intermediate_values={int(k): v for k, v in (trial.intermediate or {}).items()},
                system_attrs=trial.system_attrs,
            )
        )
    return study, dists


def pruner():
    """Asynchronous successive halving: at each rung (steps 1, 3, 9, ...) a trial goes on only
    if its objective there is in the best third of the trials that reached that rung."""
    return optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=3)


def should_prune(space, method, direction, seed, past, index):
    """(whether past[index], a running trial, should stop now, its Optuna attributes after the
    pruner looked: the rungs it passed, kept so that the next look, on a rebuilt study, knows them)."""
    study, _ = _study(space, method, direction, seed, past)
    frozen = study.trials[index]
    prune = pruner().prune(study, frozen)
    return prune, dict(study._storage.get_trial_system_attrs(frozen._trial_id))


def ask(space, method, direction, seed, past):
    """(params, Optuna's attributes for the trial) of the next trial, given every trial so far.
    A random or model-based sampler's seed moves with the trial's number, so a rebuilt study
    never repeats a draw; a grid's stays, since it orders the cells its trials are numbered by."""
    study, dists = _study(space, method, direction, seed if method == GRID else seed + len(past), past)
    asked = study.ask(fixed_distributions=dists)
    attrs = study._storage.get_trial_system_attrs(asked._trial_id)  # the grid's cell, for the next rebuild
    return asked.params, {k: v for k, v in attrs.items() if k in ("grid_id", "search_space")}


def split(space, params, recipe):
    """(config changes, hyperparameter changes) of a trial's parameters."""
    config, hyperparameters = {}, {}
    for name, value in params.items():
        target = space[name].get("target") or ("config" if recipe else "hyperparameters")
        (config if target == "config" else hyperparameters)[name] = value
    return config, hyperparameters
