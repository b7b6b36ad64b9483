"""How a job process is set up: its folders, its environment and its command.

The environment is built from scratch: nothing of the runner's own environment (database URL,
Redis URL, storage credentials, the Django secret) reaches the job.
"""

import json
import os
import posixpath
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from e31.recipes import RECIPES

# What the network sets in every job's environment, and what each is: a job may not set these
# itself (the message says what the network gives). Any other name is the job's own, SageMaker's
# SM_CHANNEL_TRAINING included. The E31_ prefix is the network's as a whole (names are added).
NETWORK_ENV = {
    "PATH": "the job's Python first, then the system's",
    "HOME": "the job's folder",
    "TMPDIR": "the job's own temporary folder",
    "CUDA_VISIBLE_DEVICES": "the devices the job holds",
    "SM_MODEL_DIR": "the output folder ($E31_OUTPUT_DIR)",
    "SM_OUTPUT_DIR": "the output folder ($E31_OUTPUT_DIR)",
    "SM_OUTPUT_DATA_DIR": "the output's data/ folder",
    "SM_INPUT_DIR": "the data folder ($E31_DATA_DIR)",
    "SM_CHANNELS": "the names of the job's data channels",
    "SM_NUM_GPUS": "the number of GPUs the job holds",
    "SM_NUM_CPUS": "the number of CPU slots the job holds",
    "SM_HPS": "the job's hyperparameters (and config) as JSON",
    "SM_CURRENT_HOST": "this node's name in the run",
    "SM_HOSTS": "the run's nodes",
    "SM_TRAINING_ENV": "all of the above as JSON",
}
NETWORK_PREFIX = "E31_"
CHANNELS = ("train", "heldout", "model")
# Variables a job's arguments may name besides these: the E31_ ones the network sets.
E31_ENV = {
    "E31_JOB_ID": "the job's id",
    "E31_DATA_DIR": "the job's data folder",
    "E31_MODEL_DIR": "the folder of the models it starts from",
    "E31_OUTPUT_DIR": "the folder whose files come back",
    "E31_CHECKPOINT_DIR": "the checkpoints' folder",
    "E31_CONFIG": "the config file",
    "E31_NUM_DEVICES": "the number of devices it holds",
    "E31_METRICS_FILE": "the metrics file",
    "E31_STOP_FILE": "the stop notice's file",
    "E31_RESTART": "how often it was restarted",
    "E31_ALLOCATION_ID": "this run's id",
    "E31_PRECISION": "the job's precision: fp32, bf16, fp16, or empty for the default",
    "E31_SMOKE": "1 in a script's smoke run, unset otherwise",
    "E31_EARLY_STOP_METRIC": "the metric the network watches to stop the job early, unset when none",
    "E31_EARLY_STOP_MODE": "min or max: how that metric gets better, unset when none",
}
# Set only in some runs: naming one in the arguments would fail the start of the others.
SOMETIMES_SET = ("E31_SMOKE", "E31_EARLY_STOP_METRIC", "E31_EARLY_STOP_MODE")
# What arguments may name: not those, unset in some runs.
E31_NAMES = tuple(name for name in E31_ENV if name not in SOMETIMES_SET)
# The job's own, if it does not set them.
DEFAULT_ENV = {"LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "PYTHONUNBUFFERED": "1"}


def env_key(name):
    """A name as SageMaker writes it in a variable: letters and digits kept, the rest _, upper case."""
    return "".join(c if c.isalnum() else "_" for c in str(name)).upper()


def network_env_names(hyperparameters=(), inputs=()):
    """{name: what the network sets it to} for a job with these hyperparameters and named
    inputs (names)."""
    names = dict(NETWORK_ENV)
    for channel in (*CHANNELS, *inputs):
        names[f"SM_CHANNEL_{env_key(channel)}"] = (
            f"the {channel} channel's folder ($E31_DATA_DIR/{channel})" if channel != "model" else "the models folder ($E31_MODEL_DIR)"
        )
    for name in hyperparameters:
        names[f"SM_HP_{env_key(name)}"] = f"the hyperparameter {name}"
    return names


def refused_env_name(name, hyperparameters=(), inputs=()):
    """Why a job may not set the variable name (None when it may): the network sets it."""
    what = {**E31_ENV, **network_env_names(hyperparameters, inputs)}.get(name)
    if what is None and name.startswith(NETWORK_PREFIX):
        return f"{name} is kept for the network (every E31_ name is) and cannot be set by the job"
    if what is not None:
        return f"{name} is set by the network (to {what}) and cannot be overridden"
    return None


def known_variables(declared=(), hyperparameters=(), inputs=()):
    """The names a job's arguments and environment values may use: the network's and its own."""
    return {*E31_NAMES, *network_env_names(hyperparameters, inputs), *DEFAULT_ENV, "OMP_NUM_THREADS", *declared}


INPUT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


def input_name_problem(name, taken=()):
    """Why a named input cannot be called name (None when it can): it is a folder of the data
    and a variable's name (SM_CHANNEL_<NAME>), which must not be another input's (taken)."""
    if not isinstance(name, str) or not INPUT_NAME.match(name):
        return f"{name!r}: an input's name is letters, digits, _ and - (starting with a letter or digit), at most 64"
    if name.lower() == "model":
        return "'model' is the models' channel ($E31_MODEL_DIR): name the input otherwise"
    clash = [other for other in taken if other != name and env_key(other) == env_key(name)]
    if clash:
        return f"{name!r} and {clash[0]!r} would both be SM_CHANNEL_{env_key(name)}: rename one"
    return None


VARIABLE = re.compile(r"\$(?:\$|\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")


class UnknownVariable(KeyError):
    def __str__(self):
        return f"${self.args[0]} is not a variable of the job's environment"


def expand(text, env):
    """$NAME and ${NAME} of env in text, as a shell would (but nothing else a shell does); $$ is
    one $. A $ followed by anything else stays as it is. Raises UnknownVariable."""

    def one(match):
        if match.group(0) == "$$":
            return "$"
        name = match.group(1) or match.group(2)
        if name not in env:
            raise UnknownVariable(name)
        return env[name]

    return VARIABLE.sub(one, text)


def variables_in(text):
    """The names text refers to ($NAME, ${NAME}; not $$)."""
    return [m.group(1) or m.group(2) for m in VARIABLE.finditer(text) if m.group(0) != "$$"]


def hyperparameter_args(hyperparameters):
    """SageMaker's way: each hyperparameter as --name value, by name. Text as it is, booleans as
    True/False (what Python prints), numbers as written, anything else as JSON."""
    args = []
    for name in sorted(hyperparameters):
        value = hyperparameters[name]
        if isinstance(value, str):
            text = value
        elif isinstance(value, bool):
            text = "True" if value else "False"
        elif isinstance(value, (int, float)):
            text = json.dumps(value)
        else:
            text = json.dumps(value)
        args += [f"--{name}", text]
    return args


def working_folder(entrypoint, workdir=""):
    """The job's working folder, relative to its code folder: workdir when given, else the
    entrypoint's own folder (a script opens its neighbours by their names, as it did at home);
    "" is the code folder itself. Raises ValueError for a path outside it."""
    chosen = workdir if workdir else ("" if entrypoint.startswith("recipe:") else posixpath.dirname(entrypoint))
    return clean_relative(chosen, "the working folder")


def clean_relative(path, what):
    """A relative POSIX path inside a folder, normalised ("" for the folder itself)."""
    if "\x00" in path or "\\" in path:
        raise ValueError(f"{what} {path!r} has a NUL or a backslash")
    if path.startswith("/"):
        raise ValueError(f"{what} {path!r} must be relative to the code's folder, not absolute")
    normal = posixpath.normpath(path) if path else ""
    if normal in (".", ""):
        return ""
    if normal == ".." or normal.startswith("../"):
        raise ValueError(f"{what} {path!r} is outside the code's folder")
    return normal


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
            self.code,
            self.data / "train",
            self.data / "heldout",
            self.model,
            self.output,
            self.output_data,
            self.checkpoints,
            self.tmp,
            self.control,
        ):
            path.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o700)


def build_environment(
    *,
    job_id,
    dirs,
    devices,
    device_type,
    declared,
    config=None,
    restart=0,
    python=sys.executable,
    hyperparameters=None,
    processes=1,
    precision="",
    inputs=(),
    early_stop=None,
    node_library_path=None,
):
    """The job's whole environment: PATH, HOME, the E31_ variables, SageMaker's names for the
    same places, and what the job declares (its values may name the others: $E31_DATA_DIR).
    processes: how many processes share the devices (CPU slots: each gets its share as threads).
    precision: the job's (fp32, bf16, fp16; "": not chosen), as E31_PRECISION.
    early_stop: (metric, mode) the network watches to stop it early, as E31_EARLY_STOP_METRIC
    and E31_EARLY_STOP_MODE (a recipe returns that metric's best weights; see e31/best.py)."""
    env = {
        "PATH": os.pathsep.join([str(Path(python).parent), "/usr/local/bin", "/usr/bin", "/bin"]),
        "HOME": str(dirs.root),
        "TMPDIR": str(dirs.tmp),
        **DEFAULT_ENV,
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
        "E31_PRECISION": precision or "",
        **sagemaker_environment(dirs, devices, device_type, {**(config or {}), **(hyperparameters or {})}, inputs),
    }
    if early_stop is not None:
        env["E31_EARLY_STOP_METRIC"], env["E31_EARLY_STOP_MODE"] = early_stop
    network = dict(env)
    for name, value in declared.items():
        if refused_env_name(name, hyperparameters or (), inputs) is None:
            try:
                env[name] = expand(str(value), network)
            except UnknownVariable:
                env[name] = str(value)  # checked when submitted; a name gone since stays as written
    if device_type == "cpu":
        # CPU slots: the job gets as many threads as it holds slots (shared among its processes),
        # so it uses what it pays for and does not crowd its neighbours.
        env.setdefault("OMP_NUM_THREADS", str(max(1, len(devices) // max(1, processes))))
        env["CUDA_VISIBLE_DEVICES"] = ""
    else:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices)
        # Where the node finds its CUDA driver library when its loader's cache does not say (a
        # GPU image's /usr/local/nvidia/lib64, say): the operator's setting, not the job's.
        library_path = os.environ.get("LD_LIBRARY_PATH", "") if node_library_path is None else node_library_path
        if library_path:
            env["LD_LIBRARY_PATH"] = library_path
    return env


def sagemaker_environment(dirs, devices, device_type, config, inputs=()):
    """The variables of SageMaker's training toolkit, pointing at the job's places, so that a
    script written for SageMaker runs unchanged. inputs: the job's named inputs' names."""
    channels = {name: dirs.model if name == "model" else dirs.data / name for name in (*CHANNELS, *inputs)}
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
        env[f"SM_CHANNEL_{env_key(name)}"] = str(path)
    for name, value in config.items():
        env[f"SM_HP_{env_key(name)}"] = value if isinstance(value, str) else json.dumps(value)
    env["SM_TRAINING_ENV"] = json.dumps(
        {
            "model_dir": env["SM_MODEL_DIR"],
            "output_data_dir": env["SM_OUTPUT_DATA_DIR"],
            "channel_input_dirs": {n: str(p) for n, p in channels.items()},
            "hyperparameters": config,
            "num_gpus": int(env["SM_NUM_GPUS"]),
            "num_cpus": int(env["SM_NUM_CPUS"]),
            "current_host": hosts[0],
            "hosts": hosts,
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


def process_count(processes, devices, device_type):
    """How many processes a job runs on a node: as it asked; else one per GPU, and one for CPU
    slots (which it uses as threads)."""
    if processes:
        return processes
    return 1 if device_type == "cpu" else max(1, devices)


def uses_torchrun(processes, gang=None):
    """Several processes on a node, or a run across nodes: under torchrun."""
    return processes > 1 or gang is not None


def job_command(job, script, python=sys.executable, processes=1, gang=None, log_dir=None, env=None):
    """A job's command (see command_for), its arguments' variables expanded from env (the job's
    environment) and its hyperparameters after them; or its shell command line, in bash."""
    env = env or {}
    if job.command:
        return command_for("", [], python=python, processes=processes, gang=gang, log_dir=log_dir, shell=job.command)
    args = [expand(str(arg), env) for arg in job.args or []] + hyperparameter_args(job.hyperparameters or {})
    return command_for(script, args, python=python, processes=processes, gang=gang, log_dir=log_dir)


def command_for(entrypoint, args, python=sys.executable, processes=1, gang=None, log_dir=None, shell=None, devices=None):
    """The job's command: the script, the archive's entrypoint or the built-in recipe, or a
    shell line (shell), run once; or, with several processes or across nodes, under torchrun
    (a script that works under torchrun works here unchanged), each worker killed by the kernel
    if torchrun dies. devices: the older name of processes."""
    if devices is not None:
        processes = devices
    if shell is not None:
        target = ["/bin/bash", "-c", shell]
    elif entrypoint.startswith("recipe:"):
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
    if not uses_torchrun(processes, gang):
        return target
    command = [python, "-u", "-c", TORCHRUN_SHIM, f"--nproc-per-node={processes}", "--max-restarts=0", "--tee=3"]
    if log_dir is not None:
        command.append(f"--log-dir={log_dir}")
    if gang is None:
        command.append("--standalone")
    else:
        command += [
            f"--nnodes={gang.nodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={gang.endpoint}",
            f"--rdzv-id={gang.run_id}",
            f"--rdzv-conf=is_host={1 if gang.is_host else 0}",
        ]
    command = [*command, "--no-python", python, "-S", "-c", WORKER_SHIM, *target]
    if gang is not None:
        command = [python, "-S", "-c", GANG_SHIM, str(gang.rank), *command]
    return command


# torchrun copies each worker's output from a file to its own, a line at a time, marked with the
# worker's rank (--tee). Its copy (tail_logfile) takes what readline() gives, and at the file's end
# that is a line's start: a worker writing a line in pieces (print's arguments under python -u, as
# every job runs) had its start copied as a line of its own, and the rest as another, with other
# workers' lines between (CI stored a job's "sum 3 interfaces 1" as " 3 interfaces 1"). This runs
# torchrun with a copy that holds a line's start until its end is written, the worker is done, or
# the start reaches TAIL_HOLD characters. A torch whose copy is not the function this expects
# (its parameters) runs torchrun as it is. torchrun runs as `python -m torch.distributed.run`.
TAIL_HOLD = 1 << 16
TORCHRUN_SHIM = f"""
import os, runpy, time
try:
    import inspect
    from torch.distributed.elastic.multiprocessing import tail_log
    expected = ["header", "file", "dst", "finished", "interval_sec", "log_line_filter"]
    if list(inspect.signature(tail_log.tail_logfile).parameters) == expected:
        def tail_logfile(header, file, dst, finished, interval_sec, log_line_filter=None):
            while not os.path.exists(file):
                if finished.is_set():
                    return
                time.sleep(interval_sec)
            start = ""
            with open(file, errors="replace") as source:
                while True:
                    line, done = source.readline(), False
                    if line:
                        line, start = start + line, ""
                        if not line.endswith("\\n") and len(line) < {TAIL_HOLD}:
                            start = line
                            continue
                    elif finished.is_set():
                        line, start, done = start, "", True
                    else:
                        time.sleep(interval_sec)
                        continue
                    if line and (log_line_filter is None or log_line_filter(line)):
                        dst.write(header + line + ("" if line.endswith("\\n") else "\\n"))
                    if done:
                        break
        tail_log.tail_logfile = tail_logfile
except Exception:
    pass
runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
"""

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
