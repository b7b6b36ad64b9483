"""Job environments: the Python packages a job names, built on its node with uv while it waits.

An environment is a virtual environment layered over the runner's own runtime (the base): the
base's site-packages are added behind the environment's own (a .pth file), so torch, numpy and
the rest are not downloaded again, and every base package is pinned to its version by a
constraint, so the job's packages are resolved against them. So that uv sees the base packages as
installed (it does not look through a .pth), each gets a stub in the environment's site-packages:
its METADATA only, marked as the base's. Wheels only (`--no-build`): no package code runs while
installing.

Environments are cached per node under the hash of what was asked (the requirements, the base
and the package index), shared read-only by every job and team that asks the same, and evicted
least recently used past a size budget (never one a running job uses). The versions uv chose are
kept beside it (resolved.txt) and shown on the job page.

The decisions (the key, the torch check, what to evict) are the pure functions at the top.
"""

import fcntl
import hashlib
import logging
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

STUB_INSTALLER = "e31-base"
COMPLETE = ".complete"
RESOLVED = "resolved.txt"
USED = ".used"  # its mtime: when a job last used the environment


class BuildError(RuntimeError):
    """The environment could not be built: the message is the resolver's (or ours)."""


# Pure decisions ------------------------------------------------------------------------------


def normalize(name):
    """A distribution's name as PEP 503 compares it."""
    return re.sub(r"[-_.]+", "-", name).lower()


def environment_key(requirements, base, python_version, index):
    """The cache key of an environment: the sha256 of the normalized requirements (sorted), the
    base's distributions, the Python version and the package index settings."""
    text = "\n".join(
        ["python " + python_version, "index " + " ".join(index), "requirements", *sorted(requirements), "base", *sorted(base)]
    )
    return hashlib.sha256(text.encode()).hexdigest()


def base_pins(distributions):
    """name==version for each (name, version) of the base, normalized, without duplicates."""
    pins = {}
    for name, version in distributions:
        pins.setdefault(normalize(name), f"{normalize(name)}=={version}")
    return sorted(pins.values())


def torch_problem(requirements, base_torch):
    """Why a job's requirements cannot run on this base's torch (None when they can): torch is
    never installed into an environment (a CUDA build is several GB), it is the node's."""
    from packaging.requirements import InvalidRequirement, Requirement

    for line in requirements:
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            continue  # uv says what is wrong with it
        if normalize(requirement.name) != "torch" or not requirement.specifier:
            continue
        if base_torch is None:
            return "it asks for torch, and this node's runtime has none"
        if not requirement.specifier.contains(base_torch, prereleases=True):
            return (
                f"it asks for {line.strip()}, but torch is the node's own, {base_torch} here; "
                f"ask for a version {base_torch} satisfies, or for torch without a version"
            )
    return None


def packages_digest(requirements):
    """What the scheduler knows an environment by, the same on every node (a node's own key also
    holds its runtime and index): the sha256 of the requirements, sorted."""
    return hashlib.sha256(("packages\n" + "\n".join(sorted(requirements))).encode()).hexdigest()


@dataclass(frozen=True)
class Entry:
    key: str
    size: int
    used_at: float


def evictions(entries, budget, keep=frozenset(), incoming=0):
    """The keys to drop, least recently used first, so that the rest and an incoming build fit
    the budget; never one in keep (in use by a running job)."""
    total = sum(e.size for e in entries) + incoming
    out = []
    for entry in sorted(entries, key=lambda e: e.used_at):
        if total <= budget:
            break
        if entry.key in keep:
            continue
        out.append(entry.key)
        total -= entry.size
    return out


# The node ------------------------------------------------------------------------------------


def folder_size(path):
    total = 0
    for folder, dirs, files in os.walk(path):
        for name in files + dirs:
            try:
                total += os.lstat(os.path.join(folder, name)).st_blocks * 512
            except OSError:
                pass
    return total


def installed_base():
    """(name, version) of every distribution of the runner's own runtime."""
    from importlib import metadata

    out = []
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            out.append((name, dist.version))
    return out


class EnvironmentCache:
    """The environments of one node, in one folder: root/<key>/ each, root/.uv-cache shared."""

    def __init__(self, root, budget, *, uv, python, base_sites, index=(), timeout=1800):
        self.root = Path(root)
        self.budget = budget
        self.uv = uv
        self.python = python  # the base interpreter the environments are made from
        self.base_sites = [str(s) for s in base_sites]
        self.index = tuple(index)
        self.timeout = timeout
        self.base = installed_base()
        self.pins = base_pins(self.base)
        self.base_torch = next((v for n, v in self.base if normalize(n) == "torch"), None)
        self.python_version = subprocess.run(
            [python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True, text=True, check=True,
        ).stdout.strip()

    def key(self, requirements):
        return environment_key(requirements, self.pins, self.python_version, self.index)

    def path(self, key):
        return self.root / key

    def ready(self, key):
        return (self.path(key) / COMPLETE).exists()

    def python_of(self, key):
        return self.path(key) / "bin" / "python"

    def resolved(self, key):
        try:
            return (self.path(key) / RESOLVED).read_text().split()
        except OSError:
            return []

    def touch(self, key):
        marker = self.path(key) / USED
        try:
            marker.touch()
        except OSError:
            pass

    def held(self):
        """{packages digest: size} of the environments ready here, for the scheduler to prefer
        this node for jobs that ask the same."""
        out = {}
        for entry in self.entries():
            folder = self.path(entry.key)
            if (folder / COMPLETE).exists():
                try:
                    requirements = (folder / "requirements.txt").read_text().split("\n")
                except OSError:
                    continue
                out[packages_digest([r for r in requirements if r])] = entry.size
        return out

    def entries(self):
        out = []
        try:
            folders = [p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")]
        except OSError:
            return out
        for folder in folders:
            try:
                used_at = (folder / USED).stat().st_mtime
            except OSError:
                used_at = 0.0
            out.append(Entry(folder.name, folder_size(folder), used_at))
        return out

    def make_room(self, keep=frozenset()):
        for key in evictions(self.entries(), self.budget, keep):
            log.info("evicting the environment %s (least recently used)", key[:12])
            shutil.rmtree(self.path(key), ignore_errors=True)

    def ensure(self, requirements, keep=frozenset()):
        """(key, built): the environment for these requirements, built if this node lacks it.
        Raises BuildError with uv's own message when it cannot be built."""
        problem = torch_problem(requirements, self.base_torch)
        if problem:
            raise BuildError(problem)
        key = self.key(requirements)
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)
        with open(self.root / f".lock-{key[:16]}", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one build per key, whatever else runs here
            if self.ready(key):
                self.touch(key)
                return key, False
            self.make_room(keep)
            try:
                self._build(key, requirements)
            except BaseException:
                shutil.rmtree(self.path(key), ignore_errors=True)
                raise
        return key, True

    def _run(self, args, what):
        env = {"PATH": "/usr/bin:/bin", "UV_CACHE_DIR": str(self.root / ".uv-cache"), "UV_NO_CONFIG": "1", "HOME": str(self.root)}
        try:
            result = subprocess.run(args, capture_output=True, text=True, timeout=self.timeout, env=env, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise BuildError(f"{what} took longer than {self.timeout} s") from None
        if result.returncode != 0:
            message = (result.stderr or result.stdout).strip()
            raise BuildError(message[-4000:] or f"{what} failed (exit {result.returncode})")
        return result

    def _build(self, key, requirements):
        folder = self.path(key)
        shutil.rmtree(folder, ignore_errors=True)  # a build cut short
        self._run([self.uv, "venv", "--quiet", "--no-project", "--python", self.python, str(folder)], "making the environment")
        site = next(folder.glob("lib/python*/site-packages"))
        (site / "_e31_base.pth").write_text("".join(f"import site; site.addsitedir({s!r})\n" for s in self.base_sites))
        for name, version in self.base:
            stub = site / f"{normalize(name).replace('-', '_')}-{version}.dist-info"
            stub.mkdir(exist_ok=True)
            (stub / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
            (stub / "INSTALLER").write_text(STUB_INSTALLER + "\n")
            (stub / "RECORD").write_text("")
        (folder / "requirements.txt").write_text("".join(line + "\n" for line in requirements))
        (folder / "base-constraints.txt").write_text("".join(pin + "\n" for pin in self.pins))
        self._run(
            [
                self.uv, "pip", "install", "--quiet", "--python", str(folder / "bin" / "python"), "--no-build",
                "-r", str(folder / "requirements.txt"), "--constraint", str(folder / "base-constraints.txt"), *self.index,
            ],
            "installing the packages",
        )
        # What uv chose, read from the installed metadata: never by starting the environment's
        # Python as root once packages are in it (a wheel's .pth file runs at every start).
        (folder / RESOLVED).write_text("".join(line + "\n" for line in installed_packages(site)))
        for path in (folder, *folder.rglob("*")):  # read-only for everyone, jobs included
            if not path.is_symlink():
                path.chmod(0o755 if path.is_dir() or os.access(path, os.X_OK) else 0o644)
        (folder / USED).touch()
        (folder / COMPLETE).write_text(time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))


def installed_packages(site):
    """name==version of what was installed into site-packages, the base's stubs left out."""
    out = []
    for info in sorted(Path(site).glob("*.dist-info")):
        try:
            if (info / "INSTALLER").read_text().strip() == STUB_INSTALLER:
                continue
            fields = dict(
                line.split(": ", 1) for line in (info / "METADATA").read_text(errors="replace").splitlines()[:20] if ": " in line
            )
        except OSError:
            continue
        if fields.get("Name") and fields.get("Version"):
            out.append(f"{normalize(fields['Name'])}=={fields['Version']}")
    return sorted(out)


def index_arguments(settings):
    """uv's index flags from the operator's settings: an index URL, extra wheel folders, or
    none at all (offline)."""
    out = []
    if settings.E31_ENV_INDEX_URL:
        out += ["--index-url", settings.E31_ENV_INDEX_URL]
    for folder in filter(None, settings.E31_ENV_FIND_LINKS.split(",")):
        out += ["--find-links", folder.strip()]
    if settings.E31_ENV_NO_INDEX:
        out.append("--no-index")
    return out


def requirements_of(job):
    """The job's requirements, one a line (jobs.packages has checked them at submission)."""
    return [line.strip() for line in (getattr(job, "packages", "") or "").splitlines() if line.strip()]
