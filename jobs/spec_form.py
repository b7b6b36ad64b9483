"""A job spec's flat fields (jobs.specfile.SPEC_FIELDS) as the job form's data: what the API
submits and estimates, and what the new-job page fills in from a spec file. A malformed spec is a
ValidationError naming the field (and, for a spec file, its line)."""

import json
import shlex

from rest_framework.exceptions import ValidationError

from catalog import datasets
from e31.recipes import RECIPES
from jobs import specfile, states
from jobs.forms import form_params, is_uuid, recipe_field_name
from jobs.models import Job
from jobs.spec_text import format_env
from jobs.specfile import SPEC_FIELDS

BOOLEAN_FIELDS = {"preemptible", "stop_on_nan", "smoke_first", "network", "stop_if_idle"}


def spec_to_form_data(spec, team):
    """The API's JSON spec as the job form's fields; raises ValidationError on a malformed spec."""
    if not isinstance(spec, dict):
        raise ValidationError({"spec": ["The spec must be a JSON object."]})
    unknown = sorted(set(spec) - SPEC_FIELDS)
    if unknown:
        raise ValidationError({"spec": [f"Unknown field(s): {', '.join(unknown)}. Known: {', '.join(sorted(SPEC_FIELDS))}."]})
    structured = {
        "args": (list, str),
        "config": (dict, str),
        "hyperparameters": (dict, str),
        "inputs": (dict, str),
        "env": (dict, str),
        "packages": (list, str),
        "evaluate_jobs": (list,),
    }
    for field, value in spec.items():
        if field in BOOLEAN_FIELDS:
            if value is not None and not isinstance(value, bool):
                raise ValidationError({field: [f"{field} must be true or false, not {type(value).__name__}."]})
            continue
        allowed = structured.get(field, (str, int, float))
        if value is not None and (not isinstance(value, allowed) or isinstance(value, bool)):
            raise ValidationError({field: [f"{field} must be {_kinds(allowed)}, not {type(value).__name__}."]})
    data = dict(spec)
    # Booleans as a form sends them: absent is off, except the NaN stop, which is on by default.
    data["stop_on_nan"] = spec.get("stop_on_nan") is not False
    for field in BOOLEAN_FIELDS:
        data[field] = "on" if data.get(field) else ""
    if isinstance(data.get("args"), list):
        data["args"] = shlex.join(str(a) for a in data["args"])
    for field in ("config", "hyperparameters", "inputs"):
        if isinstance(data.get(field), dict):
            data[field] = json.dumps(data[field])
    if isinstance(data.get("env"), dict):
        data["env"] = format_env(data["env"])
    if isinstance(data.get("packages"), list):
        data["packages"] = packages_text(data["packages"])
    if "mode" not in data:
        data["mode"] = "until_done" if data.get("ceiling") is not None and data.get("span_hours") is None else "span"
    return data


def packages_text(items):
    """A list of requirements as the form's text, one a line; an item that is not one line of
    text would become another requirement, or none."""
    if not all(isinstance(item, str) and "\n" not in item and "\r" not in item for item in items):
        raise ValidationError({"packages": ["packages must be a list of requirements, each a string of one line (numpy>=1.26)."]})
    return "\n".join(items)


def _kinds(types):
    names = {str: "a string", int: "a number", float: "a number", list: "a list", dict: "an object"}
    return " or ".join(dict.fromkeys(names[t] for t in types))


def pin_datasets(data, team, resolved=None):
    """Datasets named by name or id, with an optional @version ("digits@2"), as the form's
    dataset and version fields; the versions found are added to `resolved` where given."""
    for field, version_field in (("train_dataset", "train_version"), ("heldout_dataset", "heldout_version")):
        if data.get(field):
            try:
                version = datasets.resolve(team, data[field])
            except datasets.DatasetError as error:
                raise ValidationError({field: [f"{str(error)[0].upper()}{str(error)[1:]}."]}) from None
            data[field] = str(version.dataset_id)
            data[version_field] = str(version.pk)
            if resolved is not None:
                resolved.append(version)
    return data


def resolve_jobs(data, team):
    """Jobs named by id, or by name (the team's latest succeeded job of that name), as the
    form's start_job and evaluate_jobs."""

    def resolve(field, value):
        if not isinstance(value, str) or is_uuid(value):
            return value
        found = Job.objects.filter(team=team, name=value, state=states.SUCCEEDED).order_by("-finished_at", "-created_at").first()
        if found is None:
            raise ValidationError({field: [f"No succeeded job named {value!r} in your team (give a job's id or name)."]})
        return str(found.pk)

    if data.get("start_job"):
        data["start_job"] = resolve("start_job", data["start_job"])
    if isinstance(data.get("evaluate_jobs"), list):
        data["evaluate_jobs"] = [resolve("evaluate_jobs", value) for value in data["evaluate_jobs"]]
    return data


def spec_form_data(spec, team, pin=False, resolved=None):
    """A read spec's fields as the form's data; type errors name the spec's line. resolved:
    pin_datasets'."""
    try:
        data = spec_to_form_data(spec.fields, team)
        return resolve_jobs(pin_datasets(data, team, resolved), team) if pin else data
    except ValidationError as error:
        raise ValidationError(
            {field: [specfile.where(spec.name, spec.line_of(field)) + str(m) for m in messages] for field, messages in error.detail.items()}
        ) from None


def form_initial(spec, team):
    """A read spec as the new-job form's initial values (the page's "fill from a spec file"):
    booleans as booleans, a recipe's settings in the recipe's own fields."""
    data = spec_form_data(spec, team, pin=True)
    initial = {name: (value == "on") if name in BOOLEAN_FIELDS else value for name, value in data.items() if value is not None}
    recipe = data.get("recipe")
    if recipe in RECIPES and isinstance(spec.fields.get("config"), dict):
        config = dict(spec.fields["config"])
        for param in form_params(RECIPES[recipe]):
            if param.name in config:
                initial[recipe_field_name(recipe, param.name)] = config.pop(param.name)
        initial["config"] = json.dumps(config) if config else ""
    return initial
