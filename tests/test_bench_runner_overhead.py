"""bench/runner_overhead.py's direct runs read the files the system stages for the job: found
through the API's manifest and the blob store, on either database (it once looked for them by
name in storage, then in the SQLite file, and crashed when either moved)."""

import importlib.util

import pytest

from e31web.demo import digits_csv, digits_split
from tests.system import ROOT, LiveSystem


def load_bench():
    spec = importlib.util.spec_from_file_location("runner_overhead", ROOT / "bench" / "runner_overhead.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("database", ["sqlite", "postgres"])
def test_it_reads_the_demo_datasets_as_staged(database):
    bench = load_bench()
    (x_train, y_train), (x_held, y_held) = digits_split()
    with LiveSystem(database=database) as system:
        assert bench.staged_dataset(system, "digits") == ("digits@1", [("digits-train.csv", digits_csv(x_train, y_train))])
        assert bench.staged_dataset(system, "digits-heldout") == ("digits-heldout@1", [("digits-heldout.csv", digits_csv(x_held, y_held))])
