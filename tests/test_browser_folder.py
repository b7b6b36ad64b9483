"""A folder as the job's code, in a real browser against a live system with a runner: a folder of
three files (train.py importing pkg/model.py, and pkg/__init__.py) is chosen on the new-job
form, uploaded at once in chunks with its paths (resumably: static/js/folder.js), packed on the
server when the form names it, unpacked by the job, and runs to success. Also a folder dropped on
the form (read with webkitGetAsEntry), a refused form that keeps it, and an upload cut off part
way (a chunk lost once, then the connection lost for good) that goes on after a reload from
where the server says it got to, the job then running with every byte.

Screenshots go to test-artifacts/ at the repository root (git-ignored).
"""

import hashlib
import os
import re

import pytest
from playwright.sync_api import expect

from tests.browser import log_in, shot

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300)]

JOB_URL = re.compile(r"/jobs/[0-9a-f-]{36}/$")
UUID = re.compile(r"^[0-9a-f-]{36}$")
CHUNK_PUT = re.compile(r"/api/folders/[0-9a-f-]{36}/files/[0-9a-f-]{36}/\?offset=(\d+)$")
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
    # It goes up at once; the form will send the folder's id, not its files.
    expect(page.locator("#folder-status")).to_contain_text("Uploaded: ", timeout=30_000)
    expect(page.locator("#folder-paths input[name=code_folder_upload]")).to_have_value(UUID)
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
    expect(page.locator("#folder-status")).to_contain_text("Uploaded: ", timeout=30_000)
    # The server has the files with their paths as the browser gave them (the skipped one left out).
    folder = folder_upload(page)
    assert folder["id"] == folder_id(page)
    assert sorted(f["path"] for f in folder["files"]) == ["myproj/pkg/__init__.py", "myproj/pkg/model.py", "myproj/train.py"]
    assert (folder["state"], folder["complete"]) == ("open", True)
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


def folder_id(page):
    return page.locator("#folder-paths input[name=code_folder_upload]").input_value()


RESUMED_TRAIN = """\
import hashlib
import os

from pkg.model import fit

with open("weights.bin", "rb") as weights:
    digest = hashlib.sha256(weights.read()).hexdigest()
print(f"resumed folder job: weights.bin {os.path.getsize('weights.bin')} bytes, sha256 {digest}")
"""
CHUNK = 8 * 1024 * 1024  # the system's chunk size (E31_UPLOAD_CHUNK_BYTES's default)


def test_an_interrupted_folder_upload_goes_on_after_a_reload_and_the_job_runs_with_every_byte(page, project):
    weights = os.urandom(CHUNK + 4 * 1024 * 1024 + 123)  # two chunks
    (project / "weights.bin").write_bytes(weights)
    (project / "train.py").write_text(RESUMED_TRAIN)
    open_new_job(page)

    # The weights' first chunk is lost once on the way (sent again, it arrives); their second
    # never gets through: the connection is gone for good.
    tries = {"first": 0, "second": 0}

    def unreliable(route):
        offset = int(CHUNK_PUT.search(route.request.url).group(1))
        if offset == CHUNK:
            tries["second"] += 1
            return route.abort("connectionreset")
        if offset == 0 and len(route.request.post_data_buffer or b"") == CHUNK:  # the weights' (the rest are small)
            tries["first"] += 1
            if tries["first"] == 1:
                return route.abort("connectionreset")
        return route.continue_()

    page.route(CHUNK_PUT, unreliable)
    page.set_input_files("#id_code_folder", project)
    expect(page.locator("#folder-summary")).to_contain_text("myproj: 4 files")
    error = page.locator("#folder-error")
    expect(error).to_contain_text("myproj/weights.bin: the chunk at 8.0 MB failed 5 times (the server could not be reached)", timeout=60_000)
    expect(error).to_contain_text("Retry: it goes on where it stopped.")
    status = page.locator("#folder-status")
    expect(status).to_contain_text("Stopped: 8.0 MB of 12.0 MB (66%) · 3 of 4 files arrived")
    expect(page.get_by_role("button", name="Retry the upload")).to_be_visible()
    assert tries == {"first": 2, "second": 5}  # the first chunk, lost once, was sent again
    shot(page, "folder-upload-stopped.png")
    stopped = folder_upload(page)
    assert stopped["files_arrived"] == 3 and stopped["received"] == CHUNK + sum(
        (project / p).stat().st_size for p in ("train.py", "pkg/__init__.py", "pkg/model.py")
    )

    # The page is reloaded (the tab closed, the laptop moved): the same folder chosen again asks
    # the server how far it got and sends only what is missing, the weights' second chunk, held
    # back here a moment: the form sent meanwhile waits for it, then goes by itself.
    page.unroute(CHUNK_PUT, unreliable)
    page.reload()
    held = []
    page.route(CHUNK_PUT, lambda route: held.append(route))
    page.fill("#id_name", "folder-resumed")
    page.select_option("#id_train_dataset", label="digits")
    page.fill("#id_span_hours", "0.25")
    page.set_input_files("#id_code_folder", project)
    expect(status).to_contain_text("Uploading: 8.0 MB of 12.0 MB (66%) · 3 of 4 files arrived · resumed at 8.0 MB")
    expect(page.locator("#id_entrypoint")).to_have_value("train.py")
    page.get_by_role("button", name="Submit job").click()
    expect(status).to_contain_text("resumed at 8.0 MB · the form is sent once it has all arrived")
    expect(page.locator("#folder-error")).to_be_hidden()
    expect(page.get_by_role("button", name="Retry the upload")).to_be_hidden()
    shot(page, "folder-upload-resumed.png")
    assert page.url.endswith("/jobs/new/") and not page.locator("#form-errors").is_visible()
    [chunk] = held
    assert int(CHUNK_PUT.search(chunk.request.url).group(1)) == CHUNK  # nothing sent again
    chunk.continue_()
    page.unroute(CHUNK_PUT)

    expect(page).to_have_url(JOB_URL, timeout=60_000)
    expect(page.get_by_role("heading", level=1)).to_contain_text("folder-resumed")
    resumed = folder_upload(page)
    assert (resumed["id"], resumed["state"], resumed["received"]) == (stopped["id"], "packed", resumed["bytes"])
    expect(page.locator("#job-state")).to_have_text("Succeeded", timeout=180_000)
    digest = hashlib.sha256(weights).hexdigest()
    expect(page.locator("#log")).to_contain_text(f"resumed folder job: weights.bin {len(weights)} bytes, sha256 {digest}")
    shot(page, "folder-resumed-job.png")


def folder_upload(page):
    """The folder's upload as the API shows it to the page's user, found where the page keeps it
    (localStorage, for a reload)."""
    [url] = page.evaluate("Object.keys(localStorage).filter(k => k.startsWith('e31-folder|')).map(k => localStorage.getItem(k))")
    return page.evaluate("url => fetch(url).then(r => r.json())", url)
