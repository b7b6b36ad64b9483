"""Reading spec files: the flat fields, the local files, and the line of each (no database)."""

import pytest

from jobs import specfile

pytestmark = pytest.mark.nodb

TEXT = """\
name: nightly
kind: finetune
work:
  recipe: classifier
  config:
    lr: 0.01
data:
  start_job: digits-classifier
  base_model:
    - model.safetensors
    - recipe.json
  train_files: new/
request:
  gpus: 2
  ceiling: 5
  by: morning
output:
  early_stop: val_loss
"""


def test_fields_files_and_lines():
    spec = specfile.read(TEXT, "nightly.yaml")
    assert spec.fields == {
        "name": "nightly",
        "kind": "finetune",
        "recipe": "classifier",
        "config": {"lr": 0.01},
        "start_job": "digits-classifier",
        "gpus": 2,
        "ceiling": 5,
        "by": "morning",
        "early_stop_metric": "val_loss",
    }
    assert spec.lines["gpus"] == 14 and spec.lines["early_stop_metric"] == 18 and spec.key_lines[("work", "config", "lr")] == 6
    assert spec.files == {"base_model": [("model.safetensors", 10), ("recipe.json", 11)], "data": [("new/", 12)]}
    assert spec.message("gpus", "Too many.") == "nightly.yaml line 14: request.gpus: Too many."
    assert spec.message("data", "Missing.") == "nightly.yaml line 12: data.train_files: Missing."


def test_the_flat_api_layout_and_json_are_read_too():
    spec = specfile.read('{\n  "gpus": 1,\n  "train_dataset": "digits",\n  "early_stop_metric": "loss"\n}', "job.json")
    assert spec.fields == {"gpus": 1, "train_dataset": "digits", "early_stop_metric": "loss"} and spec.lines["train_dataset"] == 3


def test_yaml_dates_come_back_as_iso_text():
    spec = specfile.read("request:\n  deadline: 2026-12-04T08:00:00+01:00\n  not_before: 2026-12-03\n")
    assert spec.fields == {"deadline": "2026-12-04T08:00:00+01:00", "not_before": "2026-12-03"}


@pytest.mark.parametrize(
    "text,expected",
    [
        ("work:\n  entrypoint: a.py\n  cod: a.py\n", "job.yaml line 3: unknown field 'cod' in 'work'; did you mean 'code'?"),
        ("nme: x\n", "job.yaml line 1: unknown field 'nme' in the spec; did you mean 'name'?"),
        ("request: 4\n", "job.yaml line 1: 'request' must be a mapping of fields, not a number"),
        ("data:\n  train_files: {a: 1}\n", "job.yaml line 2: data.train_files must be a file's path or a list of paths, not a mapping"),
        ("work:\n  code: [a.py, b.py]\n", "job.yaml line 2: work.code is one file"),
        ("output:\n  early_stop: {metric: a, when: b}\n", "job.yaml line 2: unknown field 'when' in 'output.early_stop'"),
        ("request:\n  gpus: [1\n  span_hours: 2\n", "job.yaml line 3: not valid YAML or JSON"),
        ('{"gpus": 1,\n "span_hours": }', "job.yaml line 2: not valid JSON"),
        ("", "job.yaml: the spec is empty"),
        ("- a\n- b\n", "job.yaml line 1: the spec must be a mapping"),
        (b"gpus: \xff\n", "job.yaml: the spec is not UTF-8 text"),
        ("a" * (specfile.MAX_BYTES + 1), "larger than 256 KB"),
        ('{"name": "\\u0000"}', "job.yaml line 1: name contains a NUL character"),
        ('{"\\ud922x": 1}', "job.yaml: the spec contains text that is not valid Unicode"),
        ("name: \x03\n", "job.yaml: not valid YAML or JSON: unacceptable character"),
        ("request:\n  deadline: 2026-02-30\n", "job.yaml: not valid YAML: day is out of range"),
    ],
)
def test_a_bad_file_names_its_line(text, expected):
    with pytest.raises(specfile.SpecFileError) as raised:
        specfile.read(text, "job.yaml")
    assert expected in str(raised.value)


def test_every_problem_is_named_at_once():
    with pytest.raises(specfile.SpecFileError) as raised:
        specfile.read("work:\n  cod: a\nrequest:\n  gpu: 1\n", "job.yaml")
    assert [line for line, _, _ in raised.value.problems] == [2, 4]


def test_a_dumped_spec_reads_back_the_same():
    spec = {
        "name": "n",
        "kind": "train",
        "work": {"code": "t.py", "entrypoint": "t.py", "config": {"lr": 0.1}},
        "request": {"gpus": 1, "span_hours": 1.5},
        "output": {"early_stop": {"metric": "loss", "mode": "max", "patience": 2}},
    }
    text = specfile.dump(spec)
    assert text.startswith("# An E31 Network job spec")
    again = specfile.read(text, "n.yaml")
    assert again.fields["span_hours"] == 1.5 and again.fields["early_stop_mode"] == "max" and again.files["code"][0][0] == "t.py"


def test_work_packages_are_read_as_a_list_with_their_line():
    spec = specfile.read("work:\n  code: train.py\n  packages:\n    - numpy>=1.26\n    - einops==0.8.0\n", "job.yaml")
    assert spec.fields["packages"] == ["numpy>=1.26", "einops==0.8.0"] and spec.lines["packages"] == 3
    assert spec.message("packages", "line 2 (-e .): refused") == "job.yaml line 3: work.packages: line 2 (-e .): refused"


def test_a_dumped_spec_with_packages_reads_back_the_same():
    spec = {
        "name": "n",
        "kind": "train",
        "work": {"code": "t.py", "entrypoint": "t.py", "packages": ["numpy>=1.26", "einops==0.8.0"]},
        "request": {"gpus": 1, "span_hours": 1},
    }
    again = specfile.read(specfile.dump(spec), "n.yaml")
    assert again.fields["packages"] == ["numpy>=1.26", "einops==0.8.0"]


def test_the_flat_layout_takes_packages_too():
    spec = specfile.read('{"gpus": 1, "packages": ["numpy"]}', "job.json")
    assert spec.fields == {"gpus": 1, "packages": ["numpy"]}


def test_the_precision_is_part_of_the_work_and_reads_back_from_a_dump():
    spec = specfile.read("work:\n  recipe: charlm\n  precision: bf16\nrequest: {gpus: 1, span_hours: 1}\n", "job.yaml")
    assert spec.fields["precision"] == "bf16" and spec.lines["precision"] == 3
    assert spec.message("precision", "Not one.") == "job.yaml line 3: work.precision: Not one."
    dumped = {"name": "n", "kind": "train", "work": {"recipe": "charlm", "precision": "fp16"}, "request": {"gpus": 1, "span_hours": 1}}
    assert specfile.read(specfile.dump(dumped), "n.yaml").fields["precision"] == "fp16"
    assert specfile.read('{"gpus": 1, "precision": "fp32"}', "job.json").fields == {"gpus": 1, "precision": "fp32"}


# libyaml reads specs where PyYAML has it (jobs.specfile._loader), as PyYAML's own parser did --

READ_BOTH_WAYS = {
    "a spec": "name: tune\nwork:\n  code: train.py\n  args: [--epochs, '3']\n  config: {lr: 0.01, layers: [1, 2]}\nrequest:\n  gpus: 2\n",
    "dates and numbers": "when: 2026-12-06\nat: 2026-12-06T08:00:00Z\nn: 0x1f\nf: 1e3\nyes: yes\nnothing: ~\n",
    "an anchor": "a: &x 1\nb: *x\n",
    "an alias first": "a:\n  - 1\n  - *x\n",
    "nested too deeply": "".join("  " * i + "k:\n" for i in range(40)) + "  " * 40 + "v: 1\n",
    "flow nested too deeply": "a: " + "[" * 40 + "]" * 40 + "\n",
    "flow nested past libyaml's own limit": "a: " + "[" * 2000 + "]" * 2000 + "\n",
    "a syntax error": "name: x\nwork: [a\nrequest:\n  gpus: 1\n",
    "a tab": "name: x\n\twork: 1\n",
    "a control character": "name: \x03\n",
}


def _read(text):
    try:
        node, value = specfile._parse_yaml(text)
    except specfile.ParseError as error:
        return "refused", error.line, str(error).split(":")[0] if error.line is None else None
    return value, [(key.value, key.start_mark.line) for key, _ in node.value]


@pytest.mark.nodb
@pytest.mark.parametrize("text", READ_BOTH_WAYS.values(), ids=READ_BOTH_WAYS.keys())
def test_libyaml_reads_and_refuses_specs_as_pyyamls_parser_does(text, monkeypatch):
    import yaml

    if specfile._SafeLoader is yaml.SafeLoader:
        pytest.skip("PyYAML without libyaml")
    fast = _read(text)
    monkeypatch.setattr(specfile, "_SafeLoader", yaml.SafeLoader)
    assert fast == _read(text)  # the values and each key's line; a refusal's line


@pytest.mark.nodb
def test_a_spec_is_read_by_libyaml_where_pyyaml_has_it():
    import yaml

    loader = specfile._loader("name: x\n")
    try:
        assert isinstance(loader, yaml.CSafeLoader) == yaml.__with_libyaml__
    finally:
        loader.dispose()
