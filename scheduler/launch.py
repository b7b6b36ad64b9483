"""How a job process is set up: its folders, its environment and its command.

The environment is built from scratch: nothing of the runner's own environment (database URL,
Redis URL, storage credentials, the Django secret) reaches the job.
"""

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

RESERVED_ENV = ("E31_", "SM_", "CUDA_VISIBLE_DEVICES", "PATH", "HOME", "TMPDIR")


@dataclass(frozen=True)
class JobDirs:
    root: Path

    @property
    def code(self):
        return self.root / "code"

    @property
    def data(self):
        return self.root / "data"

    @property
    def output(self):
        return self.root / "output"

    @property
    def model(self):
        """The models the job starts from or scores, one folder each: model/start/ for a
        fine-tuning, model/<label>/ for an evaluation."""
        return self.root / "model"

    @property
    def checkpoints(self):
        return self.root / "checkpoints"

    @property
    def tmp(self):
        return self.root / "tmp"

    @property
    def control(self):
        """Where the job and its runner talk: metrics out, the stop notice in."""
        return self.root / ".e31"

    @property
    def metrics(self):
        return self.control / "metrics.jsonl"

    @property
    def stop_file(self):
        return self.control / "stop"

    @property
    def output_data(self):
        """SageMaker's SM_OUTPUT_DATA_DIR: other outputs, kept beside the model under data/."""
        return self.output / "data"

    @property
    def config(self):
        return self.root / "config.json"

    def create(self):
        for path in (
            self.code, self.data / "train", self.data / "heldout", self.model, self.output, self.output_data, self.checkpoints, self.tmp,
            self.control,
        ):
            path.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o700)


def build_environment(*, job_id, dirs, devices, device_type, declared, config=None, restart=0, python=sys.executable):
    """The job's whole environment: PATH, HOME, the E31_ variables, SageMaker's names for the
    same places, and what the job declares."""
    env = {
        "PATH": os.pathsep.join([str(Path(python).parent), "/usr/local/bin", "/usr/bin", "/bin"]),
        "HOME": str(dirs.root),
        "TMPDIR": str(dirs.tmp),
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONUNBUFFERED": "1",
        "E31_JOB_ID": str(job_id),
        "E31_DATA_DIR": str(dirs.data),
        "E31_MODEL_DIR": str(dirs.model),
        "E31_OUTPUT_DIR": str(dirs.output),
        "E31_CHECKPOINT_DIR": str(dirs.checkpoints),
        "E31_CONFIG": str(dirs.config),
        "E31_NUM_DEVICES": str(len(devices)),
        "E31_METRICS_FILE": str(dirs.metrics),
        "E31_STOP_FILE": str(dirs.stop_file),
        "E31_RESTART": str(restart),
        **sagemaker_environment(dirs, devices, device_type, config or {}),
    }
    for name, value in declared.items():
        if not name.startswith(RESERVED_ENV):
            env[name] = str(value)
    if device_type == "cpu":
        # CPU slots: the job gets as many threads as it holds slots, so it does not crowd its neighbours.
        env.setdefault("OMP_NUM_THREADS", str(len(devices)))
        env["CUDA_VISIBLE_DEVICES"] = ""
    else:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices)
    return env


def sagemaker_environment(dirs, devices, device_type, config):
    """The variables of SageMaker's training toolkit, pointing at the job's places, so that a
    script written for SageMaker runs unchanged."""
    channels = {"train": dirs.data / "train", "heldout": dirs.data / "heldout", "model": dirs.model}
    hosts = ["algo-1"]
    env = {
        "SM_MODEL_DIR": str(dirs.output),
        "SM_OUTPUT_DIR": str(dirs.output),
        "SM_OUTPUT_DATA_DIR": str(dirs.output_data),
        "SM_INPUT_DIR": str(dirs.data),
        "SM_CHANNELS": json.dumps(sorted(channels)),
        "SM_NUM_GPUS": "0" if device_type == "cpu" else str(len(devices)),
        "SM_NUM_CPUS": str(len(devices) if device_type == "cpu" else os.cpu_count() or 1),
        "SM_HPS": json.dumps(config),
        "SM_CURRENT_HOST": hosts[0],
        "SM_HOSTS": json.dumps(hosts),
    }
    for name, path in channels.items():
        env[f"SM_CHANNEL_{name.upper()}"] = str(path)
    for name, value in config.items():
        key = "".join(c if c.isalnum() else "_" for c in str(name)).upper()
        env[f"SM_HP_{key}"] = value if isinstance(value, str) else json.dumps(value)
    env["SM_TRAINING_ENV"] = json.dumps(
        {
            "model_dir": env["SM_MODEL_DIR"], "output_data_dir": env["SM_OUTPUT_DATA_DIR"],
            "channel_input_dirs": {n: str(p) for n, p in channels.items()}, "hyperparameters": config,
            "num_gpus": int(env["SM_NUM_GPUS"]), "num_cpus": int(env["SM_NUM_CPUS"]),
            "current_host": hosts[0], "hosts": hosts,
        }
    )
    return env


@dataclass(frozen=True)
class Gang:
    """A run across nodes, as one node's torchrun sees it: how many nodes, where node 0's
    runner holds the c10d rendezvous (host:port), the run's rendezvous id, and whether this
    node hosts the rendezvous store."""

    nodes: int
    endpoint: str
    run_id: str
    is_host: bool
    rank: int = 0  # this node's rank in the gang


# torchrun marks each line a worker prints with the worker's global rank.
RANK_PREFIX_TEMPLATE = "[rank${rank}]:"


def uses_torchrun(devices, gang=None):
    """Jobs on several devices, or across nodes, run one process per device under torchrun."""
    return devices > 1 or gang is not None


def command_for(entrypoint, args, python=sys.executable, devices=1, gang=None, log_dir=None):
    """The job's command: the script, the archive's entrypoint or the built-in recipe, run once;
    or, on several devices or nodes, under torchrun, one process per device (a script that works
    under torchrun works here unchanged), each worker killed by the kernel if torchrun dies."""
    if entrypoint.startswith("recipe:"):
        from e31.recipes import RECIPES

        name = entrypoint.removeprefix("recipe:")
        if name not in RECIPES:
            raise ValueError(f"no built-in recipe is named {name!r}")
        target = [python, "-u", "-m", f"e31.recipes.{name}", *args]
    elif entrypoint.endswith(".py"):
        target = [python, "-u", entrypoint, *args]
    elif entrypoint.endswith(".sh"):
        target = ["/bin/bash", entrypoint, *args]
    else:
        raise ValueError(f"cannot run entrypoint {entrypoint!r}: expected a .py or .sh file, or a built-in recipe")
    if not uses_torchrun(devices, gang):
        return target
    command = [python, "-u", "-m", "torch.distributed.run", f"--nproc-per-node={devices}", "--max-restarts=0", "--tee=3"]
    if log_dir is not None:
        command.append(f"--log-dir={log_dir}")
    if gang is None:
        command.append("--standalone")
    else:
        command += [
            f"--nnodes={gang.nodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={gang.endpoint}", f"--rdzv-id={gang.run_id}",
            f"--rdzv-conf=is_host={1 if gang.is_host else 0}",
        ]
    command = [*command, "--no-python", python, "-S", "-c", WORKER_SHIM, *target]
    if gang is not None:
        command = [python, "-S", "-c", GANG_SHIM, str(gang.rank), *command]
    return command


# torchrun starts each worker in a session of its own, out of reach of the signals sent to the
# job's process group: each one asks the kernel to kill it when torchrun dies (SIGKILLed at the
# end of a grace period, or with its runner), then becomes the worker.
WORKER_SHIM = (
    "import ctypes,os,sys\n"
    "p=os.getppid()\n"
    "try:\n ctypes.CDLL(None,use_errno=True).prctl(1,9)\n"
    "except Exception:\n pass\n"
    "if os.getppid()!=p:\n os._exit(137)\n"
    "os.execv(sys.argv[1],sys.argv[1:])\n"
)


# torchrun's c10d rendezvous tells its nodes apart by host name and pid. Each node's torchrun
# starts in a PID namespace of its own, where it would always be pid 2: two nodes of a gang on one
# machine (two runners there) would look like one node and wait for each other forever. This
# starts torchrun as the sandbox's (3 + node rank)-th process, and waits for it. It passes on
# torchrun's exit, and takes no part in signals (a group's SIGTERM reaches torchrun directly).
GANG_SHIM = (
    "import os,signal,sys\n"
    "signal.signal(signal.SIGTERM,signal.SIG_IGN)\n"
    "signal.signal(signal.SIGINT,signal.SIG_IGN)\n"
    "for _ in range(int(sys.argv[1])):\n"
    " p=os.fork()\n"
    " if p==0: os._exit(0)\n"
    " os.waitpid(p,0)\n"
    "p=os.fork()\n"
    "if p==0:\n"
    " signal.signal(signal.SIGTERM,signal.SIG_DFL)\n"
    " signal.signal(signal.SIGINT,signal.SIG_DFL)\n"
    " os.execv(sys.argv[2],sys.argv[2:])\n"
    "s=os.waitstatus_to_exitcode(os.waitpid(p,0)[1])\n"
    "os._exit(128-s if s<0 else s)\n"
)


MAX_ARTIFACT_NAME = 500


def artifact_name_problem(name):
    """Why an output file cannot be kept under this name (None when it can): the name goes
    into URLs, headers and the database, so it must be printable UTF-8 of a sane length."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return "its name is not valid UTF-8"
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        return "its name has control characters"
    if "\\" in name:
        return "its name has a backslash"
    if len(name) > MAX_ARTIFACT_NAME:
        return f"its name is longer than {MAX_ARTIFACT_NAME} characters"
    return None
