"""A folder as the job's code, in a real browser against a live system with a runner: a folder of
three files (train.py importing pkg/model.py, and pkg/__init__.py) is chosen on the new-job
form, sent with its paths, packed on the server, unpacked by the job, and runs to success. Also
a folder dropped on the form (read with webkitGetAsEntry), and a refused form that keeps it.

Screenshots go to test-artifacts/ at the repository root (git-ignored).
"""

import re

import pytest
from playwright.sync_api import expect

from tests.browser import log_in, shot

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300)]

JOB_URL = re.compile(r"/jobs/[0-9a-f-]{36}/$")
TRAIN = """\
import os

from pkg.model import fit

print(f"folder job: fitted on {fit(os.environ['E31_DATA_DIR'])} data files")
with open(os.path.join(os.environ["E31_OUTPUT_DIR"], "model.txt"), "w") as out:
    out.write("fitted\\n")
"""
MODEL = """\
import os


def fit(folder):
    return sum(len(files) for _, _, files in os.walk(folder))
"""


@pytest.fixture(scope="module")
def system(runner_system):
    return runner_system


@pytest.fixture
def project(tmp_path):
    folder = tmp_path / "myproj"
    (folder / "pkg").mkdir(parents=True)
    (folder / "train.py").write_text(TRAIN)
    (folder / "pkg" / "__init__.py").write_text("")
    (folder / "pkg" / "model.py").write_text(MODEL)
    return folder


def open_new_job(page):
    log_in(page)
    page.goto("/jobs/new/")
    expect(page.get_by_role("heading", name="New training job")).to_be_visible()


def test_a_folder_with_a_nested_module_is_uploaded_and_runs(page, project):
    open_new_job(page)
    page.fill("#id_name", "folder-browser")
    page.set_input_files("#id_code_folder", project)
    # The files are listed with the paths the job will see, and train.py is offered as the entrypoint.
    summary = page.locator("#folder-summary")
    expect(summary).to_contain_text("myproj: 3 files")
    expect(summary).to_contain_text("pkg/__init__.py, pkg/model.py, train.py")
    expect(page.locator("#folder-paths input[name=code_paths]")).to_have_count(3)
    expect(page.locator("#id_entrypoint")).to_have_value("train.py")
    page.select_option("#id_train_dataset", label="digits")
    page.fill("#id_span_hours", "0.25")
    shot(page, "folder-upload.png")

    page.get_by_role("button", name="Submit job").click()
    expect(page).to_have_url(JOB_URL, timeout=60_000)
    expect(page.get_by_role("heading", level=1)).to_contain_text("folder-browser")
    expect(page.locator("#job-state")).to_have_text("Succeeded", timeout=180_000)
    expect(page.locator("#log")).to_contain_text("folder job: fitted on")
    expect(page.locator("#artifacts").get_by_role("link", name="model.txt")).to_be_visible(timeout=30_000)
    shot(page, "folder-job.png")


# A dropped folder as Chromium hands it over (FileSystemEntry objects from webkitGetAsEntry),
# for a drop no test can make with a real mouse: readEntries answers in batches, as Chromium's
# does (at most 100 at a time), so the walk must ask again until it gets none.
DROP = """([files]) => {
  function fileEntry(path, text) {
    return { isFile: true, isDirectory: false, fullPath: path,
             file: (ok) => ok(new File([text], path.split("/").pop())) };
  }
  function folderEntry(path, children) {
    return { isFile: false, isDirectory: true, fullPath: path, createReader() {
      let left = children.slice();
      return { readEntries(ok) { const batch = left.slice(0, 2); left = left.slice(2); setTimeout(() => ok(batch)); } };
    } };
  }
  function tree(path, node) {
    return typeof node === "string" ? fileEntry(path, node)
      : folderEntry(path, Object.entries(node).map(([name, child]) => tree(`${path}/${name}`, child)));
  }
  const root = tree("/myproj", files);
  const event = new Event("drop", { bubbles: true, cancelable: true });
  Object.defineProperty(event, "dataTransfer", { value: {
    items: [{ kind: "file", webkitGetAsEntry: () => root }], files: [] } });
  document.getElementById("folder-drop").dispatchEvent(event);
}"""


def test_a_dropped_folder_is_read_and_a_refused_form_keeps_it(page):
    open_new_job(page)
    page.fill("#id_name", "folder-dropped")
    tree = {"train.py": "print(1)\n", "pkg": {"__init__.py": "", "model.py": "X = 1\n", "__pycache__": {"model.pyc": "junk"}}}
    page.evaluate(DROP, [tree])
    expect(page.locator("#folder-summary")).to_contain_text("myproj: 3 files")
    paths = page.locator("#folder-paths input[name=code_paths]")
    expect(paths).to_have_count(3)
    sent = sorted(paths.evaluate_all("inputs => inputs.map(i => i.value)"))
    assert sent == ["myproj/pkg/__init__.py", "myproj/pkg/model.py", "myproj/train.py"]
    assert page.locator("#id_code_folder").evaluate("input => input.files.length") == 3
    expect(page.locator("#id_entrypoint")).to_have_value("train.py")

    # No training data: refused, and the folder, packed, is kept for the next try.
    page.get_by_role("button", name="Submit job").click()
    expect(page.locator("#field-data .error")).to_contain_text("Give the training set")
    kept = page.locator('input[type="checkbox"][name="kept_code"]')
    expect(kept).to_be_checked()
    expect(page.locator("ul.kept")).to_contain_text("myproj.zip")
    page.select_option("#id_train_dataset", label="digits")
    page.get_by_role("button", name="Submit job").click()
    expect(page).to_have_url(JOB_URL, timeout=60_000)
    expect(page.get_by_role("heading", level=1)).to_contain_text("folder-dropped")
