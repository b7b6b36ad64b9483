"""How fast a job's environment is ready: our builder (uv, layered over the runtime) against
`python -m venv` + `pip install` of the same packages, and a cache hit.

Five pure-Python wheels, made here, are served from a local folder (no network): the same for
both. Ours: agent.environments.EnvironmentCache.ensure(), a new key each round (the uv cache
stays warm, as on a node). Theirs: `python -m venv` then `pip install --no-index --find-links`.
Medians of alternating rounds; the last line is the speed-up, theirs / ours (target >= 5).

    .venv/bin/python bench/environments.py [--repeat 5] [--quick]

--quick (CI: the benchmark still works, in about 7 s): one round of each, and the cache hit; the
figures are meaningless.
"""

import argparse
import shutil
import site
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agent.environments import EnvironmentCache  # noqa: E402  (no Django inside)
from tests.test_environments import make_wheel  # noqa: E402

PACKAGES = ["alpha", "bravo", "charlie", "delta", "echo"]
TARGET = 5.0


def ours(cache, round_):
    # Environments are kept by what was resolved, so the last round's goes first (uv's own cache
    # stays warm, as a node's does): each round is a real build.
    budget, cache.budget = cache.budget, 0
    cache.make_room()
    cache.budget = budget
    requirements = [f"{name}==1.0" for name in PACKAGES] + [f"alpha>=0.{round_}"]
    started = time.perf_counter()
    key, built = cache.ensure(requirements)
    assert built
    return time.perf_counter() - started, key


def theirs(work, wheels):
    folder = Path(tempfile.mkdtemp(prefix="venv-", dir=work))
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True)
    subprocess.run(
        [str(folder / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-index", "--find-links", str(wheels), *[f"{name}==1.0" for name in PACKAGES]],
        check=True,
    )
    elapsed = time.perf_counter() - started
    shutil.rmtree(folder)
    return elapsed


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="one round (CI: the benchmark still works)")
    options = parser.parse_args()
    repeat = 1 if options.quick else options.repeat
    work = Path(tempfile.mkdtemp(prefix="e31-env-bench-"))
    try:
        wheels = work / "wheels"
        wheels.mkdir()
        for name in PACKAGES:
            make_wheel(wheels, name, "1.0", f"NAME = {name!r}\n")
        from uv import find_uv_bin

        cache = EnvironmentCache(
            work / "envs",
            10**12,
            uv=find_uv_bin(),
            python=sys.executable,
            base_sites=site.getsitepackages(),
            index=["--find-links", str(wheels), "--no-index"],
        )
        ours(cache, 0)  # warms uv's cache, as a node's is after its first build
        times = {"ours": [], "theirs": []}
        key = None
        for round_ in range(1, repeat + 1):
            elapsed, key = ours(cache, round_)
            times["ours"].append(elapsed)
            times["theirs"].append(theirs(work, wheels))
        check = subprocess.run(
            [str(cache.python_of(key)), "-c", "import alpha, echo, torch; print(alpha.NAME, echo.NAME)"],
            capture_output=True,
            text=True,
        )
        assert check.stdout.split() == ["alpha", "echo"], check
        started = time.perf_counter()
        _, built = cache.ensure([f"{name}==1.0" for name in PACKAGES] + [f"alpha>=0.{repeat}"])
        hit = time.perf_counter() - started
        assert not built
    finally:
        shutil.rmtree(work, ignore_errors=True)
    mine, base = statistics.median(times["ours"]), statistics.median(times["theirs"])
    print(f"rounds: {repeat}, {len(PACKAGES)} packages from a local wheel folder")
    print(f"ours (uv, layered over the runtime): median {mine:.3f} s ({', '.join(f'{t:.2f}' for t in times['ours'])})")
    print(f"venv + pip install: median {base:.3f} s ({', '.join(f'{t:.2f}' for t in times['theirs'])})")
    print(f"cache hit: {hit * 1000:.1f} ms")
    print(f"target: speed-up >= {TARGET}")
    print(f"speed-up (venv + pip / ours): {base / mine:.1f}")


if __name__ == "__main__":
    main()
