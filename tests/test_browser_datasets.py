"""Datasets in a real browser: Chromium, driven by Playwright, against a live system.

Upload a multi-file dataset (a folder among the files, and one file larger than a chunk) through
the New dataset page and watch the progress; a failed chunk is tried again on its own. Then
interrupt an upload (the network drops chunks until the page gives up and shows Retry) and
finish it two ways: with the Retry button, and by reloading the page and picking the same files
again, when the upload continues from what the server received instead of starting over. The
dataset page then lists every file with its size and SHA-256.

The system runs with 5 MiB chunks (S3's smallest part) to keep the files small. Screenshots go
to test-artifacts/ at the repository root (git-ignored).
"""

import hashlib
import os
import re
from urllib.parse import parse_qs, urlparse

import pytest
from playwright.sync_api import expect

from tests.browser import log_in, shot

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300)]

CHUNK = 5 * 1024 * 1024
BIG = 12 * 1024 * 1024  # three chunks: 5 + 5 + 2 MiB
DATASET_URL = re.compile(r"/datasets/[0-9a-f-]{36}/$")
UPLOAD_URL = re.compile(r"/datasets/[0-9a-f-]{36}/versions/1/upload/$")


@pytest.fixture(scope="module")
def system(web_system):
    """No jobs here: the web server (and scheduler) are enough; 5 MiB chunks."""
    assert web_system.env["E31_UPLOAD_CHUNK_BYTES"] == str(CHUNK)
    return web_system


@pytest.fixture
def files(tmp_path):
    """Files to upload: a big one, a small one, and a folder of two."""
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(BIG))
    small = tmp_path / "labels.csv"
    small.write_bytes(b"image,label\n" + b"".join(f"{i}.png,{i % 10}\n".encode() for i in range(500)))
    folder = tmp_path / "images"
    (folder / "train").mkdir(parents=True)
    (folder / "train" / "0.png").write_bytes(os.urandom(3000))
    (folder / "readme.txt").write_bytes(b"ten classes\n")
    return {"big": big, "small": small, "folder": folder}


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def chunk_offset(url):
    query = parse_qs(urlparse(url).query)
    return int(query["offset"][0]) if "offset" in query else None


def is_chunk(request):
    return request.method == "PUT" and "/api/datasets/uploads/" in request.url


def watch_progress(page):
    """Keep every text the overall progress line and the file statuses show, to look at later."""
    page.evaluate(
        """() => {
          window.__seen = [];
          const root = document.getElementById('uploader');
          new MutationObserver(() => {
            for (const el of root.querySelectorAll('#overall-text, .upload-file .status'))
              if (window.__seen[window.__seen.length - 1] !== el.textContent) window.__seen.push(el.textContent);
          }).observe(root, {subtree: true, childList: true, characterData: true, attributes: true});
        }"""
    )


def new_dataset(page, name):
    page.get_by_role("navigation").get_by_role("link", name="Datasets").click()
    expect(page.get_by_role("heading", name="Datasets")).to_be_visible()
    page.get_by_role("link", name="New dataset").click()
    expect(page.get_by_role("heading", name="New dataset")).to_be_visible()
    expect(page.locator("#upload-fields")).to_be_enabled()  # upload.js is running
    page.fill("#id_upload-name", name)


def expect_manifest(page, expected):
    """The dataset page lists exactly these files ({path: local file}) with size and SHA-256."""
    rows = page.locator("#manifest tbody tr")
    expect(rows).to_have_count(len(expected))
    for path, local in expected.items():
        row = rows.filter(has=page.locator("td.path", has_text=re.compile(f"^{re.escape(path)}$")))
        expect(row).to_have_count(1)
        expect(row.locator("td.sha")).to_have_text(digest(local))
        expect(row.locator("td.num")).to_have_attribute("data-bytes", str(local.stat().st_size))


def test_upload_a_multi_file_dataset_and_watch_the_progress(page, files):
    log_in(page)
    new_dataset(page, "browser-set")
    page.fill("#id_upload-description", "uploaded by the browser test")
    page.set_input_files("#upload-files", [files["big"], files["small"]])
    page.set_input_files("#upload-folder", files["folder"])
    shot(page, "dataset-new.png")
    watch_progress(page)

    # The first try of the big file's second chunk is lost on the way: tried again, unseen.
    lost = []

    def lose_once(route):
        if chunk_offset(route.request.url) == CHUNK and not lost:
            lost.append(route.request.url)
            return route.abort("connectionreset")
        return route.continue_()

    page.route("**/api/datasets/uploads/**", lose_once)
    chunks = []
    page.on("request", lambda request: chunks.append(chunk_offset(request.url)) if is_chunk(request) else None)
    page.get_by_role("button", name="Upload and seal").click()

    done = page.locator("#upload-done")
    expect(done).to_contain_text("Version 1 is sealed: 4 files", timeout=60_000)
    assert lost, "the lost chunk was never asked for"
    expect(page.locator("#overall-text")).to_contain_text("(100%) · 4 of 4 files done")
    rows = page.locator(".upload-file")
    expect(rows).to_have_count(4)
    for path in ("big.bin", "labels.csv", "images/train/0.png", "images/readme.txt"):
        expect(page.locator(f".upload-file[data-path='{path}'] .status")).to_have_text("done")
    expect(page.locator(".upload-file[data-path='big.bin'] .amount")).to_have_text("12.0 MB of 12.0 MB (100%)")
    seen = page.evaluate("window.__seen")
    # The progress went through the big file's chunks, and the lost one was tried again.
    assert any(re.match(r"5\.\d MB of 12\.\d MB \(\d\d%\)", text) for text in seen), seen
    assert any(text.startswith("retrying in 0.5 s (try 2 of 5)") for text in seen), seen
    assert sorted(o for o in chunks if o) == [CHUNK, CHUNK, 2 * CHUNK]  # the lost chunk twice, no other
    shot(page, "dataset-uploaded.png")

    page.get_by_role("link", name="View the dataset").click()
    expect(page).to_have_url(DATASET_URL)
    expect(page.get_by_role("heading", level=1)).to_contain_text("browser-set")
    expect(page.locator("#versions")).to_contain_text("Ready")
    expect_manifest(
        page,
        {
            "big.bin": files["big"],
            "labels.csv": files["small"],
            "images/train/0.png": files["folder"] / "train" / "0.png",
            "images/readme.txt": files["folder"] / "readme.txt",
        },
    )
    shot(page, "dataset-page.png")

    # Add a file: version 2 holds version 1's files (shared) and the new one; only it goes up.
    page.get_by_role("button", name="Add files").click()
    expect(page.get_by_role("heading", level=1)).to_contain_text("Add files to browser-set")
    expect(page.locator("#version-files")).to_contain_text("big.bin")
    extra = files["small"].with_name("extra.csv")
    extra.write_bytes(b"more,rows\n1,2\n")
    page.set_input_files("#upload-files", [extra])
    shot(page, "dataset-add-files.png")
    page.get_by_role("button", name="Upload and seal").click()
    expect(page.locator("#upload-done")).to_contain_text("Version 2 is sealed: 5 files", timeout=60_000)
    expect(page.locator("#version-state")).to_have_text("v2 ready")
    page.get_by_role("link", name="View the dataset").click()
    expect(page.locator("#version-2")).to_contain_text("Ready")
    expect(page.locator("#version-2")).to_contain_text("from v1")
    expect_manifest(
        page,
        {
            "big.bin": files["big"],
            "labels.csv": files["small"],
            "images/train/0.png": files["folder"] / "train" / "0.png",
            "images/readme.txt": files["folder"] / "readme.txt",
            "extra.csv": extra,
        },
    )
    shot(page, "dataset-page-v2.png")

    page.get_by_role("navigation").get_by_role("link", name="Datasets").click()
    row = page.locator("#datasets tbody tr", has_text="browser-set")
    expect(row).to_contain_text("Uploaded")
    expect(row).to_contain_text("v2")
    expect(row.locator("td.num").first).to_have_text("5")
    shot(page, "datasets-list.png")


def start_and_break(page, files, name, let_through):
    """Start uploading files into a new dataset while the network drops every chunk of big.bin
    after the first let_through, until the page gives up and shows Retry."""
    log_in(page)
    new_dataset(page, name)
    page.set_input_files("#upload-files", [files["big"], files["small"]])

    def drop(route):
        offset = chunk_offset(route.request.url)
        if offset is not None and offset >= let_through * CHUNK:
            return route.abort("connectionreset")
        return route.continue_()

    page.route("**/api/datasets/uploads/**", drop)
    page.get_by_role("button", name="Upload and seal").click()
    error = page.locator("#upload-error")
    expect(error).to_be_visible(timeout=60_000)  # five tries, pausing 0.5 + 1 + 2 + 4 s
    expect(error).to_contain_text(f"big.bin: the chunk at {let_through * 5}.0 MB failed 5 times (the server could not be reached).")
    expect(page.get_by_role("button", name="Retry")).to_be_visible()
    expect(page.locator(".upload-file[data-path='big.bin'] .amount")).to_have_text(f"{let_through * 5}.0 MB of 12.0 MB ({let_through * 5 * 100 // 12}%)")
    expect(page.locator(".upload-file[data-path='labels.csv'] .status")).to_have_text("done")
    expect(page).to_have_url(UPLOAD_URL)  # a reload comes back to this version's upload
    page.unroute("**/api/datasets/uploads/**")


def test_a_failed_upload_continues_with_the_retry_button(page, files):
    start_and_break(page, files, "retried-set", let_through=1)
    shot(page, "dataset-upload-failed.png")
    chunks = []
    page.on("request", lambda request: chunks.append(chunk_offset(request.url)) if is_chunk(request) else None)
    page.get_by_role("button", name="Retry").click()
    expect(page.locator("#upload-done")).to_contain_text("Version 1 is sealed: 2 files", timeout=60_000)
    assert chunks == [CHUNK, 2 * CHUNK]  # from where it stopped
    page.get_by_role("link", name="View the dataset").click()
    expect_manifest(page, {"big.bin": files["big"], "labels.csv": files["small"]})


def test_an_interrupted_upload_resumes_after_a_reload(page, files):
    start_and_break(page, files, "resumed-set", let_through=2)

    # Gone: the page reloads (a closed tab, a crash). It comes back as this version's upload
    # page, which knows the unfinished upload; the same files picked again continue.
    page.reload()
    expect(page.get_by_role("heading", level=1)).to_contain_text("Add files to resumed-set")
    interrupted = page.locator("#interrupted")
    expect(interrupted).to_contain_text("1 upload stopped part-way.")
    expect(interrupted).to_contain_text("big.bin")
    expect(interrupted).to_contain_text("10.0 MB of 12.0 MB")
    expect(page.locator("#version-files")).to_contain_text("labels.csv")
    shot(page, "dataset-upload-interrupted.png")

    chunks = []
    page.on("request", lambda request: chunks.append(chunk_offset(request.url)) if is_chunk(request) else None)
    watch_progress(page)
    page.set_input_files("#upload-files", [files["big"], files["small"]])
    page.get_by_role("button", name="Upload and seal").click()
    expect(page.locator("#upload-done")).to_contain_text("Version 1 is sealed: 2 files", timeout=60_000)
    assert chunks == [2 * CHUNK], chunks  # only the missing 2 MiB went up
    seen = page.evaluate("window.__seen")
    assert "resumed at 10.0 MB" in seen and "done (sent before)" in seen, seen
    shot(page, "dataset-upload-resumed.png")

    page.get_by_role("link", name="View the dataset").click()
    expect_manifest(page, {"big.bin": files["big"], "labels.csv": files["small"]})
    expect(page.locator("#open-version")).to_have_count(0)


def test_a_taken_name_is_shown_on_its_field(page, files):
    log_in(page)
    new_dataset(page, "digits")  # the demo's
    page.set_input_files("#upload-files", [files["small"]])
    page.get_by_role("button", name="Upload and seal").click()
    expect(page.locator("#field-upload-name .error")).to_have_text("Your team already has a dataset named 'digits'.")
    expect(page.locator("#upload-error")).to_contain_text("The dataset was not created: see the fields above.")
    expect(page.get_by_role("button", name="Retry")).to_be_hidden()
    shot(page, "dataset-name-taken.png")
    # Fixed, it goes through.
    page.fill("#id_upload-name", "digits-labels")
    page.get_by_role("button", name="Upload and seal").click()
    expect(page.locator("#upload-done")).to_contain_text("Version 1 is sealed: 1 file", timeout=60_000)


def test_without_javascript_the_page_says_so(browser, system):
    context = browser.new_context(base_url=system.url, viewport={"width": 1280, "height": 900}, java_script_enabled=False)
    page = context.new_page()
    try:
        log_in(page)
        page.goto("/datasets/new/")
        expect(page.locator("#needs-js")).to_contain_text("Uploading needs JavaScript, which is off in this browser.")
        expect(page.get_by_role("button", name="Upload and seal")).to_be_disabled()
        expect(page.get_by_role("button", name="Register and scan")).to_be_enabled()  # a plain form
        shot(page, "dataset-new-without-js.png")
    finally:
        context.close()


def test_register_a_bucket_through_the_form(page):
    log_in(page)
    page.goto("/datasets/new/")
    page.fill("#id_s3-name", "lake")
    page.fill("#id_s3-uri", "https://not-s3/x")
    page.fill("#id_s3-access_key_id", "AKIAEXAMPLE")
    page.fill("#id_s3-secret_access_key", "very-secret-value")
    page.get_by_role("button", name="Register and scan").click()
    expect(page.locator("#field-s3-uri .error")).to_contain_text("Give the bucket as s3://bucket/prefix")
    expect(page.locator("#id_s3-secret_access_key")).to_have_value("")  # never sent back
    shot(page, "dataset-s3-refused.png")
    page.fill("#id_s3-uri", "s3://lake-bucket/train")
    page.fill("#id_s3-endpoint_url", "http://127.0.0.1:9")
    page.fill("#id_s3-secret_access_key", "very-secret-value")
    page.get_by_role("button", name="Register and scan").click()
    expect(page).to_have_url(DATASET_URL)
    expect(page.locator("#s3-uri")).to_have_text("s3://lake-bucket/train")
    expect(page.locator("#s3-credentials")).to_contain_text("Stored, encrypted")
    # The scheduler scans it: nothing listens on port 9, so the scan fails with the reason,
    # and the page (polling while it scans) shows it.
    expect(page.locator("#versions")).to_contain_text("Scan failed: the endpoint cannot be reached", timeout=60_000)
    assert "very-secret-value" not in page.content()
    shot(page, "dataset-s3-failed.png")
