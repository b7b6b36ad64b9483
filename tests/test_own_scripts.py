"""Scripts written elsewhere run unchanged: their hyperparameters reach argparse as --name value,
$E31_DATA_DIR and friends in the arguments (and in the environment's values) are the job's
folders, a job starts in its entrypoint's own folder (or the workdir it names), may set any
variable the network does not (SageMaker's SM_CHANNEL_TRAINING), may be one shell line, and
gets its CPU slots as threads in one process unless it asks for more processes."""

import io
import json
import zipfile

import pytest
from django.urls import reverse

from catalog import datasets
from core.storage import get_storage
from jobs import launch, spec_text
from jobs.models import Job, Upload
from tests.conftest import upload
from tests.test_staging import run

# Pure: the launch decisions -------------------------------------------------------------------


@pytest.mark.nodb
def test_variables_are_expanded_as_a_shell_would_and_nothing_more():
    env = {"E31_DATA_DIR": "/job/data", "N": "3"}
    assert launch.expand("--data=$E31_DATA_DIR/train", env) == "--data=/job/data/train"
    assert launch.expand("${N}x $$N costs $ 5 $", env) == "3x $N costs $ 5 $"
    assert launch.expand("`rm -rf /` $(id) *", env) == "`rm -rf /` $(id) *"  # no command substitution, no globbing
    with pytest.raises(launch.UnknownVariable, match=r"\$NOPE is not a variable"):
        launch.expand("$NOPE", env)
    assert launch.variables_in("$A ${B} $$C") == ["A", "B"]


@pytest.mark.nodb
def test_hyperparameters_become_arguments_as_sagemaker_passes_them():
    args = launch.hyperparameter_args({"lr": 0.01, "epochs": 3, "model-name": "tiny net", "shuffle": True, "layers": [64, 32]})
    assert args == ["--epochs", "3", "--layers", "[64, 32]", "--lr", "0.01", "--model-name", "tiny net", "--shuffle", "True"]


@pytest.mark.nodb
@pytest.mark.parametrize(
    "entrypoint,workdir,expected",
    [("train.py", "", ""), ("src/train.py", "", "src"), ("src/train.py", ".", ""), ("src/train.py", "data/../tools", "tools"), ("recipe:charlm", "", "")],
)
def test_the_working_folder_is_the_entrypoint_s_own_unless_named(entrypoint, workdir, expected):
    assert launch.working_folder(entrypoint, workdir) == expected


@pytest.mark.nodb
@pytest.mark.parametrize("workdir", ["../up", "/etc", "a/../../b", "a\\b"])
def test_a_working_folder_outside_the_code_is_refused(workdir):
    with pytest.raises(ValueError):
        launch.working_folder("train.py", workdir)


@pytest.mark.nodb
def test_only_what_the_network_sets_is_refused_and_the_refusal_says_what_it_is():
    # SageMaker's channels a script expects but the network does not set are the job's to set.
    assert spec_text.parse_env("SM_CHANNEL_TRAINING=$E31_DATA_DIR/train\nSM_CHANNEL_TESTING=$E31_DATA_DIR/heldout") == {
        "SM_CHANNEL_TRAINING": "$E31_DATA_DIR/train",
        "SM_CHANNEL_TESTING": "$E31_DATA_DIR/heldout",
    }
    with pytest.raises(spec_text.SpecError, match=r"SM_CHANNEL_TRAIN is set by the network \(to the train channel's folder"):
        spec_text.parse_env("SM_CHANNEL_TRAIN=/x")
    with pytest.raises(spec_text.SpecError, match=r"SM_NUM_GPUS is set by the network \(to the number of GPUs"):
        spec_text.parse_env("SM_NUM_GPUS=8")
    with pytest.raises(spec_text.SpecError, match="SM_HP_LR is set by the network"):
        spec_text.parse_env("SM_HP_LR=1", hyperparameters={"lr": 0.1})
    assert spec_text.parse_env("SM_HP_LR=1") == {"SM_HP_LR": "1"}  # no such hyperparameter
    with pytest.raises(spec_text.SpecError, match="E31_ANYTHING is kept for the network"):
        spec_text.parse_env("E31_ANYTHING=1")


@pytest.mark.nodb
def test_processes_one_per_gpu_one_for_cpu_slots_or_as_asked():
    assert launch.process_count(None, 4, "NVIDIA H100") == 4
    assert launch.process_count(None, 4, "cpu") == 1
    assert launch.process_count(2, 4, "cpu") == 2
    assert not launch.uses_torchrun(1) and launch.uses_torchrun(2)


@pytest.mark.nodb
def test_a_command_is_one_bash_line(tmp_path):
    assert launch.command_for("", [], shell="echo $HOME && ls") == ["/bin/bash", "-c", "echo $HOME && ls"]


# Through the API --------------------------------------------------------------------------------


@pytest.fixture
def api(client, token, rate):
    client.defaults["HTTP_AUTHORIZATION"] = f"Token {token}"
    return client


def submit(api, spec_object, code=b"print(1)\n"):
    code_file = io.BytesIO(code)
    code_file.name = "train.py"
    return api.post(reverse("api:jobs"), {"spec": json.dumps({"train_dataset": "numbers", **spec_object}), "code": code_file})


@pytest.mark.django_db
def test_the_api_takes_hyperparameters_variables_a_workdir_and_processes(api, dataset):
    response = submit(
        api,
        {
            "gpus": 2,
            "span_hours": 1,
            "entrypoint": "train.py",
            "args": ["--data", "$E31_DATA_DIR/train"],
            "hyperparameters": {"epochs": 3, "lr": 0.5},
            "env": {"SM_CHANNEL_TRAINING": "$E31_DATA_DIR/train"},
            "processes": 2,
            "workdir": ".",
        },
    )
    assert response.status_code == 201, response.json()
    job = Job.objects.get()
    assert (job.hyperparameters, job.processes, job.env) == ({"epochs": 3, "lr": 0.5}, 2, {"SM_CHANNEL_TRAINING": "$E31_DATA_DIR/train"})
    body = api.get(reverse("api:job", args=[job.pk])).json()
    assert body["hyperparameters"] == {"epochs": 3, "lr": 0.5} and body["processes"] == 2
    exported = api.get(reverse("api:job-spec", args=[job.pk]) + "?format=json").json()
    assert exported["work"]["hyperparameters"] == {"epochs": 3, "lr": 0.5} and exported["request"]["processes"] == 2


@pytest.mark.django_db
@pytest.mark.parametrize(
    "fields,field,words",
    [
        ({"args": ["--data", "$DATA/train"]}, "args", "$DATA is not a variable of the job's environment"),
        ({"env": {"X": "$NOPE"}}, "env", "$NOPE is not a variable"),
        ({"hyperparameters": {"layers": {"a": 1}}}, "hyperparameters", "a value is text, a number or true/false"),
        ({"hyperparameters": {"bad name": 1}}, "hyperparameters", "a name is letters, digits"),
        ({"workdir": "../elsewhere"}, "workdir", "outside the code's folder"),
        ({"env": {"SM_CHANNEL_TRAIN": "/x"}}, "env", "set by the network (to the train channel's folder"),
        ({"command": "python train.py", "args": ["-v"]}, "args", "With a command, write the arguments in it"),
    ],
)
def test_bad_launch_fields_are_a_400_with_the_reason(api, dataset, fields, field, words):
    response = submit(api, {"gpus": 1, "span_hours": 1, "entrypoint": "train.py", **fields})
    assert response.status_code == 400
    assert any(words in message for message in response.json()["errors"].get(field, [])), response.json()


@pytest.mark.django_db
def test_the_args_may_name_the_job_s_own_variables(api, dataset):
    response = submit(api, {"gpus": 1, "span_hours": 1, "entrypoint": "train.py", "args": ["--name", "${RUN}"], "env": {"RUN": "a"}})
    assert response.status_code == 201, response.json()


# Real runs --------------------------------------------------------------------------------------

# A script as it was written for somewhere else: flags for its data and its output, its
# hyperparameters from argparse, and it copies its own file (by its name) next to the weights.
ELSEWHERE = b"""
import argparse, os, shutil, sys
sys.path.insert(0, os.getcwd())
from helpers import total
parser = argparse.ArgumentParser()
parser.add_argument("--data", required=True)
parser.add_argument("--save", required=True)
parser.add_argument("--epochs", type=int, default=1)
parser.add_argument("--lr", type=float, default=0.1)
args = parser.parse_args()
numbers = [int(x) for x in open(os.path.join(args.data, "numbers.txt")).read().split()]
open(args.save, "w").write(f"{total(numbers) * args.epochs * args.lr}")
shutil.copy("train_x.py", os.path.dirname(args.save))
print("cwd", os.path.relpath(os.getcwd(), os.path.join(os.environ["HOME"], "code")))
print("threads", os.environ["OMP_NUM_THREADS"], "world", os.environ.get("WORLD_SIZE", "-"))
print("channel", os.path.relpath(os.environ["SM_CHANNEL_TRAINING"], os.environ["E31_DATA_DIR"]))
"""


def archive_job(alice, team_a, entrypoint, files, **fields):
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zipped:
        for name, content in files.items():
            zipped.writestr(name, content)
    job = Job.objects.create(team=team_a, created_by=alice, name="elsewhere", entrypoint=entrypoint, span_hours=1, **fields)
    code = upload(team_a, alice, Upload.CODE, "work.zip", buffer.getvalue())
    code.job = job
    code.save()
    job.record("state", data={"state": "queued", "from": None, "reason": "submitted"})
    return job


def artifact(job, name):
    found = job.artifacts.get(name=name)
    with get_storage().open(found.key) as stream:
        return stream.read()


def logs(job):
    return [e.text for e in job.events.filter(kind="log").order_by("seq")]


@pytest.mark.runs_jobs
@pytest.mark.timeout(180)
@pytest.mark.django_db(transaction=True)
def test_a_script_from_elsewhere_runs_unchanged(make_runner, alice, rate, team_a):
    runner = make_runner(devices=2)
    dataset = datasets.create_dataset(team_a, "numbers", {"numbers.txt": b"1 2 3 4\n"})
    job = archive_job(
        alice,
        team_a,
        "src/train_x.py",
        {"src/train_x.py": ELSEWHERE, "src/helpers.py": b"def total(xs):\n    return sum(xs)\n"},
        args=["--data", "$E31_DATA_DIR/train", "--save", "${E31_OUTPUT_DIR}/model.txt"],
        hyperparameters={"epochs": 3, "lr": 0.5},
        env={"SM_CHANNEL_TRAINING": "$E31_DATA_DIR/train"},
        gpus=2,
        train_version=dataset.latest_version(),
    )
    job = run([runner], job)
    assert job.state == "succeeded", (job.reason, logs(job))
    assert artifact(job, "model.txt") == b"15.0"  # (1+2+3+4) * 3 epochs * 0.5: the hyperparameters reached argparse
    assert artifact(job, "train_x.py") == ELSEWHERE  # it found its own file where it started
    lines = logs(job)
    assert "cwd src" in lines and "channel train" in lines
    assert "threads 2 world -" in lines  # one process, with both CPU slots as threads


@pytest.mark.runs_jobs
@pytest.mark.timeout(180)
@pytest.mark.django_db(transaction=True)
def test_two_processes_when_asked_and_a_workdir_that_is_not_missing(make_runner, alice, rate, team_a):
    runner = make_runner(devices=2)
    script = b"import os\nprint('cwd', os.path.basename(os.getcwd()), 'threads', os.environ['OMP_NUM_THREADS'], 'world', os.environ['WORLD_SIZE'])\n"
    job = run([runner], archive_job(alice, team_a, "src/run.py", {"src/run.py": script, "tools/x.txt": b""}, gpus=2, processes=2, workdir="tools"))
    assert job.state == "succeeded", (job.reason, logs(job))
    assert [line for line in logs(job) if "cwd" in line] == ["cwd tools threads 1 world 2"] * 2  # a line from each rank
    missing = run([runner], archive_job(alice, team_a, "run.py", {"run.py": script}, gpus=1, workdir="nowhere"))
    assert missing.state == "failed" and "the working folder 'nowhere' is not a folder of the job's code" in missing.reason


@pytest.mark.runs_jobs
@pytest.mark.timeout(180)
@pytest.mark.django_db(transaction=True)
def test_a_command_runs_as_one_shell_line_without_code(make_runner, alice, rate, team_a):
    runner = make_runner()
    job = Job.objects.create(
        team=team_a,
        created_by=alice,
        name="shell",
        entrypoint="",
        command='echo "made by $E31_JOB_ID" > $E31_OUTPUT_DIR/note.txt && echo done',
        span_hours=1,
        gpus=1,
    )
    job.record("state", data={"state": "queued", "from": None, "reason": "submitted"})
    job = run([runner], job)
    assert job.state == "succeeded", (job.reason, logs(job))
    assert artifact(job, "note.txt") == f"made by {job.pk}\n".encode() and "done" in logs(job)


SPEC_FILE = """\
name: from-elsewhere
work:
  code: train.py
  args: [--data, $E31_DATA_DIR/train, --save, $E31_OUTPUT_DIR/model.pt]
  hyperparameters: {epochs: 3, lr: 0.01}
  env: {SM_CHANNEL_TRAINING: $E31_DATA_DIR/train}
  workdir: .
data:
  train: numbers
request:
  gpus: 2
  processes: 2
  span_hours: 1
"""


@pytest.mark.django_db
def test_a_spec_file_names_them_too_and_gets_them_back(api, dataset):
    code = io.BytesIO(b"print(1)\n")
    code.name = "train.py"
    response = api.post(reverse("api:jobs"), {"spec": SPEC_FILE, "spec_name": "job.yaml", "code": code})
    assert response.status_code == 201, response.json()
    job = Job.objects.get()
    assert job.args == ["--data", "$E31_DATA_DIR/train", "--save", "$E31_OUTPUT_DIR/model.pt"]
    assert (job.hyperparameters, job.processes, job.workdir) == ({"epochs": 3, "lr": 0.01}, 2, "")
    work = api.get(reverse("api:job-spec", args=[job.pk]) + "?format=json").json()["work"]
    assert work["hyperparameters"] == {"epochs": 3, "lr": 0.01} and work["env"] == {"SM_CHANNEL_TRAINING": "$E31_DATA_DIR/train"}
    code = io.BytesIO(b"print(1)\n")
    code.name = "train.py"
    text = SPEC_FILE.replace("$E31_DATA_DIR/train,", "$DATA/train,")
    refused = api.post(reverse("api:jobs"), {"spec": text, "spec_name": "job.yaml", "code": code})
    assert refused.status_code == 400 and "job.yaml line 4: work.args: $DATA is not a variable" in str(refused.json()), refused.json()


@pytest.mark.django_db
def test_the_job_page_shows_the_command_hyperparameters_and_folder(client, alice, rate):
    job = Job.objects.create(
        team=alice.membership.team,
        created_by=alice,
        name="shown",
        entrypoint="",
        command="python -m http.server",
        hyperparameters={"lr": 0.5},
        workdir="src",
        processes=2,
        span_hours=1,
        gpus=2,
    )
    client.force_login(alice)
    page = client.get(reverse("jobs:detail", args=[job.pk])).content.decode()
    assert "python -m http.server" in page and "--lr 0.5" in page and ">src<" in page and "2 per node" in page
