// Uploads files into a dataset version in chunks, through the chunk API (catalog/api.py).
//
// Each file is started (POST .../uploads/ -> id, chunk_size, received), sent a chunk at a time
// (PUT ?offset=N), and completed; when every file is done the version is sealed. A large file
// is completed by the server after the request (202, "completing"): the page shows it verifying
// and asks for the upload every POLL_MS until it is complete or failed. A chunk that
// fails is sent again after a pause that doubles; after MAX_TRIES the error is shown with a
// Retry button. Upload ids are kept in localStorage, keyed by (version, path, size,
// lastModified): after a reload the user picks the same files again and each continues from
// the server's `received` instead of starting over.
(function () {
  "use strict";

  const form = document.getElementById("uploader");
  if (!form) return;

  // The requests and their retries: static/js/chunks.js, shared with folder.js.
  const { MAX_TRIES, Refused, Unreachable, sleep, patiently: tried } = window.E31Chunks;
  const { request, json } = window.E31Chunks.client(form.dataset.csrf);
  const FILES_AT_ONCE = 3;
  const POLL_MS = 1500;
  const STORE = "e31-upload";

  const fields = form.querySelector("#upload-fields");
  const progress = form.querySelector("#upload-progress");
  const list = form.querySelector("#upload-list");
  const overallBar = form.querySelector("#overall-bar");
  const overallText = form.querySelector("#overall-text");
  const errorBox = form.querySelector("#upload-error");
  const retryButton = form.querySelector("#upload-retry");
  const doneBox = form.querySelector("#upload-done");

  let version = null; // the open version, as the API shows it
  let datasetPage = form.dataset.datasetPage || null;
  let entries = [];
  let running = false;

  fields.disabled = false;

  function sizeText(bytes) {
    // As Django's filesizeformat writes sizes on the pages.
    if (bytes < 1024) return bytes === 1 ? "1 byte" : `${bytes} bytes`;
    const units = ["KB", "MB", "GB", "TB", "PB"];
    let value = bytes / 1024;
    let unit = 0;
    while (value >= 1024 && unit < units.length - 1) {
      value /= 1024;
      unit += 1;
    }
    return `${value.toFixed(1)} ${units[unit]}`;
  }

  function percent(done, total) {
    return total ? Math.floor((100 * done) / total) : 100;
  }

  // One request, tried again after a network failure or a server error (E31Chunks.patiently):
  // the file's row shows the retries; a refusal gives the server's reason, or its first field error.
  function patiently(entry, what, send) {
    return tried(send, {
      what,
      name: entry ? `${entry.path}: ${what}` : capitalized(what),
      reason: (data) => data.detail || firstError(data),
      retrying: entry ? (text) => setStatus(entry, text, "retrying") : null,
      recovered: entry ? () => setStatus(entry, "uploading") : null,
    });
  }

  function capitalized(text) {
    return text.charAt(0).toUpperCase() + text.slice(1);
  }

  function firstError(data) {
    const errors = data && data.errors;
    if (!errors) return "";
    const field = Object.keys(errors)[0];
    return field ? `${field}: ${errors[field][0]}` : "";
  }

  // The files chosen -------------------------------------------------------------------------

  function chosenFiles() {
    const byPath = new Map();
    for (const input of [form.querySelector("#upload-files"), form.querySelector("#upload-folder")]) {
      for (const file of input.files || []) {
        byPath.set(file.webkitRelativePath || file.name, file);
      }
    }
    return [...byPath].map(([path, file]) => ({ path, file, received: 0, done: false, row: null }));
  }

  function storeKey(entry) {
    return [STORE, version.url, entry.path, entry.file.size, entry.file.lastModified].join("|");
  }

  function render() {
    list.replaceChildren();
    for (const entry of entries) {
      const row = document.createElement("li");
      row.className = "upload-file";
      row.dataset.path = entry.path;
      row.innerHTML = '<div class="line"><span class="mono small name"></span> <span class="small status"></span></div>' +
        '<div class="bar" role="progressbar" aria-valuemin="0" aria-valuemax="100" aria-valuenow="0"><span></span></div>' +
        '<div class="muted small amount"></div>';
      row.querySelector(".name").textContent = entry.path;
      row.querySelector(".bar").setAttribute("aria-label", entry.path);
      entry.row = row;
      list.append(row);
      setStatus(entry, entry.done ? "done" : "waiting", entry.done ? "done" : "");
      show(entry);
    }
    progress.hidden = false;
    showOverall();
  }

  function setBar(bar, value) {
    bar.setAttribute("aria-valuenow", String(value));
    bar.firstElementChild.style.width = `${value}%`;
  }

  function show(entry) {
    const size = entry.file.size;
    setBar(entry.row.querySelector(".bar"), percent(entry.received, size));
    entry.row.querySelector(".amount").textContent = `${sizeText(entry.received)} of ${sizeText(size)} (${percent(entry.received, size)}%)`;
  }

  function showOverall() {
    const total = entries.reduce((sum, e) => sum + e.file.size, 0);
    const done = entries.reduce((sum, e) => sum + e.received, 0);
    const files = entries.filter((e) => e.done).length;
    // Every byte sent is not every file kept: 100% only once the server has completed them all.
    const value = files === entries.length ? percent(done, total) : Math.min(99, percent(done, total));
    setBar(overallBar, value);
    overallText.textContent = `${sizeText(done)} of ${sizeText(total)} (${value}%) · ${files} of ${entries.length} file${entries.length === 1 ? "" : "s"} done`;
  }

  function setStatus(entry, text, kind) {
    const status = entry.row.querySelector(".status");
    status.textContent = text;
    entry.row.dataset.state = kind || "";
  }

  function progressed(entry, received) {
    entry.received = received;
    show(entry);
    showOverall();
  }

  // The version ------------------------------------------------------------------------------

  async function openVersion() {
    if (form.dataset.versionUrl) {
      const answer = await patiently(null, "reading the version", () => json("GET", form.dataset.versionUrl));
      if (answer.data.state !== "open") throw new Refused(`Version ${answer.data.number} is ${answer.data.state}: it cannot change.`);
      return answer.data;
    }
    const payload = { name: form.querySelector("[name='upload-name']").value, description: form.querySelector("[name='upload-description']").value };
    const answer = await json("POST", form.dataset.createUrl, payload);
    clearFieldErrors();
    if (answer.status === 400 && answer.data.errors) {
      showFieldErrors(answer.data.errors);
      throw new Refused("The dataset was not created: see the fields above.");
    }
    if (!answer.ok) throw new Refused(answer.data.detail || `The dataset was not created (HTTP ${answer.status}).`);
    datasetPage = answer.data.page;
    const created = answer.data.versions[0];
    // From now on this is an upload into that version: a reload comes back to its page, where
    // the same files picked again continue.
    history.replaceState(null, "", created.upload_page);
    form.dataset.versionUrl = created.url;
    hide("s3-card"); // the other way to make a dataset: not this one any more
    const naming = form.querySelector("#upload-naming");
    if (naming) {
      const note = document.createElement("p");
      note.id = "upload-target";
      note.innerHTML = "Uploading into <strong></strong>, version 1.";
      note.querySelector("strong").textContent = answer.data.name;
      naming.replaceWith(note);
    }
    return created;
  }

  function clearFieldErrors() {
    for (const box of form.querySelectorAll(".field-errors")) box.replaceChildren();
    for (const field of form.querySelectorAll(".field.has-error")) field.classList.remove("has-error");
  }

  function showFieldErrors(errors) {
    for (const [name, messages] of Object.entries(errors)) {
      const field = form.querySelector(`#field-upload-${name}`);
      if (!field) continue;
      field.classList.add("has-error");
      for (const message of messages) {
        const div = document.createElement("div");
        div.className = "error";
        div.setAttribute("role", "alert");
        div.textContent = message;
        field.querySelector(".field-errors").append(div);
      }
    }
  }

  // One file ---------------------------------------------------------------------------------

  async function resumable(entry) {
    // An upload of this very file (same path, size and modification time) begun before?
    const key = storeKey(entry);
    const url = localStorage.getItem(key);
    if (url) {
      const answer = await patiently(entry, "asking how far it got", () => json("GET", url)).catch((error) => {
        if (error instanceof Refused) return null; // gone (404): start again
        throw error;
      });
      if (answer && ["open", "completing", "complete"].includes(answer.data.state)) return answer.data;
      localStorage.removeItem(key);
    }
    const started = await patiently(entry, "starting", () => json("POST", version.uploads_url, { path: entry.path, size: entry.file.size }));
    localStorage.setItem(key, started.data.url);
    return started.data;
  }

  async function send(entry) {
    setStatus(entry, "starting", "active");
    const upload = await resumable(entry);
    if (upload.state === "complete") {
      progressed(entry, entry.file.size);
      entry.done = true;
      setStatus(entry, "done (sent before)", "done");
      showOverall();
      return;
    }
    progressed(entry, upload.received);
    setStatus(entry, upload.received ? `resumed at ${sizeText(upload.received)}` : "uploading", "active");
    const size = entry.file.size;
    let state = upload.state;
    let reopened = 0;
    for (;;) {
      if (state === "complete") break;
      if (state === "completing") {
        const now = await verified(entry, upload);
        state = now.state;
        if (state === "open") {
          // Storage failed on the server's side while completing: the upload is kept, complete it again.
          reopened += 1;
          if (reopened >= MAX_TRIES) throw new Unreachable(`${entry.path}: completing failed ${MAX_TRIES} times (${now.error || "the server could not keep it"}).`);
          progressed(entry, now.received);
        }
        continue;
      }
      if (entry.received < size) {
        const offset = entry.received;
        const chunk = entry.file.slice(offset, Math.min(offset + upload.chunk_size, size));
        const answer = await patiently(entry, `the chunk at ${sizeText(offset)}`, () =>
          request("PUT", `${upload.url}?offset=${offset}`, chunk, { "Content-Type": "application/octet-stream" }));
        progressed(entry, answer.data.received);
        continue;
      }
      setStatus(entry, "checking", "active");
      const answer = await patiently(entry, "completing", () => json("POST", upload.complete_url, {}));
      if (!answer.ok) {
        progressed(entry, answer.data.received); // the server is missing some: send them
        continue;
      }
      state = answer.data.state; // complete, or completing (202): verified next
    }
    entry.done = true;
    setStatus(entry, "done", "done");
    showOverall();
  }

  // A file the server completes after the request: its upload asked for until it is complete
  // (or open again, after storage trouble there); failed is the reason, shown like any other.
  async function verified(entry, upload) {
    for (;;) {
      setStatus(entry, "verifying…", "active");
      await sleep(POLL_MS);
      const answer = await patiently(entry, "verifying", () => json("GET", upload.url));
      const now = answer.data;
      if (now.state === "completing") continue;
      if (now.state === "complete" || now.state === "open") return now;
      const reason = now.error || `the upload is ${now.state}`; // the path before it, if not there (sendAll)
      throw new Refused(reason.endsWith(".") ? reason : `${reason}.`);
    }
  }

  // All of them ------------------------------------------------------------------------------

  async function sendAll() {
    const waiting = entries.filter((e) => !e.done);
    let next = 0;
    async function worker() {
      while (next < waiting.length) {
        const entry = waiting[next];
        next += 1;
        try {
          await send(entry);
        } catch (error) {
          setStatus(entry, "stopped", "failed");
          if (error instanceof Refused && !error.message.startsWith(entry.path)) error.message = `${entry.path}: ${error.message}`;
          throw error;
        }
      }
    }
    // Every file is given its chance; the first failure is reported once all have settled.
    const results = await Promise.allSettled(Array.from({ length: FILES_AT_ONCE }, worker));
    const failed = results.find((r) => r.status === "rejected");
    if (failed) throw failed.reason;
  }

  async function seal() {
    const answer = await patiently(null, "sealing the version", () => json("POST", version.seal_url, {}));
    if (!answer.ok) throw new Refused(answer.data.detail || "The version could not be sealed.");
    for (const key of Object.keys(localStorage)) {
      if (key.startsWith(`${STORE}|${version.url}|`)) localStorage.removeItem(key);
    }
    return answer.data;
  }

  async function run(again) {
    if (running) return;
    if (!again) {
      const chosen = chosenFiles();
      if (!chosen.length) {
        fail(new Refused("Choose the files to upload first."), false);
        return;
      }
      entries = chosen;
    }
    running = true;
    errorBox.hidden = true;
    fields.disabled = true;
    try {
      version = version || (await openVersion());
      hide("interrupted"); // its files are shown with their progress now
      render();
      await sendAll();
      const sealed = await seal();
      done(sealed);
    } catch (error) {
      fail(error, Boolean(version));
    } finally {
      running = false;
    }
  }

  function done(sealed) {
    const files = sealed.files;
    doneBox.innerHTML = "<strong></strong> <a id='upload-dataset-link'>View the dataset</a>";
    doneBox.querySelector("strong").textContent =
      `Version ${sealed.number} is sealed: ${files} file${files === 1 ? "" : "s"}, ${sizeText(sealed.bytes)}, ready for jobs.`;
    doneBox.querySelector("a").href = datasetPage || "/datasets/";
    doneBox.hidden = false;
    fields.hidden = true;
    hide("version-files"); // what the version held before: stale now
    const badge = document.getElementById("version-state");
    if (badge) {
      badge.textContent = `v${sealed.number} ready`;
      badge.className = "state state-ready";
    }
  }

  function hide(id) {
    const element = document.getElementById(id);
    if (element) element.hidden = true;
  }

  function fail(error, retryable) {
    errorBox.querySelector(".message").textContent = error && error.message ? error.message : String(error);
    retryButton.hidden = !retryable || !entries.length;
    errorBox.hidden = false;
    // The files can be chosen again (and the name fixed, before the dataset exists).
    fields.disabled = false;
  }

  form.addEventListener("submit", (event) => {
    event.preventDefault();
    run(false);
  });
  retryButton.addEventListener("click", () => run(true));
})();
