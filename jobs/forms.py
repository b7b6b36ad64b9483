"""The job form: one validation for the browser and the API.

Files are saved as Upload rows before the form is validated (see keep_uploads), so a refused
form keeps what the user uploaded: the page lists the kept files and sends their ids back.

Over 500 lines because it is one form: each field's check and the cross-field rules (the work, the
data, the request, the ceiling) read one another's cleaned values, and the browser and the API must
keep calling exactly this code.
"""

import logging
import re
import tempfile
import uuid
from pathlib import PurePosixPath

from django import forms
from django.conf import settings
from django.db import transaction
from django.forms.models import ModelChoiceIterator
from django.http import QueryDict
from django.utils import timezone

from accounts import audit
from accounts.access import get_for_team
from billing import meter
from billing.models import NoRateInForce, Rate
from catalog import datasets
from catalog.models import Dataset, DatasetVersion
from core.compiled import Insert, Read
from core.forms import Form, field_copy
from core.storage import get_storage
from e31.recipes import RECIPES, validate
from e31.recipes.precision import CHOICES as PRECISION_CHOICES
from jobs import archive, folder_uploads, folders, launch, lineage, packages, spec_text, states, windows
from jobs.compute import compute
from jobs.models import FolderUpload, Job, JobEvent, JobInput, Upload

log = logging.getLogger(__name__)
FILE_ROLES = {"code": Upload.CODE, "data": Upload.TRAIN, "heldout": Upload.HELDOUT, "base_model": Upload.MODEL}
METRIC_NAME = re.compile(r"^[A-Za-z0-9_./-]{1,100}$")
KEPT_FIELD = {Upload.CODE: "kept_code", Upload.TRAIN: "kept_data", Upload.HELDOUT: "kept_heldout", Upload.MODEL: "kept_model"}
KEPT_FIELDS = {**KEPT_FIELD, Upload.INPUT: "kept_inputs"}  # every kept upload's field, by its role
MODEL_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin")


# Recipe settings the form sets itself: the mode from the job's kind, the smoke option from
# "smoke run first" (a run of its own).
PLATFORM_PARAMS = {"mode", "smoke"}


def form_params(recipe):
    return [p for p in recipe.params if p.name not in PLATFORM_PARAMS]


def recipe_field_name(recipe, param):
    return f"recipe_{recipe}_{param}"


PARAM_LABELS = {
    "lr": "Learning rate",
    "lora_rank": "LoRA rank",
    "lora_alpha": "LoRA alpha",
    "max_steps": "Steps",
    "eval_every": "Evaluate every",
    "checkpoint_every": "Checkpoint every",
    "d_model": "Model width",
    "n_layers": "Layers",
    "n_heads": "Attention heads",
    "eval_windows": "Validation windows",
}


def recipe_form_field(param):
    """A form field for one of a built-in recipe's parameters (e31.recipes.Param)."""
    label = PARAM_LABELS.get(param.name, param.name.replace("_", " ").capitalize())
    common = {"required": False, "label": label, "help_text": param.help, "initial": param.default}
    if param.kind == "int":
        return forms.IntegerField(min_value=param.min, max_value=param.max, **common)
    if param.kind == "float":
        return forms.FloatField(min_value=param.min, max_value=param.max, **common)
    if param.kind == "bool":
        return forms.BooleanField(**common)
    return forms.ChoiceField(choices=[(c, c) for c in param.choices], **common)


class MultipleFileInput(forms.ClearableFileInput):
    allow_multiple_selected = True


class _LazyChoices(ModelChoiceIterator):
    """A model choice field's choices, reading its queryset only when they are listed."""

    def __init__(self, field):
        self.field = field

    @property
    def queryset(self):
        return self.field.queryset


class LazyQueryset:
    """A model choice field whose queryset is made when it is first read, not with the form
    (lazy_queryset), nor copied with it: a submission through the API reads few of the job
    form's eleven, and building each cost about as much as running a query. Its choices, on a
    page, are what the queryset finds when they are listed."""

    _make = None
    iterator = _LazyChoices

    def lazy_queryset(self, make):
        self._make = make  # the widget's choices already read the field's queryset when listed

    def __deepcopy__(self, memo):
        # Django's clones the queryset (ModelChoiceField.__deepcopy__): this one is cloned when read.
        result = field_copy(self, memo)
        if self._make is None and self._queryset is not None:
            result._make = self._queryset.all
        result.widget.choices = result.choices
        return result

    def _get_queryset(self):
        if self._make is not None:
            make, self._make = self._make, None
            forms.ModelChoiceField._set_queryset(self, make())
        return self._queryset

    def _set_queryset(self, queryset):
        self._make = None
        forms.ModelChoiceField._set_queryset(self, queryset)

    queryset = property(_get_queryset, _set_queryset)


class KnownChoiceField(LazyQueryset, forms.ModelChoiceField):
    """A ModelChoiceField that takes an object the request already holds without reading it
    again: one that the form's own checks made sure of (JobForm's `known`), by its id."""

    known: dict[str, object] = {}

    def to_python(self, value):
        found = self.known.get(str(value)) if value not in self.empty_values else None
        return found if found is not None else super().to_python(value)


class KnownMultipleChoiceField(LazyQueryset, forms.ModelMultipleChoiceField):
    """A ModelMultipleChoiceField that cleans to a list, in its queryset's order: none for no
    value (Django's own makes an empty queryset, and the form's checks that read it built and
    compiled its SQL each time), the objects the request already holds unread where every id
    is one of them (`known`, as KnownChoiceField's), else those its queryset finds."""

    known: dict[str, object] = {}

    def clean(self, value):
        value = self.prepare_value(value)
        if not value and not self.required:
            return []
        if isinstance(value, list | tuple) and value and all(str(v) in self.known for v in value):
            self.run_validators(value)
            found = list({str(v): self.known[str(v)] for v in value}.values())
            for name in reversed(self.queryset.model._meta.ordering):  # the queryset's order
                found.sort(key=lambda obj, name=name: getattr(obj, name.lstrip("-")), reverse=name.startswith("-"))
            return found
        return list(super().clean(value))


class DateTimeLocalInput(forms.DateTimeInput):
    input_type = "datetime-local"

    def __init__(self, **kwargs):
        super().__init__(format="%Y-%m-%dT%H:%M", **kwargs)


def keep_uploads(request_files, data, team, user):
    """Save every uploaded file as an Upload and add its id to the form data.

    Returns (data with kept ids, {field: [error]}, [new uploads]). Files over the size limit
    are not kept and get an error on their field."""
    data = data.copy() if isinstance(data, QueryDict) else _as_querydict(data)
    errors = {}
    created = []
    storage = get_storage()
    for field, role in FILE_ROLES.items():
        names = set()
        for uploaded in request_files.getlist(field):
            if uploaded.size > settings.E31_MAX_UPLOAD_BYTES:
                limit_mb = settings.E31_MAX_UPLOAD_BYTES // (1024 * 1024)
                errors.setdefault(field, []).append(f"{uploaded.name} is larger than the {limit_mb} MB limit for one file.")
                continue
            name = PurePosixPath(uploaded.name.replace("\\", "/")).name or "upload"
            if name in names:
                # Files sent with a job land side by side: one would overwrite the other.
                errors.setdefault(field, []).append(
                    f"Two files are named {name}: files sent with a job land in one folder. Rename one, or upload the folder as a dataset."
                )
                continue
            names.add(name)
            key, size, sha256 = storage.save_blob(uploaded)
            upload = INSERT_UPLOAD(Upload(team=team, uploaded_by=user, role=role, name=name, size=size, sha256=sha256, key=key))
            created.append(upload)
            kept = KEPT_FIELD[role]
            if role == Upload.CODE:
                data.setlist(kept, [str(upload.pk)])  # a new script replaces the kept one
            else:
                data.appendlist(kept, str(upload.pk))
    for field in sorted(f for f in request_files if f.startswith(INPUT_FIELD)):
        channel = field.removeprefix(INPUT_FIELD)
        if problem := launch.input_name_problem(channel):
            errors.setdefault("inputs", []).append(f"The files sent for input {problem}.")
            continue
        names = set()
        for uploaded in request_files.getlist(field):
            name = PurePosixPath(uploaded.name.replace("\\", "/")).name or "upload"
            if uploaded.size > settings.E31_MAX_UPLOAD_BYTES:
                errors.setdefault("inputs", []).append(f"input {channel}: {name} is larger than the limit for one file.")
                continue
            if name in names:
                errors.setdefault("inputs", []).append(f"input {channel}: two files are named {name}; they land in one folder.")
                continue
            names.add(name)
            key, size, sha256 = storage.save_blob(uploaded)
            upload = INSERT_UPLOAD(Upload(team=team, uploaded_by=user, role=Upload.INPUT, channel=channel, name=name, size=size, sha256=sha256, key=key))
            created.append(upload)
            data.appendlist("kept_inputs", str(upload.pk))
    folder_ref = (data.get(FOLDER_UPLOAD) or "").strip()
    if (request_files.getlist(FOLDER_FIELD) or folder_ref) and request_files.getlist("code"):
        errors.setdefault(FOLDER_FIELD, []).append("Send a script or an archive, or a folder, not both.")
    elif folder_ref and request_files.getlist(FOLDER_FIELD):
        errors.setdefault(FOLDER_FIELD, []).append("Send the folder once: its files, or the folder uploaded ahead of the form, not both.")
    elif folder_ref:
        # Not among `created`: it stays the folder's zip, whatever becomes of this form.
        upload, error = keep_folder_upload(folder_ref, team, user)
        if error:
            errors.setdefault(FOLDER_FIELD, []).append(error)
        else:
            data.setlist("kept_code", [str(upload.pk)])
    elif request_files.getlist(FOLDER_FIELD):
        upload, error = keep_folder(request_files.getlist(FOLDER_FIELD), data.getlist(FOLDER_PATHS), team, user)
        if error:
            errors.setdefault(FOLDER_FIELD, []).append(error)
        else:
            created.append(upload)
            data.setlist("kept_code", [str(upload.pk)])  # as a new script replaces the kept one
    return data, errors, created


# A named input's files come in the field input:<name> (the form adds one per input with files).
INPUT_FIELD = "input:"


# A folder's files come in FOLDER_FIELD, their paths in FOLDER_PATHS, in the same order (the
# file names Django gives are bare names: it drops any path a browser sends with a file).
FOLDER_FIELD, FOLDER_PATHS = "code_folder", "code_paths"
# Or the folder was uploaded ahead of the form, resumably (jobs/folder_uploads.py): its id.
FOLDER_UPLOAD = "code_folder_upload"


def keep_folder(files, paths, team, user):
    """The folder's files packed into a zip and kept as the job's code: (upload, None), or
    (None, the reason it was refused)."""
    if len(paths) != len(files):
        return None, "The folder's files came without their paths (the page sends them with JavaScript on): choose it again, or zip it."
    max_bytes, max_entries = archive.limits()
    with tempfile.TemporaryFile() as packed:
        try:
            top, _ = folders.pack(zip(paths, files), packed, max_bytes=max_bytes, max_entries=max_entries)
        except folders.FolderError as error:
            return None, f"The folder was not packed: {error}."
        packed.seek(0)
        key, size, sha256 = get_storage().save_blob(packed)
    name = f"{(top or 'folder')[:200]}.zip"
    return Upload.objects.create(team=team, uploaded_by=user, role=Upload.CODE, name=name, size=size, sha256=sha256, key=key), None


def keep_folder_upload(folder_id, team, user):
    """A folder uploaded ahead of the form (its id), packed into a zip and kept as the job's code:
    (upload, None), or (None, the reason). What was uploaded is never lost here: a folder not all
    arrived stays as it is, and one packed answers its zip again."""
    from django.http import Http404

    try:
        # Another team's folder is not found, as a missing one (and recorded as asked for).
        folder = get_for_team(FolderUpload.objects.all(), user, pk=folder_id)
    except Http404:
        return None, "The folder's upload was not found (a folder no chunk reached for two days is given up): choose the folder again."
    try:
        return folder_uploads.pack_folder(folder, user), None
    except folder_uploads.UploadConflict as error:
        return None, _sentence(error)
    except folders.FolderError as error:
        return None, f"The folder was not packed: {error}; choose it again."
    except Exception:  # storage trouble: the folder is kept, as it was
        log.exception("packing %s", folder)
        return None, "Storage failed while packing the folder; nothing is lost: send the form again."


def _sentence(error):
    text = str(error).strip()
    text = text[:1].upper() + text[1:]
    return text if text.endswith(".") else f"{text}."


def folder_limits():
    """What a folder may hold, as the page checks it before sending: an archive's bytes and
    entries, and the files one request may carry (Django answers more with a bare 400, the form
    lost: a folder uploaded ahead of the form is not among them)."""
    most = settings.DATA_UPLOAD_MAX_NUMBER_FILES
    max_bytes, max_entries = archive.limits()
    return {"data-max-bytes": max_bytes, "data-max-entries": max_entries, **({"data-max-files": most} if most else {})}


def _as_querydict(mapping):
    query = QueryDict(mutable=True)
    for name, value in mapping.items():
        if isinstance(value, (list, tuple)):
            query.setlist(name, [str(v) for v in value])
        elif value is not None:
            query[name] = str(value)
    return query


INSERT_JOB = Insert(Job)
INSERT_UPLOAD = Insert(Upload)
RATE_TYPES = Read(lambda: Rate.objects.exclude(gpu_type="").values_list("gpu_type", flat=True))  # made once (core.compiled)


def device_type_choices():
    types = compute().device_types() | set(RATE_TYPES())
    return [("", "Any type")] + [(t, t) for t in sorted(types)]


class RequestForm(Form):
    """The compute request: GPUs, how long, and what it may cost. Also the form's live estimate."""

    # Request
    gpus = forms.IntegerField(min_value=1, max_value=1024, initial=1, label="GPUs", error_messages={"min_value": "Ask for at least 1 GPU."})
    gpu_type = forms.ChoiceField(required=False, label="GPU type", choices=[("", "Any type")])  # each form's: __init__
    mode = forms.ChoiceField(
        choices=[("span", "A fixed span"), ("until_done", "Until done, with a ceiling")],
        initial="span",
        widget=forms.RadioSelect,
        label="How long",
    )
    span_hours = forms.DecimalField(required=False, max_digits=10, decimal_places=4, label="Hours", initial=1)
    ceiling_kind = forms.ChoiceField(choices=[("money", f"Money ({settings.E31_CURRENCY})"), ("gpu_hours", "GPU-hours")], initial="money", required=False)
    ceiling = forms.DecimalField(required=False, max_digits=14, decimal_places=2)
    not_before = forms.DateTimeField(required=False, widget=DateTimeLocalInput, label="Not before")
    by = forms.ChoiceField(choices=windows.CHOICES, required=False, label="Needed by")
    deadline = forms.DateTimeField(required=False, widget=DateTimeLocalInput)
    preemptible = forms.BooleanField(
        required=False,
        label="Preemptible",
        help_text="At the discounted preemptible rate. It may be stopped to make room (with time to checkpoint) and resumes from its latest checkpoint.",
    )

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Read when listed or when a type is given (ChoiceField checks a blank value against no
        # choice), once: a submission without a type asks nothing of the nodes and rates (issue 24).
        self._device_types = None
        self.fields["gpu_type"].choices = self.device_type_choices
        zone = timezone.get_current_timezone_name()
        self.fields["not_before"].help_text = f"Time zone: {zone}."
        self.fields["deadline"].help_text = f"When the results are needed ({zone}), if no quick choice is made."
        self.rate = None
        self.estimate = None

    def device_type_choices(self):
        """The GPU type's choices, read when the form first lists them or checks a type, then
        kept: a page that shows the form with its errors lists them again."""
        if self._device_types is None:
            self._device_types = device_type_choices()
        return self._device_types

    def clean_span_hours(self):
        return self._positive("span_hours", "The span must be longer than 0 hours.")

    def clean_ceiling(self):
        return self._positive("ceiling", "The ceiling must be more than 0.")

    def _positive(self, field, message):
        value = self.cleaned_data.get(field)
        if value is not None and value <= 0:
            raise forms.ValidationError(message)
        return value

    def clean(self):
        cleaned = super().clean()
        if cleaned.get("by") and cleaned.get("deadline") is None:
            # The request states the window (from now, or not before, to the deadline) in the
            # user's time zone; stored as instants.
            cleaned["deadline"] = windows.deadline_for(cleaned["by"], timezone.localtime())
        self._clean_request(cleaned)
        return cleaned

    def _clean_request(self, cleaned):
        mode = cleaned.get("mode")
        # The fields of the mode not chosen are ignored, errors and all.
        self._errors.pop("ceiling" if mode == "span" else "span_hours", None)
        if mode == "span":
            if cleaned.get("span_hours") is None and "span_hours" not in self.errors:
                self.add_error("span_hours", "Give the span in hours.")
            cleaned["ceiling"] = None
        elif mode == "until_done":
            if cleaned.get("ceiling") is None and "ceiling" not in self.errors:
                self.add_error("ceiling", "Until done needs a ceiling: the most you will pay, or GPU-hours.")
            if not cleaned.get("ceiling_kind"):
                cleaned["ceiling_kind"] = "money"
            cleaned["span_hours"] = None
        if self.errors.keys() & {"gpus", "span_hours", "ceiling", "mode"}:
            return
        try:
            gpu_type = cleaned.get("gpu_type") or ""
            rates = Rate.objects
            preemptible = bool(cleaned.get("preemptible"))
            rate = rates.in_force(gpu_type) if gpu_type else rates.worst_case(preemptible=preemptible)
        except NoRateInForce as error:
            self.add_error(None, str(error))
            return
        self.rate = rate.for_job(preemptible)
        self.estimate = meter.estimate(self.meter_request(), self.rate)

    def meter_request(self):
        cleaned = self.cleaned_data
        ceiling, kind = cleaned.get("ceiling"), cleaned.get("ceiling_kind")
        return meter.Request(
            gpus=cleaned["gpus"],
            span_hours=cleaned.get("span_hours"),
            ceiling_amount=ceiling if kind == "money" else None,
            ceiling_gpu_hours=ceiling if kind == "gpu_hours" else None,
        )


class WorkTextFields:
    """The work's text fields a job form and a retraining share: each parsed by jobs.spec_text, its
    error on the field; named inputs resolved to the team's dataset versions (None: files)."""

    def _parsed(self, parse, field, *args):
        try:
            return parse(self.cleaned_data[field], *args)
        except spec_text.SpecError as error:
            raise forms.ValidationError(str(error)) from None

    def clean_args(self):
        return self._parsed(spec_text.parse_args, "args")

    def clean_config(self):
        return self._parsed(spec_text.parse_config, "config")

    def clean_hyperparameters(self):
        return self._parsed(spec_text.parse_hyperparameters, "hyperparameters")

    def clean_inputs(self):
        versions, problems = {}, []
        for name, ref in self._parsed(spec_text.parse_inputs, "inputs").items():
            try:
                versions[name] = None if ref is None else datasets.resolve(self.team, ref)  # None: files, as input:<name>
            except datasets.DatasetError as error:
                problems.append(f"input {name}: {error}.")
        if problems:
            raise forms.ValidationError(problems)
        return versions


def experiment_field(help_text):
    """The experiment a job joins, as the job form and a retraining ask for it (Job.experiment's limit)."""
    limit = Job._meta.get_field("experiment").max_length
    return forms.CharField(
        max_length=limit,
        required=False,
        label="Experiment",
        help_text=help_text,
        error_messages={"max_length": "An experiment's name is at most %(limit_value)d characters (it has %(show_value)d)."},
    )


def one_line(value, what):
    """A name as typed, stripped; a control character (a line break, a tab) refused, naming what."""
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise forms.ValidationError(f"{what} cannot contain control characters (such as line breaks).")
    return value.strip()


class JobForm(WorkTextFields, RequestForm):
    name = forms.CharField(max_length=200, required=False, help_text="Defaults to the entrypoint's name.")
    experiment = experiment_field("Blank: the job's name. Runs of one experiment are compared side by side on the experiment page.")

    # Work
    kind = forms.ChoiceField(
        choices=Job.KINDS,
        initial=Job.KIND_TRAIN,
        required=False,
        widget=forms.RadioSelect,
        label="Kind",
        help_text="Fine-tune: start from a model. Evaluate: score models on the held-out data.",
    )
    recipe = forms.ChoiceField(
        required=False,
        label="Built-in recipe",
        help_text="No script needed: the recipe's parameters are below.",
    )
    smoke_first = forms.BooleanField(
        required=False,
        label="Smoke run first",
        help_text="A short job of its own (billed as such) before the full run, to catch errors cheaply: a recipe runs a few steps on 1% of the data; "
        "a script runs a few minutes on 1% of each input, with E31_SMOKE=1, and passes if it has not failed by then. The full run starts only if it passes.",
    )
    code = forms.FileField(required=False, label="Training script or archive", help_text="A .py script, or a .zip / .tar.gz archive; or a folder, below.")
    kept_code = KnownChoiceField(queryset=Upload.objects.none(), required=False, widget=forms.HiddenInput)
    # Chosen or dropped in the browser, its files sent with their paths (static/js/folder.js)
    # and packed into a zip by keep_uploads: the page shows it only where JavaScript runs.
    code_folder = forms.FileField(
        required=False,
        label="Or a folder",
        widget=MultipleFileInput(attrs={"webkitdirectory": True, **folder_limits()}),
        help_text="Choose or drop the folder: its files keep their paths and are packed into a zip the job unpacks. "
        "It is uploaded as soon as it is chosen; an upload cut off goes on where it stopped (after a reload, choose the same folder again). "
        "Paths start inside the folder chosen (myproj/src/train.py is src/train.py); __pycache__ and .git are left out.",
    )
    entrypoint = forms.CharField(
        max_length=500,
        required=False,
        help_text="The script to run (.py or .sh), by its path in the archive or folder: src/train.py.",
    )
    args = forms.CharField(
        max_length=4000,
        required=False,
        label="Arguments",
        help_text="As on a command line. $E31_DATA_DIR, $E31_OUTPUT_DIR, $E31_CHECKPOINT_DIR, $SM_CHANNEL_TRAIN and the job's own "
        "variables are replaced by their values ($$ for a plain $): --data $E31_DATA_DIR/train --save $E31_OUTPUT_DIR/model.pt",
    )
    hyperparameters = forms.CharField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 3}),
        label="Hyperparameters",
        help_text="JSON or YAML, one level: each is passed after the arguments as --name value (as SageMaker does), and in SM_HPS and SM_HP_<NAME>.",
    )
    command = forms.CharField(
        max_length=4000,
        required=False,
        label="Or a command",
        help_text="One shell line run instead of an entrypoint, in the code's folder (bash -c): pip list && python train.py --epochs 3",
    )
    workdir = forms.CharField(
        max_length=500,
        required=False,
        label="Working folder",
        help_text="Where the job starts, in the code's folder. Blank: the entrypoint's own folder (a script opens its neighbours by name).",
    )
    processes = forms.IntegerField(
        min_value=1,
        max_value=64,
        required=False,
        label="Processes per node",
        help_text="Blank: one per GPU (under torchrun), or one for CPU slots, which it gets as threads. Two or more run under torchrun.",
    )
    precision = forms.ChoiceField(
        choices=PRECISION_CHOICES,
        required=False,
        label="Precision",
        help_text="How the built-in recipes compute on GPUs: bf16 or fp16 autocast (fp16 with loss scaling), or fp32 throughout. "
        "On the CPU they run fp32 whatever is chosen (the log says so). A script reads the choice from $E31_PRECISION.",
        error_messages={"invalid_choice": "%(value)s is not a precision: choose fp32, bf16 or fp16 (or leave it blank for the default)."},
    )
    config = forms.CharField(required=False, widget=forms.Textarea(attrs={"rows": 4}), help_text="JSON or YAML; the job reads it from $E31_CONFIG.")
    env = forms.CharField(required=False, label="Environment", widget=forms.Textarea(attrs={"rows": 2}), help_text="NAME=value, one per line.")
    packages = forms.CharField(
        required=False,
        label="Python packages",
        widget=forms.Textarea(attrs={"rows": 3, "class": "mono"}),
        help_text="One requirement a line, as in requirements.txt (numpy>=1.26, einops==0.8.0). Installed from wheels into an "
        "environment built on the node while the job waits, not billed; a requirements.txt at the root of an archive is read too.",
    )

    # Data
    train_dataset = KnownChoiceField(queryset=Dataset.objects.none(), required=False, label="Training dataset", help_text="Its latest version is used.")
    train_version = KnownChoiceField(queryset=DatasetVersion.objects.none(), required=False, widget=forms.HiddenInput)
    data = forms.FileField(required=False, widget=MultipleFileInput, label="Training files")
    kept_data = KnownMultipleChoiceField(queryset=Upload.objects.none(), required=False, widget=forms.MultipleHiddenInput)
    heldout_dataset = KnownChoiceField(queryset=Dataset.objects.none(), required=False, label="Held-out dataset")
    heldout_version = KnownChoiceField(queryset=DatasetVersion.objects.none(), required=False, widget=forms.HiddenInput)
    heldout = forms.FileField(required=False, widget=MultipleFileInput, label="Held-out files")
    kept_heldout = KnownMultipleChoiceField(queryset=Upload.objects.none(), required=False, widget=forms.MultipleHiddenInput)
    kept_inputs = KnownMultipleChoiceField(queryset=Upload.objects.none(), required=False, widget=forms.MultipleHiddenInput)
    inputs = forms.CharField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 2, "class": "mono", "placeholder": "training: digits\ntesting: digits-heldout@1"}),
        label="Named inputs",
        help_text="More data, each from a dataset, one a line as name: dataset (or dataset@2): each lands in $E31_DATA_DIR/<name> "
        "and is SM_CHANNEL_<NAME>, as SageMaker's channels are.",
    )

    # Models: where a fine-tuning starts, what an evaluation scores
    start_job = KnownChoiceField(
        queryset=Job.objects.none(),
        required=False,
        label="Starting model: a previous job's weights",
        help_text="Fine-tune from the weights one of your team's finished jobs wrote.",
    )
    evaluate_jobs = KnownMultipleChoiceField(
        queryset=Job.objects.none(),
        required=False,
        label="Models to score: previous jobs' weights",
    )
    base_model = forms.FileField(
        required=False,
        widget=MultipleFileInput,
        label="Or upload a model",
        help_text="Weights as safetensors or a torch state dict (.pt), with the recipe.json that names its architecture if it came from a recipe.",
    )
    kept_model = KnownMultipleChoiceField(queryset=Upload.objects.none(), required=False, widget=forms.MultipleHiddenInput)

    # Checkpoints and stopping
    keep_checkpoints = forms.IntegerField(
        min_value=1,
        max_value=100,
        initial=3,
        required=False,
        label="Checkpoints kept",
        help_text="The latest K checkpoints are kept in storage; a restarted job resumes from the latest.",
    )
    max_restarts = forms.IntegerField(
        min_value=0,
        max_value=100,
        initial=3,
        required=False,
        label="Restarts allowed",
        help_text="How often the job may be restarted after losing its node before it fails (preemptions do not count).",
    )
    early_stop_metric = forms.CharField(max_length=100, required=False, label="Early stopping metric", help_text="A metric the job logs, e.g. heldout_loss.")
    early_stop_mode = forms.ChoiceField(choices=[("min", "Lower is better"), ("max", "Higher is better")], initial="min", required=False, label="Better is")
    early_stop_patience = forms.IntegerField(
        min_value=1, max_value=100000, required=False, label="Patience", help_text="Evaluations without improvement before it stops."
    )
    stop_on_nan = forms.BooleanField(required=False, initial=True, label="Stop on a NaN loss", help_text="End the run when a loss becomes NaN or infinite.")
    idle_minutes = forms.IntegerField(
        min_value=0,
        max_value=10080,
        initial=30,
        required=False,
        label="Idle after (minutes)",
        help_text="Flag the job, and tell the team, when every device it holds stays idle this long. 0: never.",
    )
    stop_if_idle = forms.BooleanField(
        required=False,
        initial=False,
        label="Stop if idle",
        help_text="Once flagged idle, stop the job (it is told to checkpoint first) so an idle run does not burn money.",
    )
    network = forms.BooleanField(
        required=False,
        initial=False,
        label="Network access",
        help_text="Let the job reach the network (to download packages or weights, say). Off: it sees only its own loopback. "
        "A run across several nodes always has the network, to reach its peers.",
    )

    def __init__(self, *args, team, upload_errors=None, known=(), chosen_recipe_only=False, **kwargs):
        """known: objects this request made or resolved for the team (the files it sent, the
        dataset versions its spec named), which the fields then take without a query each;
        only where each is what the field's queryset would find (_known).

        chosen_recipe_only: the fields of the recipe the data names, not every recipe's (a form
        that is never shown: the API's). The page shows every recipe's, to switch between them;
        making them took about a tenth of a submission's CPU (issue 24)."""
        super().__init__(*args, **kwargs)
        self.team = team
        self.upload_errors = upload_errors or {}
        # Each made when first read (LazyQueryset).
        for field in ("train_dataset", "heldout_dataset"):
            self.fields[field].lazy_queryset(lambda: Dataset.objects.filter(team=team, versions__state=DatasetVersion.READY).distinct())
        for field in ("train_version", "heldout_version"):
            # With their datasets: the new job keeps each version's NAME@N (Job.save).
            self.fields[field].lazy_queryset(lambda: DatasetVersion.objects.filter(dataset__team=team, state=DatasetVersion.READY).select_related("dataset"))
        for role, field in KEPT_FIELDS.items():
            self.fields[field].lazy_queryset(lambda role=role: Upload.objects.filter(team=team, job__isnull=True, role=role))
        for field in ("start_job", "evaluate_jobs"):
            self.fields[field].lazy_queryset(
                lambda: Job.objects.filter(team=team, state__in=[states.SUCCEEDED, states.STOPPED], artifacts__isnull=False).distinct()
            )
        for field, objects in _known(team, known).items():
            self.fields[field].known = objects

        self.recipes = RECIPES
        self.fields["recipe"].choices = [("", "None: my own script")] + [(name, r.title) for name, r in RECIPES.items()]
        chosen = self.data.get("recipe") if chosen_recipe_only else None
        for name, recipe in RECIPES.items():
            if chosen_recipe_only and name != chosen:
                continue
            for param in form_params(recipe):
                self.fields[recipe_field_name(name, param.name)] = recipe_form_field(param)
        self.entries = None

    def recipe_fieldsets(self):
        """[(recipe, [bound field, ...])] for the page: one fieldset per recipe."""
        return [(recipe, [self[recipe_field_name(name, p.name)] for p in form_params(recipe)]) for name, recipe in self.recipes.items()]

    # Kept uploads, for the page to list.
    def kept(self, field):
        if not self.is_bound:
            return []
        ids = self.data.getlist(field) if hasattr(self.data, "getlist") else []
        return list(self.fields[field].queryset.filter(pk__in=[i for i in ids if is_uuid(i)]))

    def clean_name(self):
        return one_line(self.cleaned_data["name"], "The name")

    def clean_experiment(self):
        return one_line(self.cleaned_data["experiment"], "The experiment")

    def clean_command(self):
        command = self.cleaned_data["command"].strip()
        if "\n" in command or "\r" in command or "\x00" in command:
            raise forms.ValidationError("The command is one line (join several with && or ;).")
        return command

    def clean_workdir(self):
        try:
            return launch.clean_relative(self.cleaned_data["workdir"].strip(), "the working folder")
        except ValueError as error:
            raise forms.ValidationError(f"{str(error)[0].upper()}{str(error)[1:]}.") from None

    def clean_env(self):
        return self._parsed(spec_text.parse_env, "env", self.cleaned_data.get("hyperparameters") or {})

    def clean_packages(self):
        try:
            return packages.merge(self.cleaned_data["packages"])
        except packages.PackagesError as error:
            raise forms.ValidationError(str(error)) from None

    def clean(self):
        cleaned = super().clean()  # the request, and its estimate
        for field, errors in self.upload_errors.items():
            for error in errors:
                self.add_error(field, error)
        for kept, visible in (
            ("kept_code", "code"),
            ("kept_data", "data"),
            ("kept_heldout", "heldout"),
            ("kept_model", "base_model"),
            ("kept_inputs", "inputs"),
        ):
            if self._errors.pop(kept, None):
                self.add_error(visible, "An earlier upload is no longer available: please upload it again.")
        cleaned["kind"] = cleaned.get("kind") or Job.KIND_TRAIN
        if cleaned.get("recipe"):
            self._clean_recipe(cleaned)
        elif cleaned.get("command") and not cleaned.get("kept_code") and "code" not in self.errors:
            cleaned["entrypoint"] = ""  # a shell line, with no code of its own
        else:
            self._clean_work(cleaned)
        self._clean_models(cleaned)
        self._clean_data(cleaned)
        self._clean_window(cleaned)
        self._clean_stopping(cleaned)
        self._clean_launch(cleaned)
        if not cleaned.get("name") and cleaned.get("entrypoint"):
            cleaned["name"] = PurePosixPath(cleaned["entrypoint"]).stem
        return cleaned

    def _clean_work(self, cleaned):
        upload = cleaned.get("kept_code")
        if upload is None:
            if not self.errors.keys() & {"code", FOLDER_FIELD}:
                self.add_error("code", "Upload a training script (.py) or an archive (.zip, .tar.gz).")
            return
        try:
            with get_storage().local_copy(upload.key) as path:
                self.entries = archive.list_entries(path, upload.name)
                requirements = archive.read_requirements(path, upload.name, self.entries)
        except archive.ArchiveError as error:
            # An unusable file is not worth keeping: the user has to send a new one.
            self.add_error("code", f"{upload.name}: {error}")
            cleaned["kept_code"] = None
            return
        if requirements is not None:
            self._add_requirements(cleaned, upload, requirements)
        entrypoint = cleaned.get("entrypoint") or ""
        if archive.kind_of(upload.name) == "script" and not entrypoint:
            entrypoint = upload.name
        try:
            cleaned["entrypoint"] = archive.check_entrypoint(self.entries, entrypoint)
        except archive.ArchiveError as error:
            self.add_error("entrypoint", str(error))

    def _add_requirements(self, cleaned, upload, requirements):
        """The archive's requirements.txt after the packages given on the form (each named once)."""
        try:
            packages.parse(requirements)
        except packages.PackagesError as error:
            where = f"{upload.name}: {archive.REQUIREMENTS}" + (" " if error.line else ": ")
            self.add_error("code", f"{where}{error}")
            return
        if "packages" in self.errors:
            return  # the field's own error is shown; merging would hide which lines are at fault
        try:
            cleaned["packages"] = packages.merge(cleaned.get("packages") or "", requirements)
        except packages.PackagesError as error:
            self.add_error("packages", f"With the archive's {archive.REQUIREMENTS}: {error}")

    def _clean_recipe(self, cleaned):

        name = cleaned["recipe"]
        given = {}
        for param in form_params(self.recipes[name]):
            value = cleaned.get(recipe_field_name(name, param.name))
            if value is not None and value != "":
                given[param.name] = value
        if cleaned["kind"] == Job.KIND_EVALUATE:
            given["mode"] = "evaluate"
        config = {**(cleaned.get("config") or {}), **given}
        clean, errors = validate(name, config)
        for key, message in errors.items():
            field = recipe_field_name(name, key)
            self.add_error(field if field in self.fields else "config", f"{key}: {message}" if field not in self.fields else message)
        cleaned["config"] = clean
        cleaned["entrypoint"] = Job.RECIPE_PREFIX + name
        cleaned["kept_code"] = None
        if not cleaned.get("name"):
            cleaned["name"] = name

    def _clean_models(self, cleaned):
        kind, start, scored = cleaned["kind"], cleaned.get("start_job"), list(cleaned.get("evaluate_jobs") or [])
        uploaded = list(cleaned.get("kept_model") or [])
        if uploaded and not any(u.name.endswith(MODEL_SUFFIXES) for u in uploaded) and "base_model" not in self.errors:
            self.add_error("base_model", "A model needs its weights: a .safetensors, .pt, .pth or .bin file.")
        names = [u.name for u in uploaded]
        if len(names) != len(set(names)):
            self.add_error("base_model", "Two model files have the same name.")
        self.models = []  # (label, files, source job, description)
        if kind == Job.KIND_FINETUNE:
            if start is not None and uploaded:
                self.add_error("start_job", "Start from a previous job or from an uploaded model, not both.")
            elif start is not None:
                self._pin("start", start)
            elif uploaded:
                self.models.append(("start", lineage.files_of_uploads(uploaded), None, "uploaded weights: " + ", ".join(names)))
            elif "base_model" not in self.errors:
                self.add_error("start_job", "A fine-tuning starts from a model: choose a previous job or upload weights.")
        elif kind == Job.KIND_EVALUATE:
            for job in scored:
                self._pin(f"job-{job.short_id}", job)
            if uploaded:
                self.models.append(("uploaded", lineage.files_of_uploads(uploaded), None, "uploaded weights: " + ", ".join(names)))
            if not self.models and not self.errors.keys() & {"evaluate_jobs", "base_model"}:
                self.add_error("evaluate_jobs", "Choose the models to score: previous jobs, or upload one.")
        elif start is not None or uploaded or scored:
            self.add_error("kind", "A starting model or models to score need the kind Fine-tune or Evaluate.")

    def _pin(self, label, job):
        try:
            self.models.append((label, lineage.weights_of(job), job, f"the weights of {job.name} ({job.short_id})"))
        except lineage.LineageError as error:
            self.add_error("start_job" if label == "start" else "evaluate_jobs", str(error))

    def _clean_data(self, cleaned):
        # Files sent for named inputs, each with its input's name; an input given as files must have some.
        files = {}
        for upload in cleaned.get("kept_inputs") or []:
            files.setdefault(upload.channel, []).append(upload)
        declared = cleaned.get("inputs") or {}
        for name, version in declared.items():
            if version is None and name not in files and "inputs" not in self.errors:
                self.add_error("inputs", f"The input {name} is to be files, and none were sent for it (in the field input:{name}).")
            elif version is not None and name in files:
                self.add_error("inputs", f"The input {name} is the dataset {version.label} and files too: give one.")
        for name in files:
            if name in ("train", "heldout", "model") or (problem := launch.input_name_problem(name, [*declared, *files])):
                self.add_error(
                    "inputs",
                    f"Files for input {name}: " + ("send them as the training or held-out files." if name in ("train", "heldout", "model") else problem),
                )
        for name, uploads in files.items():
            names = [u.name for u in uploads]
            if dupes := sorted({n for n in names if names.count(n) > 1}):
                self.add_error("inputs", f"input {name}: two files are named {', '.join(dupes)}.")
        cleaned["input_files"] = files
        # train and heldout among the named inputs are the training and held-out sets.
        inputs = {name: version for name, version in declared.items() if version is not None}
        for name, dataset_field, version_field in (("train", "train_dataset", "train_version"), ("heldout", "heldout_dataset", "heldout_version")):
            if name in inputs:
                if cleaned.get(dataset_field) is not None:
                    self.add_error("inputs", f"The input {name} is the {dataset_field.replace('_', ' ')}: give it once.")
                else:
                    cleaned[dataset_field], cleaned[version_field] = inputs[name].dataset, inputs[name]
        cleaned["inputs"] = {name: version for name, version in inputs.items() if name not in ("train", "heldout")}
        # A pinned version (the API's "name@2") must be of the dataset named; else the latest.
        for dataset_field, version_field in (("train_dataset", "train_version"), ("heldout_dataset", "heldout_version")):
            dataset, version = cleaned.get(dataset_field), cleaned.get(version_field)
            if version is not None and (dataset is None or version.dataset_id != dataset.pk):
                self.add_error(dataset_field, "That version is not of this dataset.")
            elif dataset is not None and version is None:
                cleaned[version_field] = dataset.latest_version()
        for field, what in (("kept_data", "training"), ("kept_heldout", "held-out")):
            names = [u.name for u in cleaned.get(field) or []]
            dupes = sorted({n for n in names if names.count(n) > 1})
            if dupes:
                self.add_error(field.removeprefix("kept_"), f"Two {what} files are named {', '.join(dupes)}.")
        evaluating = cleaned.get("kind") == Job.KIND_EVALUATE
        if evaluating and not cleaned.get("kept_heldout") and not cleaned.get("heldout_dataset") and "heldout" not in self.errors:
            self.add_error("heldout", "An evaluation scores the models on held-out data: upload files or choose a dataset.")
        given = cleaned.get("kept_data") or cleaned.get("train_dataset") or cleaned.get("inputs") or files
        if not evaluating and not given and "data" not in self.errors and "inputs" not in self.errors:
            self.add_error("data", "Give the training set: upload files or choose a dataset (or name the inputs the job reads).")

    def _clean_window(self, cleaned):
        not_before, deadline = cleaned.get("not_before"), cleaned.get("deadline")
        if deadline is not None:
            if not_before is not None and deadline <= not_before:
                self.add_error("deadline", "The deadline must be after the not-before time.")
            elif deadline <= timezone.now():
                self.add_error("deadline", "The deadline is already past.")

    def _clean_launch(self, cleaned):
        """How the job starts: a command or an entrypoint (with its arguments), the variables they
        name, the working folder."""
        command = cleaned.get("command") or ""
        if command and cleaned.get("recipe"):
            self.add_error("command", "A built-in recipe runs by itself: leave the command blank.")
        if command and cleaned.get("args"):
            self.add_error("args", "With a command, write the arguments in it.")
        if command and (cleaned.get("processes") or 1) > 1:
            self.add_error("processes", "A command runs once: start torchrun in it yourself for several processes.")
        hyperparameters = cleaned.get("hyperparameters") or {}
        inputs = sorted({*(cleaned.get("inputs") or {}), *(cleaned.get("input_files") or {})})
        known = launch.known_variables(cleaned.get("env") or {}, hyperparameters, inputs)
        network = launch.known_variables((), hyperparameters, inputs)  # what an environment value may name
        for name in cleaned.get("env") or {}:
            if (reason := launch.refused_env_name(name, hyperparameters, inputs)) and "env" not in self.errors:
                self.add_error("env", reason)
        checks = (("args", cleaned.get("args") or [], known), ("command", [command], known), ("env", (cleaned.get("env") or {}).values(), network))
        for field, texts, names in checks:
            try:
                spec_text.check_variables(texts, names)
            except spec_text.SpecError as error:
                if field not in self.errors:
                    self.add_error(field, str(error))

    def _clean_stopping(self, cleaned):
        metric, patience = cleaned.get("early_stop_metric") or "", cleaned.get("early_stop_patience")
        metric = metric.strip()
        cleaned["early_stop_metric"] = metric
        if metric and not METRIC_NAME.match(metric):
            self.add_error("early_stop_metric", "A metric name is letters, digits and _ . / - (as the job logs it).")
        if metric and patience is None and "early_stop_patience" not in self.errors:
            self.add_error("early_stop_patience", "Early stopping needs a patience: how many evaluations without improvement.")
        if patience is not None and not metric and "early_stop_metric" not in self.errors:
            self.add_error("early_stop_metric", "Name the metric to watch for early stopping.")
        if cleaned.get("keep_checkpoints") is None:
            cleaned["keep_checkpoints"] = 3
        if cleaned.get("max_restarts") is None:
            cleaned["max_restarts"] = 3
        if cleaned.get("idle_minutes") is None:
            cleaned["idle_minutes"] = 30
        if cleaned.get("stop_if_idle") and not cleaned["idle_minutes"] and "idle_minutes" not in self.errors:
            self.add_error("idle_minutes", "Stop if idle needs an idle time of at least 1 minute.")
        cleaned["early_stop_mode"] = cleaned.get("early_stop_mode") or "min"

    def submit(self, request):
        """save() and the submission's audit records (job.submit; job.env, the names of the
        variables it sets) in one transaction: one commit, not two, and no job without its
        record."""
        with transaction.atomic():
            job = self.save(request.user)
            audit.record(request, "job.submit", job)
            audit.job_env(request, job)
        return job

    @transaction.atomic(savepoint=False)  # in submit()'s transaction, no savepoint of its own
    def save(self, user):
        cleaned = self.cleaned_data
        request = self.meter_request()
        job = Job(
            team=self.team,
            created_by=user,
            name=cleaned["name"],
            experiment=cleaned.get("experiment") or "",  # blank: the name's (Job.save)
            kind=cleaned["kind"],
            entrypoint=cleaned["entrypoint"],
            command=cleaned.get("command") or "",
            args=cleaned["args"],
            hyperparameters=cleaned.get("hyperparameters") or {},
            config=cleaned["config"],
            env=cleaned["env"],
            workdir=cleaned.get("workdir") or "",
            processes=cleaned.get("processes"),
            precision=cleaned.get("precision") or "",
            packages=cleaned.get("packages") or "",
            train_version=cleaned.get("train_version"),
            heldout_version=cleaned.get("heldout_version"),
            gpus=cleaned["gpus"],
            gpu_type=cleaned.get("gpu_type") or "",
            span_hours=request.span_hours,
            ceiling_amount=request.ceiling_amount,
            ceiling_gpu_hours=request.ceiling_gpu_hours,
            not_before=cleaned.get("not_before"),
            deadline=cleaned.get("deadline"),
            preemptible=bool(cleaned.get("preemptible")),
            keep_checkpoints=cleaned["keep_checkpoints"],
            max_restarts=cleaned["max_restarts"],
            early_stop_metric=cleaned["early_stop_metric"],
            early_stop_mode=cleaned["early_stop_mode"],
            early_stop_patience=cleaned.get("early_stop_patience") if cleaned["early_stop_metric"] else None,
            stop_on_nan=bool(cleaned.get("stop_on_nan")),
            network=bool(cleaned.get("network")),
            idle_minutes=cleaned["idle_minutes"],
            stop_if_idle=bool(cleaned.get("stop_if_idle")),
            last_seq=1,  # its first event, below
        )
        job.fill_derived()
        # Inserted and read back as stored (values normalised: decimals to their places, JSON
        # as it comes back) in one statement, its SQL made once; its team and user are the
        # form's, already on it.
        INSERT_JOB(job)
        submitted = JobEvent(kind="state", at=job.created_at, data={"state": job.state, "from": None, "reason": "submitted"})
        JobEvent.store_first(job, [submitted])
        inputs = JobInput.objects.bulk_create(
            [JobInput(job=job, name=name, version=version, label=version.label) for name, version in (cleaned.get("inputs") or {}).items()]
        )
        uploads = [*([cleaned["kept_code"]] if cleaned.get("kept_code") else []), *cleaned.get("kept_data", []), *cleaned.get("kept_heldout", [])]
        uploads += cleaned.get("kept_inputs") or []
        uploads += cleaned.get("kept_model") or []
        Upload.objects.filter(pk__in=[u.pk for u in uploads]).update(job=job)
        for upload in uploads:
            upload.job = job
        models = [lineage.pin_model(job, label, files, source_job=source, description=description) for label, files, source, description in self.models]
        if cleaned.get("smoke_first"):
            lineage.smoke_run(job)
        # What was made with the job, as reading it back would find it (jobs.serializers.as_made).
        self.made = {"inputs": inputs, "uploads": uploads, "models": models, "events": [submitted]}
        return job


def _known(team, objects):
    """{field: {id: object}} of the objects a JobForm's fields may take unread: those its
    querysets would find. An upload of the team not yet with a job (the kept field of its
    role); a ready version of one of the team's datasets, and its dataset (the train and
    held-out fields)."""
    found = {}
    for obj in objects:
        if isinstance(obj, Upload) and obj.team_id == team.pk and obj.job_id is None and obj.role in KEPT_FIELDS:
            found.setdefault(KEPT_FIELDS[obj.role], {})[str(obj.pk)] = obj
        elif isinstance(obj, DatasetVersion) and obj.state == DatasetVersion.READY and obj.dataset.team_id == team.pk:
            for field in ("train_version", "heldout_version"):
                found.setdefault(field, {})[str(obj.pk)] = obj
            for field in ("train_dataset", "heldout_dataset"):
                found.setdefault(field, {})[str(obj.dataset_id)] = obj.dataset
    return found


def is_uuid(value):
    try:
        uuid.UUID(str(value))
    except ValueError:
        return False
    return True
