"""Job spec files: a job written down as YAML (or JSON) in the form's four parts, read back
with the line of every field, so a refusal names the line to fix. Pure functions, no database.

    name: digits-mlp
    experiment: digits              # blank: the name; runs of one experiment are compared side by side
    kind: train                     # train | finetune | evaluate
    work:     {code: train.py, entrypoint, args, config, env, packages: [numpy>=1.26], recipe, precision: bf16, smoke_first}
    data:     {train: digits@2, heldout, train_files, heldout_files, start_job, base_model, evaluate_jobs}
    request:  {gpus, gpu_type, mode, span_hours, ceiling, ceiling_kind, not_before, by, deadline, preemptible, network,
               idle_minutes, stop_if_idle}
    output:   {keep_checkpoints, max_restarts, early_stop: {metric, mode, patience}, stop_on_nan}

`work.code`, `data.train_files`, `data.heldout_files` and `data.base_model` name files on the
submitter's machine: `e31 submit` sends them with the spec (as the files code, data, heldout and
base_model), the browser's form asks for them. Everything else is what the API's flat spec
(SPEC_FIELDS) holds, under the part of the form it belongs to. The schema, with
examples, is in examples/specs/.

Over 500 lines because reading a spec file and writing one back (a job's spec, for 'run again') are
two directions of one mapping, kept side by side so that neither drifts from the other.
"""

import difflib
import json
from dataclasses import dataclass, field
from datetime import date, datetime

import yaml
from django.utils import timezone

from core.json_limits import depth
from jobs.models import Upload

# The spec fields that are the job's own fields under the same names and describe its work, the
# compute it asks for and what it keeps: what a job made from a job (a retraining, a comparison, a
# smoke run: jobs.lineage.copy_job) carries over as they are. Not among them: the name, experiment and kind,
# the data (carried as dataset versions and inputs), the ceiling (as the amount or GPU hours it
# became), how and when it is scheduled (mode, not_before, deadline, by), idle_minutes and stop_if_idle.
JOB_WORK_FIELDS = (
    "entrypoint",
    "command",
    "args",
    "hyperparameters",
    "config",
    "env",
    "workdir",
    "processes",
    "precision",
    "packages",
    "gpus",
    "gpu_type",
    "span_hours",
    "preemptible",
    "keep_checkpoints",
    "max_restarts",
    "early_stop_metric",
    "early_stop_mode",
    "early_stop_patience",
    "stop_on_nan",
    "network",
)

# The API's flat spec: every field a spec sets (a spec file's parts hold them, see PARTS; jobs.spec_form
# makes them the job form's data).
SPEC_FIELDS = {
    *JOB_WORK_FIELDS,
    "name",
    "experiment",
    "kind",
    "recipe",
    "start_job",
    "evaluate_jobs",
    "smoke_first",
    "inputs",
    "train_dataset",
    "heldout_dataset",
    "mode",
    "ceiling_kind",
    "ceiling",
    "not_before",
    "deadline",
    "by",
    "idle_minutes",
    "stop_if_idle",
}

# Each part's fields, and the flat API field each one is (None: a local file, sent alongside).
PARTS = {
    "work": {
        "recipe": "recipe",
        "code": None,
        "entrypoint": "entrypoint",
        "command": "command",
        "args": "args",
        "hyperparameters": "hyperparameters",
        "config": "config",
        "env": "env",
        "workdir": "workdir",
        "packages": "packages",
        "precision": "precision",
        "smoke_first": "smoke_first",
    },
    "data": {
        "train": "train_dataset",
        "heldout": "heldout_dataset",
        "train_files": None,
        "heldout_files": None,
        "start_job": "start_job",
        "base_model": None,
        "evaluate_jobs": "evaluate_jobs",
        "inputs": "inputs",
    },
    "request": {
        name: name
        for name in (
            "gpus",
            "gpu_type",
            "processes",
            "mode",
            "span_hours",
            "ceiling",
            "ceiling_kind",
            "not_before",
            "by",
            "deadline",
            "preemptible",
            "network",
            "idle_minutes",
            "stop_if_idle",
        )
    },
    "output": {"keep_checkpoints": "keep_checkpoints", "max_restarts": "max_restarts", "early_stop": None, "stop_on_nan": "stop_on_nan"},
}
TOP = {"name": "name", "experiment": "experiment", "kind": "kind"}
EARLY_STOP = {"metric": "early_stop_metric", "mode": "early_stop_mode", "patience": "early_stop_patience"}
# The local files a spec names: (part, field) -> the file field they are sent as.
FILE_FIELDS = {("work", "code"): "code", ("data", "train_files"): "data", ("data", "heldout_files"): "heldout", ("data", "base_model"): "base_model"}
MAX_BYTES = 256 * 1024
MAX_DEPTH = 32  # mappings and lists inside each other: a spec uses 4, its config a few more


class SpecFileError(ValueError):
    """A spec file that cannot be read as a job: each problem with its line (or None)."""

    def __init__(self, problems, name="spec"):
        self.problems = problems  # [(line or None, field path or "", message)]
        self.name = name
        super().__init__("; ".join(where(name, line) + message for line, _, message in problems))


def where(name, line):
    """Where a problem is, as a message starts: "job.yaml line 7: " (nothing for a spec sent as an object)."""
    if not name:
        return ""
    return f"{name} line {line}: " if line else f"{name}: "


@dataclass
class SpecFile:
    """A spec file as read: the flat spec, the line of each flat field, the local files it names."""

    name: str
    fields: dict
    lines: dict = field(default_factory=dict)  # flat field -> line
    files: dict = field(default_factory=dict)  # file field (code, data, ...) -> [(path, line)]
    file_lines: dict = field(default_factory=dict)  # file field -> line of its key
    key_lines: dict = field(default_factory=dict)  # every key's path (a tuple) -> line

    def line_of(self, flat_field):
        return self.lines.get(flat_field) or self.file_lines.get(flat_field)

    def message(self, flat_field, text):
        """A refusal of one field as the user reads it: the file, the line, the field's path."""
        path = self.paths.get(flat_field)
        prefix = where(self.name, self.line_of(flat_field))
        return f"{prefix}{path}: {text}" if path else f"{prefix}{text}"

    @property
    def paths(self):
        paths = {flat: name for name, flat in TOP.items()}
        for part, names in PARTS.items():
            paths.update({flat: f"{part}.{name}" for name, flat in names.items() if flat})
        paths.update({flat: f"output.early_stop.{name}" for name, flat in EARLY_STOP.items()})
        paths.update({file_field: f"{part}.{name}" for (part, name), file_field in FILE_FIELDS.items()})
        return paths


def read(text, name="spec"):
    """A spec file's text as a SpecFile; raises SpecFileError naming the line of each problem.

    The four-part layout above, or the API's flat one (every field at the top), is accepted."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            raise SpecFileError([(None, "", "the spec is not UTF-8 text")], name) from None
    if len(text.encode()) > MAX_BYTES:
        raise SpecFileError([(None, "", f"the spec is larger than {MAX_BYTES // 1024} KB; is this the right file?")], name)
    if "\x00" in text:
        raise SpecFileError([(None, "", "the spec contains a NUL character")], name)
    node, document = _load(text, name)
    if document is None:
        raise SpecFileError([(None, "", "the spec is empty: describe the job's work, data, request and output")], name)
    if not isinstance(document, dict):
        raise SpecFileError([(_line(node), "", "the spec must be a mapping of fields (work:, data:, request:, output:)")], name)
    bad = _bad_text(document, keys_only=True)
    if bad:
        raise SpecFileError([(None, "", f"the spec contains {bad}")], name)
    lines = _lines(node)
    spec = SpecFile(name=name, fields={}, key_lines=lines)
    problems = []
    if set(document) & set(PARTS) or not set(document) - set(TOP):
        _read_parts(document, lines, spec, problems)
    else:
        _read_flat(document, lines, spec, problems)
    for flat, value in spec.fields.items():
        if bad := _bad_text(value):
            problems.append((spec.lines.get(flat), flat, f"{spec.paths.get(flat, flat)} contains {bad}"))
    if problems:
        raise SpecFileError(problems, name)
    return spec


def _load(text, name):
    try:
        return _parse(text, lines=True)
    except ParseError as error:
        if error.language == "JSON" and error.column:
            message = f"{error} (column {error.column})"
        elif error.language == "YAML":  # a file that meant to be JSON may be read as YAML
            message = f"not valid YAML or JSON: {error.problem}"
        else:
            message = str(error)
        raise SpecFileError([(error.line, "", message)], name) from None


# Reading a user's JSON or YAML --------------------------------------------------------------


class ParseError(ValueError):
    """Text that cannot be read as a value: why (`problem`), where (`line`, `column`, or None),
    and, when it breaks JSON's or YAML's rules, which (`language`). Without a language the
    problem reads alone after a file's line and after "the config is": "nested too deeply ..."."""

    def __init__(self, problem, line=None, column=None, language=None):
        self.problem, self.line, self.column, self.language = problem, line, column, language
        super().__init__(f"not valid {language}: {problem}" if language else problem)


TOO_DEEP = f"nested too deeply (more than {MAX_DEPTH} levels)"


def parse(text):
    """A user's JSON or YAML text as plain values: dicts, lists, text, numbers, booleans, None
    (YAML's dates as ISO text). The one reader of such text from outside: spec files, configs.

    Text that starts with { or [ is JSON and is read as JSON (YAML would read its escapes,
    such as an emoji's surrogate pair, otherwise); the rest is YAML without anchors and aliases
    (a few hundred bytes of them expand to gigabytes). At most MAX_BYTES, nested at most
    MAX_DEPTH deep: anything else raises ParseError at the first sign, before the work it asks."""
    return _parse(text)[1]


def parse_json(text, max_depth=MAX_DEPTH):
    """JSON text as values, nested at most max_depth deep; raises ParseError (no size limit:
    the caller's, such as a request body's, holds)."""
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as error:
        raise ParseError(error.msg, error.lineno, error.colno, "JSON") from None
    except RecursionError:  # deeper than the stack, found by the parser before our own count
        raise ParseError(TOO_DEEP) from None
    except ValueError as error:  # NaN, or a number longer than Python reads
        raise ParseError(str(error).split(";")[0], language="JSON") from None
    if depth(value, max_depth) > max_depth:
        raise ParseError(TOO_DEEP)
    return value


def _parse(text, lines=False):
    """(YAML's node of the text, for the line of each key, or None; the value)."""
    if len(text.encode("utf-8", "surrogatepass")) > MAX_BYTES:
        raise ParseError(f"larger than {MAX_BYTES // 1024} KB")
    if not text.lstrip().startswith(("{", "[")):
        return _parse_yaml(text)
    value = parse_json(text)
    if not lines:
        return None, value
    loader = None
    try:  # JSON read by YAML too, for its lines only: the values are JSON's
        loader = _loader(text)
        return loader.get_single_node(), value
    except (yaml.YAMLError, ParseError):  # a character JSON takes and YAML does not, ...
        return None, value
    finally:
        if loader is not None:
            loader.dispose()


def _no_constant(name):
    raise ValueError(f"{name} is not a JSON number")


def _anchored(event):
    mark = "*" if isinstance(event, yaml.AliasEvent) else "&"
    return f"written with YAML anchors or aliases ({mark}{event.anchor}), which are not accepted: write each value out"


_SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's where PyYAML has it: 6x faster on a spec


def _loader(text):
    """A loader of the text, its YAML screened first: without anchors and aliases, and nested
    at most MAX_DEPTH deep, each refused at its line as the parser meets it, so a hostile text
    costs the few events read up to there. Then a fresh loader composes. A text with a
    character YAML does not allow goes to PyYAML's own reader, which refuses it in its words."""
    kind = yaml.SafeLoader if yaml.reader.Reader.NON_PRINTABLE.search(text) else _SafeLoader
    screen, depth = kind(text), 0
    try:
        while _screened_event(screen):
            event = screen.get_event()
            line = event.start_mark.line + 1
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
                raise ParseError(_anchored(event), line)
            if isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
                depth += 1
                if depth > MAX_DEPTH:
                    raise ParseError(TOO_DEEP, line)
            elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
                depth -= 1
    finally:
        screen.dispose()
    return kind(text)


def _screened_event(loader):
    """Whether there is an event; libyaml's own limit on nesting (deeper than ours, met where a
    flow collection's tokens are read ahead) worded as ours."""
    try:
        return loader.check_event()
    except yaml.MarkedYAMLError as error:
        if "nesting depth" in (error.problem or "") and error.problem_mark is not None:
            raise ParseError(TOO_DEEP, error.problem_mark.line + 1) from None
        raise


def _parse_yaml(text):
    loader = None
    try:
        loader = _loader(text)  # a character YAML does not allow is found here, before parsing
        node = loader.get_single_node()
        return node, (_plain(loader.construct_document(node)) if node is not None else None)
    except ParseError:  # ours, already worded (and a ValueError, which the last clause would take)
        raise
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        context, opened = getattr(error, "context", None), getattr(error, "context_mark", None)
        if context and opened is not None and mark is not None and opened.line != mark.line:
            problem += f" ({context} at line {opened.line + 1})"
        raise ParseError(problem, mark.line + 1 if mark else None, mark.column + 1 if mark else None, "YAML") from None
    except (ValueError, TypeError, OverflowError) as error:  # a value YAML reads as a date that is none, a number too long
        raise ParseError(f"not valid YAML: {str(error).split(';')[0]}") from None
    finally:
        if loader is not None:
            loader.dispose()


def _bad_text(value, keys_only=False):
    """What no field may hold, even escaped (\\u0000, a lone surrogate): the database cannot store it."""
    if isinstance(value, str) and not keys_only:
        if "\x00" in value:
            return "a NUL character"
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return "text that is not valid Unicode (a lone surrogate)"
        return None
    if isinstance(value, dict):
        return next((b for k, v in value.items() for b in (_bad_text(k), _bad_text(v, keys_only)) if b), None)
    if isinstance(value, list):
        return next((b for v in value if (b := _bad_text(v, keys_only))), None)
    return None


def _plain(value):
    """Dates and times YAML read as such back to ISO text, as the form and the API take them;
    what JSON has no word for (YAML's !!binary, !!set, !!omap, !!pairs) is refused."""
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, (datetime, date)):
        return value.isoformat()
    if isinstance(value, (bytes, set, tuple)):
        raise ParseError("holding a YAML !!binary, !!set, !!omap or !!pairs value, which is not accepted: write text, lists and mappings")
    return value


def _line(node):
    return node.start_mark.line + 1 if node is not None else None


def _lines(node, path=()):
    """{path of keys: line} for every key and list item of the document."""
    found = {}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            if key is None:
                continue
            found[(*path, key)] = _line(key_node)
            found.update(_lines(value_node, (*path, key)))
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            found[(*path, index)] = _line(item)
            found.update(_lines(item, (*path, index)))
    return found


def _unknown(names, known, where_, lines, path, problems):
    for name in names:
        if name in known:
            continue
        close = difflib.get_close_matches(str(name), list(known), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else f"; known: {', '.join(known)}"
        problems.append((lines.get((*path, name)), ".".join(map(str, (*path, name))), f"unknown field '{name}' in {where_}{hint}"))


def _read_parts(document, lines, spec, problems):
    _unknown(document, [*TOP, *PARTS], "the spec", lines, (), problems)
    for name, flat in TOP.items():
        if name in document:
            _take(spec, flat, document[name], lines.get((name,)))
    for part, names in PARTS.items():
        if part not in document or document[part] is None:
            continue
        section = document[part]
        if not isinstance(section, dict):
            problems.append((lines.get((part,)), part, f"'{part}' must be a mapping of fields, not {_kind(section)}"))
            continue
        _unknown(section, list(names), f"'{part}'", lines, (part,), problems)
        for name, value in section.items():
            if name not in names:
                continue
            line = lines.get((part, name))
            if (part, name) in FILE_FIELDS:
                _take_files(spec, FILE_FIELDS[(part, name)], f"{part}.{name}", value, line, lines, (part, name), problems)
            elif name == "early_stop":
                _read_early_stop(value, lines, spec, problems)
            else:
                _take(spec, names[name], value, line)


def _read_early_stop(value, lines, spec, problems):
    path = ("output", "early_stop")
    if value is None:
        return
    if isinstance(value, str):  # early_stop: heldout_loss
        _take(spec, "early_stop_metric", value, lines.get(path))
        return
    if not isinstance(value, dict):
        problems.append((lines.get(path), "output.early_stop", f"early_stop must be a metric's name or {{metric, mode, patience}}, not {_kind(value)}"))
        return
    _unknown(value, list(EARLY_STOP), "'output.early_stop'", lines, path, problems)
    for name, flat in EARLY_STOP.items():
        if name in value:
            _take(spec, flat, value[name], lines.get((*path, name)))


def _read_flat(document, lines, spec, problems):
    _unknown(document, sorted(SPEC_FIELDS), "the spec", lines, (), problems)
    for name, value in document.items():
        if name in SPEC_FIELDS:
            _take(spec, name, value, lines.get((name,)))


def _take(spec, flat, value, line):
    spec.fields[flat] = value
    if line:
        spec.lines[flat] = line


def _take_files(spec, file_field, path_name, value, line, lines, path, problems):
    if value is None:
        return
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(v, str) and v.strip() for v in values):
        problems.append((line, path_name, f"{path_name} must be a file's path or a list of paths, not {_kind(value)}"))
        return
    if file_field == "code" and len(values) > 1:
        problems.append((line, path_name, "work.code is one file (a script or an archive) or one folder"))
        return
    spec.file_lines[file_field] = line
    spec.files[file_field] = [(v, lines.get((*path, i), line) if not isinstance(value, str) else line) for i, v in enumerate(values)]


def _kind(value):
    return (
        {dict: "a mapping", list: "a list", str: "text", bool: "true/false", int: "a number", float: "a number"}.get(type(value), type(value).__name__)
        if value is not None
        else "empty"
    )


# Writing a job down -------------------------------------------------------------------------


def dump(spec):
    """A four-part spec (a dict as job_spec makes) as YAML text, parts in the form's order."""
    header = (
        "# An E31 Network job spec: submit it with `e31 submit <file>`, or fill the new-job form from it.\n"
        "# The fields are described in examples/specs/README.md.\n"
    )
    return header + yaml.safe_dump(spec, sort_keys=False, default_flow_style=False, allow_unicode=True, width=100)


def as_json(spec):
    return json.dumps(spec, indent=2, default=str)


def job_spec(job, now=None):
    """A job as a four-part spec: what submits the same work, data and request again. Files
    that came with it are named (send them again); a time already past is left out."""
    now = now or timezone.now()
    uploads = list(job.uploads.all())
    named = lambda role: [u.name for u in uploads if u.role == role]  # noqa: E731
    # Its experiment always: a run again joins it, whatever the new run is named.
    spec = {"name": job.name, "experiment": job.experiment, "kind": job.kind}

    work = {}
    if job.recipe:
        work["recipe"] = job.recipe
    else:
        if named(Upload.CODE):
            work["code"] = named(Upload.CODE)[0]
        if job.entrypoint or not job.command:
            work["entrypoint"] = job.entrypoint
    config = {k: v for k, v in (job.config or {}).items() if not (job.recipe and k == "mode" and v == "evaluate")}
    given = (
        ("command", job.command),
        ("args", list(job.args or [])),
        ("hyperparameters", dict(job.hyperparameters or {})),
        ("config", config),
        ("env", dict(job.env or {})),
        ("workdir", job.workdir),
        ("packages", job.packages.splitlines()),
        ("precision", job.precision),
    )
    work.update({k: v for k, v in given if v})
    if job.smoke_run_id:
        work["smoke_first"] = True
    spec["work"] = work

    data = {}
    if job.train_label:  # NAME@N, also of a dataset deleted since
        data["train"] = job.train_label
    if named(Upload.TRAIN):
        data["train_files"] = named(Upload.TRAIN)
    if job.heldout_label:
        data["heldout"] = job.heldout_label
    if named(Upload.HELDOUT):
        data["heldout_files"] = named(Upload.HELDOUT)
    inputs = {i.name: i.label for i in job.inputs.all()}
    for upload in uploads:
        if upload.role == Upload.INPUT:
            inputs.setdefault(upload.channel, {"files": []})["files"].append(upload.name)
    if inputs:
        data["inputs"] = dict(sorted(inputs.items()))
    models = list(job.models.all())
    sources = [str(m.source_job_id) for m in models if m.source_job_id]
    uploaded = [f["name"] for m in models if not m.source_job_id for f in m.files]
    if sources and job.kind == job.KIND_EVALUATE:
        data["evaluate_jobs"] = sources
    elif sources:
        data["start_job"] = sources[0]
    if uploaded:
        data["base_model"] = uploaded
    if data:
        spec["data"] = data

    request = {"gpus": job.gpus}
    if job.processes:
        request["processes"] = job.processes
    if job.gpu_type:
        request["gpu_type"] = job.gpu_type
    if job.span_hours is not None:
        request.update(mode="span", span_hours=_number(job.span_hours))
    elif job.ceiling_gpu_hours is not None:
        request.update(mode="until_done", ceiling=_number(job.ceiling_gpu_hours), ceiling_kind="gpu_hours")
    else:
        request.update(mode="until_done", ceiling=_number(job.ceiling_amount), ceiling_kind="money")
    for name in ("not_before", "deadline"):
        moment = getattr(job, name)
        if moment is not None and moment > now:
            request[name] = timezone.localtime(moment).isoformat(timespec="minutes")
    if job.preemptible:
        request["preemptible"] = True
    if job.network:
        request["network"] = True
    if job.idle_minutes != 30:
        request["idle_minutes"] = job.idle_minutes
    if job.stop_if_idle:
        request["stop_if_idle"] = True
    spec["request"] = request

    output = {"keep_checkpoints": job.keep_checkpoints, "max_restarts": job.max_restarts}
    if job.early_stop_metric:
        early = {"metric": job.early_stop_metric, "mode": job.early_stop_mode}
        if job.early_stop_patience:
            early["patience"] = job.early_stop_patience
        output["early_stop"] = early
    output["stop_on_nan"] = job.stop_on_nan
    spec["output"] = output
    return spec


def _number(value):
    """A Decimal as the plain number a person would write (2, 1.5), for YAML."""
    return int(value) if value == value.to_integral_value() else float(value)


def file_name(job):
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in job.name).strip("-.") or "job"
    return f"{safe}.yaml"
