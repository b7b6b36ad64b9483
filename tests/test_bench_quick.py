"""Every benchmark (bench/*.py, found by a glob: a new one is in without a word here) runs in its
--quick mode, as a subprocess, to its last line, which must hold a figure: so a benchmark cannot
break unnoticed (one once looked for dataset files by name long after datasets became
content-addressed blobs). --quick is the same code at tiny sizes, seconds each; what the figures
say is not checked, only that the benchmark runs, and that what it must find (nothing lost,
nothing failed, which each one checks itself and exits 1 for) holds.

Marked bench (and e2e: most start a whole system, a SeaweedFS server or a PostgreSQL database of
their own, as real processes): bin/test runs them once, in a lane of their own beside the SQLite and
PostgreSQL passes, not in either pass. The
full runs stay out of CI.
"""

import ast
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.slurm_cluster import missing_tools
from tests.test_isolation import CGROUPS
from tests.test_isolation import ROOT as AS_ROOT

ROOT = Path(__file__).resolve().parent.parent
BENCHES = sorted((ROOT / "bench").glob("*.py"))
TIMEOUT = 240  # seconds for one --quick run; each takes under a minute on 2 busy cores
# A figure: 1.05, 0.0032, 1,600,947, -3.68 (not a bare "nan", which a broken division prints).
FIGURE = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?")
ISOLATION = AS_ROOT and CGROUPS and bool(shutil.which("bwrap"))


def cases():
    for path in BENCHES:
        marks = [pytest.mark.bench, pytest.mark.e2e]
        if path.stem == "sandbox_overhead":
            # It compares a run with job isolation and one without: nothing to run where there is none.
            marks.append(pytest.mark.skipif(not ISOLATION, reason="needs a root runner with cgroups and bubblewrap"))
        if path.stem == "slurm_overhead":
            # It starts a test Slurm (tests/slurm_cluster.py), as root, from Debian's packages.
            marks.append(pytest.mark.skipif(bool(missing_tools()) or not AS_ROOT, reason="needs root and slurm-wlm and munge (bin/setup test)"))
        yield pytest.param(path, [], marks=marks, id=path.stem)
    # A clone without ../shared/traces (as CI's may be): the synthetic trace instead.
    yield pytest.param(
        ROOT / "bench" / "scheduler_policies.py",
        ["--trace", str(ROOT / "no-such-folder" / "itp_cluster02.csv")],
        marks=[pytest.mark.bench, pytest.mark.e2e],
        id="scheduler_policies-without-the-trace",
    )


def children_cpu():
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def stop(process):
    """Interrupt a benchmark that overran (its finally clauses stop the systems it started),
    then end what is left of its process group."""
    process.send_signal(signal.SIGINT)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        pass
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        time.sleep(5)
    process.wait()


def tail(path, chars=6000):
    return path.read_text(errors="replace")[-chars:]


@pytest.mark.timeout(TIMEOUT + 120)
@pytest.mark.parametrize(("bench", "extra"), list(cases()))
def test_the_benchmark_runs_quick_to_its_last_figure(bench, extra, tmp_path):
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "E31_VAR_DIR": str(tmp_path / "var")}
    cpu, started = children_cpu(), time.monotonic()
    with open(out, "w") as stdout, open(err, "w") as stderr:
        # Its own process group: what it starts (web servers, runners, S3 servers) can be ended with it.
        process = subprocess.Popen(
            [sys.executable, str(bench), "--quick", *extra],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,
        )
        try:
            process.wait(TIMEOUT)
        except subprocess.TimeoutExpired:
            stop(process)
            pytest.fail(f"{bench.name} --quick ran over {TIMEOUT} s\n--- stdout\n{tail(out)}\n--- stderr\n{tail(err)}")
        finally:
            if process.poll() is None:  # the test itself timed out, or was interrupted
                stop(process)
    seconds, cpu = time.monotonic() - started, children_cpu() - cpu
    print(f"{bench.name} --quick {' '.join(extra)}: {seconds:.1f} s, {cpu:.1f} s of CPU")
    lines = out.read_text(errors="replace").strip().splitlines()
    assert process.returncode == 0, f"{bench.name} --quick exited {process.returncode}\n--- stdout\n{tail(out)}\n--- stderr\n{tail(err)}"
    assert lines, f"{bench.name} --quick printed nothing\n--- stderr\n{tail(err)}"
    assert FIGURE.search(lines[-1]), f"{bench.name} --quick: no figure on its last line: {lines[-1]!r}"


@pytest.mark.nodb
@pytest.mark.parametrize("bench", BENCHES, ids=[path.stem for path in BENCHES])
def test_the_benchmark_says_what_quick_does(bench):
    """Its module docstring (the top of the file, and of --help for most) tells what --quick runs."""
    doc = ast.get_docstring(ast.parse(bench.read_text())) or ""
    assert "--quick" in doc, f"{bench.name}: its docstring does not say what --quick does"
