"""How a job process is set up: its folders, its environment and its command.

The environment is built from scratch: nothing of the runner's own environment (database URL,
Redis URL, storage credentials, the Django secret) reaches the job.
"""

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
    def checkpoints(self):
        return self.root / "checkpoints"

    @property
    def tmp(self):
        return self.root / "tmp"

    @property
    def config(self):
        return self.root / "config.json"

    def create(self):
        for path in (self.code, self.data / "train", self.data / "heldout", self.output, self.checkpoints, self.tmp):
            path.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o700)


def build_environment(*, job_id, dirs, devices, device_type, declared, python=sys.executable):
    """The job's whole environment: PATH, HOME, the E31_ variables, what the job declares."""
    env = {
        "PATH": os.pathsep.join([str(Path(python).parent), "/usr/local/bin", "/usr/bin", "/bin"]),
        "HOME": str(dirs.root),
        "TMPDIR": str(dirs.tmp),
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONUNBUFFERED": "1",
        "E31_JOB_ID": str(job_id),
        "E31_DATA_DIR": str(dirs.data),
        "E31_OUTPUT_DIR": str(dirs.output),
        "E31_CHECKPOINT_DIR": str(dirs.checkpoints),
        "E31_CONFIG": str(dirs.config),
        "E31_NUM_DEVICES": str(len(devices)),
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


def command_for(entrypoint, args, python=sys.executable):
    if entrypoint.endswith(".py"):
        return [python, "-u", entrypoint, *args]
    if entrypoint.endswith(".sh"):
        return ["/bin/bash", entrypoint, *args]
    raise ValueError(f"cannot run entrypoint {entrypoint!r}: expected a .py or .sh file")


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
