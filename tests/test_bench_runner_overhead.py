"""bench/runner_overhead.py's direct runs read the files the system stages for the job: found
through the API's manifest and the blob store, on either database (it once looked for them by
name in storage, then in the SQLite file, and crashed when either moved). Its folder case sends
the code the direct run gets, and trains as the script case does, directly and through the
system, reading its named inputs."""

import ast
import importlib.util
import zipfile

import pytest

from e31web.demo import digits_csv, digits_split
from tests.system import ROOT, LiveSystem


def load_bench():
    spec = importlib.util.spec_from_file_location("runner_overhead", ROOT / "bench" / "runner_overhead.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def metrics(last_line):
    """The example's closing metrics, without the seconds they took."""
    assert last_line.startswith("done: "), last_line
    found = ast.literal_eval(last_line.removeprefix("done: ").split("; weights written", 1)[0])
    found.pop("seconds")
    return found


@pytest.mark.nodb
def test_the_folder_case_sends_the_code_the_direct_run_gets(tmp_path):
    bench = load_bench()
    script, folder = bench.cases()
    assert script.upload(tmp_path).read_bytes() == (ROOT / "examples" / "digits" / "train.py").read_bytes()
    with zipfile.ZipFile(folder.upload(tmp_path)) as packed:
        assert {name: packed.read(name) for name in packed.namelist()} == folder.code
    assert "digitsnet/example.py" in folder.code and folder.inputs == ["training", "testing"]
    assert folder.spec("x", {}, {"training": "digits@1", "testing": "digits-heldout@1"})["inputs"] == {"training": "digits@1", "testing": "digits-heldout@1"}


@pytest.mark.parametrize("database", ["sqlite", "postgres"])
def test_it_reads_the_demo_datasets_as_staged(database, tmp_path):
    bench = load_bench()
    (x_train, y_train), (x_held, y_held) = digits_split()
    with LiveSystem(database=database) as system:
        training, testing = bench.staged_dataset(system, "digits"), bench.staged_dataset(system, "digits-heldout")
        assert training == ("digits@1", [("digits-train.csv", digits_csv(x_train, y_train))])
        assert testing == ("digits-heldout@1", [("digits-heldout.csv", digits_csv(x_held, y_held))])
        if database == "sqlite":  # one run is enough to show the folder case works end to end
            script, folder = bench.cases()
            config = {"epochs": 1, "seed": 0}
            _, direct_script = bench.run_direct(tmp_path, script, config, {"train": training[1], "heldout": testing[1]})
            _, direct_folder = bench.run_direct(tmp_path, folder, config, {"training": training[1], "testing": testing[1]})
            pinned = {"training": training[0], "testing": testing[0]}
            *_, through_system = bench.run_system(system, folder, folder.upload(tmp_path), config, 0, pinned)
            # The same training, on the same data: held-out accuracy shows the testing input was read.
            assert "heldout_accuracy" in metrics(direct_script)
            assert metrics(direct_folder) == metrics(direct_script) == metrics(through_system)
