"""Job environments: the Python packages a job names, built on its node with uv while it waits.

An environment is a virtual environment layered over the runner's own runtime (the base): the
base's site-packages are added behind the environment's own (a .pth file), so torch, numpy and
the rest are not downloaded again, and every base package is pinned to its version by a
constraint, so the job's packages are resolved against them. So that uv sees the base packages as
installed (it does not look through a .pth), each gets a stub in the environment's site-packages:
its METADATA only, marked as the base's. Wheels only (`--no-build`) by default: no package code
runs while installing, and uv runs as the runner. Where the operator allows source builds, the
install runs instead in a sandbox of its own (agent/isolation.py), as an unprivileged uid with
a private uv cache, and the runner takes back only what that uid made.

Environments are cached per node under the hash of what was resolved (the versions installed, the
base and the package index), shared read-only by every job and team whose requests resolve the
same, and evicted least recently used past a size budget (never one a running job uses). Each
request (the requirements as asked) is remembered as a link to what it resolved to, so a second
job that asks the same starts without building. An environment is made relocatable in a folder of
its own, then moved under its resolved key. The versions uv chose are kept beside it
(resolved.txt) and shown on the job page.

The decisions (the key, the torch check, what to evict) are the pure functions at the top.
"""

import fcntl
import hashlib
import logging
import os
import re
import shutil
import stat
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from jobs.packages import packages_digest

log = logging.getLogger(__name__)

STUB_INSTALLER = "e31-base"
COMPLETE = ".complete"
REQUESTS = ".requests"  # request key -> "resolved key\nrequirement\n..."
BUILDING = ".building"  # environments being built, by request key
RESOLVED = "resolved.txt"
USED = ".used"  # its mtime: when a job last used the environment
PINS = ".pins"  # a file per environment, held with a shared lock by each job using it (pin)
EVICTING = ".lock-evict"  # held exclusively while evicting, shared while pinning


class BuildError(RuntimeError):
    """The environment could not be built: the message is the resolver's (or ours)."""


# Pure decisions ------------------------------------------------------------------------------


def normalize(name):
    """A distribution's name as PEP 503 compares it."""
    return re.sub(r"[-_.]+", "-", name).lower()


def environment_key(requirements, base, python_version, index):
    """The cache key of an environment: the sha256 of the normalized requirements (sorted), the
    base's distributions, the Python version and the package index settings."""
    text = "\n".join(["python " + python_version, "index " + " ".join(index), "requirements", *sorted(requirements), "base", *sorted(base)])
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

    def __init__(self, root, budget, *, uv, python, base_sites, index=(), timeout=1800, source_builds=None):
        """source_builds: None for wheels only; else a function (command, folder, read_only, timeout)
        -> (exit code, output) that runs uv in a sandbox with folder writable (source builds run
        package code)."""
        self.root = Path(root)
        self.source_builds = source_builds
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
            [python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()

    def key(self, requirements):
        return environment_key(requirements, self.pins, self.python_version, self.index)

    def path(self, key):
        return self.root / key

    def ready(self, key):
        return (self.path(key) / COMPLETE).exists()

    def lookup(self, requirements):
        """The resolved key of the environment these requirements were last built as, if it is
        here and ready (None: it must be built)."""
        resolved, _ = self._request(self.key(requirements))
        return resolved if resolved and self.ready(resolved) else None

    def _request(self, request_key):
        """(resolved key, requirements) a request was last built as; (None, []) if unknown."""
        try:
            first, *requirements = (self.root / REQUESTS / request_key).read_text().split("\n")
        except OSError:
            return None, []
        return (first or None), [r for r in requirements if r]

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
        sizes = {e.key: e.size for e in self.entries() if self.ready(e.key)}
        out = {}
        for request in self._requests():
            resolved, requirements = self._request(request)
            if resolved in sizes:
                out[packages_digest(requirements)] = sizes[resolved]
        return out

    def _requests(self):
        try:
            return [p.name for p in (self.root / REQUESTS).iterdir()]
        except OSError:
            return []

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

    def pin(self, key):
        """Hold the environment against eviction while a job uses it, by any process on the node
        (the node's agents under Slurm, each a process of its own, share the folder): an open file
        with a shared lock, to close when the job is done. None where it was evicted since it was
        looked up (build it again)."""
        (self.root / PINS).mkdir(parents=True, exist_ok=True)
        with open(self.root / EVICTING, "a") as guard:
            fcntl.flock(guard, fcntl.LOCK_SH)  # no eviction between the check and the pin
            if not self.ready(key):
                return None
            pin = open(self.root / PINS / key, "a")  # noqa: SIM115 - held for the job's run
            fcntl.flock(pin, fcntl.LOCK_SH)
            return pin

    def _pinned(self, key):
        try:
            with open(self.root / PINS / key, "a") as pin:
                fcntl.flock(pin, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:
            return False
        return False

    def make_room(self):
        """Evict, least recently used first, to fit the budget; never one pinned by a job on the
        node (pin), whichever process runs it."""
        (self.root / PINS).mkdir(parents=True, exist_ok=True)
        with open(self.root / EVICTING, "a") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)
            entries = self.entries()
            pinned = {e.key for e in entries if self._pinned(e.key)}
            for key in evictions(entries, self.budget, keep=pinned):
                log.info("evicting the environment %s (least recently used)", key[:12])
                shutil.rmtree(self.path(key), ignore_errors=True)
                (self.root / PINS / key).unlink(missing_ok=True)
        for request in self._requests():  # requests whose environment went
            resolved, _ = self._request(request)
            if not resolved or not self.path(resolved).is_dir():
                (self.root / REQUESTS / request).unlink(missing_ok=True)

    def ensure(self, requirements):
        """(key, built): the environment for these requirements (key: what they resolved to),
        built if this node lacks it. Raises BuildError with uv's own message when it cannot be
        built."""
        problem = torch_problem(requirements, self.base_torch)
        if problem:
            raise BuildError(problem)
        request = self.key(requirements)
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)
        (self.root / REQUESTS).mkdir(exist_ok=True)
        with open(self.root / f".lock-request-{request[:16]}", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one build per request, whatever else runs here
            resolved = self.lookup(requirements)
            if resolved:
                self.touch(resolved)
                return resolved, False
            self.make_room()
            building = self.root / BUILDING / request
            try:
                resolved = self._build(building, requirements)
                built = self._settle(building, resolved)
            finally:
                shutil.rmtree(building, ignore_errors=True)
            (self.root / REQUESTS / request).write_text("\n".join([resolved, *requirements]) + "\n")
        return resolved, built

    def _settle(self, building, resolved):
        """Move a finished build under its resolved key; False where an environment resolved the
        same is here already (another request's): that one is kept, this one dropped."""
        with open(self.root / f".lock-env-{resolved[:16]}", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if self.ready(resolved):
                self.touch(resolved)
                return False
            shutil.rmtree(self.path(resolved), ignore_errors=True)  # a move cut short
            os.rename(building / "env", self.path(resolved))
            (self.path(resolved) / USED).touch()
            (self.path(resolved) / COMPLETE).write_text(time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        return True

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

    def _build(self, building, requirements):
        """Build the environment in building/env (relocatable); its resolved key."""
        shutil.rmtree(building, ignore_errors=True)  # a build cut short
        building.mkdir(parents=True)
        folder = building / "env"
        self._run(
            [self.uv, "venv", "--quiet", "--relocatable", "--no-project", "--python", self.python, str(folder)],
            "making the environment",
        )
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
        install = [
            self.uv,
            "pip",
            "install",
            "--quiet",
            "--python",
            str(folder / "bin" / "python"),
            "-r",
            str(folder / "requirements.txt"),
            "--constraint",
            str(folder / "base-constraints.txt"),
            *self.index,
        ]
        if self.source_builds is None:
            self._run([*install, "--no-build"], "installing the packages")
        else:
            self._run_sandboxed(install, building)
        # What uv chose, read from the installed metadata: never by starting the environment's
        # Python as root once packages are in it (a wheel's .pth file runs at every start).
        resolved = installed_packages(site)
        (folder / RESOLVED).write_text("".join(line + "\n" for line in resolved))
        for path in (folder, *folder.rglob("*")):  # read-only for everyone, jobs included
            if not path.is_symlink():
                path.chmod(0o755 if path.is_dir() or os.access(path, os.X_OK) else 0o644)
        return environment_key(resolved, self.pins, self.python_version, self.index)

    def _run_sandboxed(self, install, building):
        """uv, allowed to build from source, in a sandbox where only building/ is writable, with
        a cache of its own there (a build's code must not reach the node's shared cache)."""
        env = {"UV_CACHE_DIR": str(building / "uv-cache"), "UV_NO_CONFIG": "1", "HOME": str(building), "PATH": "/usr/bin:/bin"}
        folders = [word for flag, word in zip(self.index, self.index[1:]) if flag == "--find-links" and os.path.isdir(word)]
        code, output = self.source_builds(install, building, env, folders, self.timeout)
        shutil.rmtree(building / "uv-cache", ignore_errors=True)
        if code != 0:
            raise BuildError(output.strip()[-4000:] or f"installing the packages failed (exit {code})")


def installed_packages(site):
    """name==version of what was installed into site-packages, the base's stubs left out."""
    out = []
    for info in sorted(Path(site).glob("*.dist-info")):
        try:
            if _regular_text(info / "INSTALLER").strip() == STUB_INSTALLER:
                continue
            fields = dict(line.split(": ", 1) for line in _regular_text(info / "METADATA").splitlines()[:20] if ": " in line)
        except OSError:
            continue
        if fields.get("Name") and fields.get("Version"):
            out.append(f"{normalize(fields['Name'])}=={fields['Version']}")
    return sorted(out)


def _regular_text(path, limit=1 << 20):
    """A file's text, only if it is a regular file reached without following a link (a source
    build's code made the folder: what the runner reads there it reads as a stranger's)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        return os.read(fd, limit).decode(errors="replace")
    finally:
        os.close(fd)


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
