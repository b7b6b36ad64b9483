// The new-job form's folder upload: a folder chosen (<input webkitdirectory>) or dropped goes up
// at once, resumably, through the folder API (jobs/folder_api.py), as a dataset's files do
// (upload.js): the page announces the files' paths and sizes (POST /api/folders/), then sends
// each file in chunks (PUT ?offset=N); a chunk that fails is sent again after a pause that
// doubles, and a 409 says where the server wants it. The form then carries only the folder's id
// (code_folder_upload, not its files), and the server packs the folder into the zip the job
// unpacks (jobs/folders.py). The folder's address is kept in localStorage, keyed by its files'
// paths, sizes and modification times: after a reload (or a connection lost for good) the same
// folder chosen again asks the server how far each file got and goes on from there. Sending the
// form before the folder has arrived waits for it, then sends it. A dropped folder is read with
// DataTransferItem.webkitGetAsEntry. Without JavaScript the folder field stays hidden and the
// single-file field works as it always did.
(function () {
  "use strict";

  const field = document.getElementById("field-code_folder");
  const input = document.getElementById("id_code_folder");
  if (!field || !input) return;
  const form = input.form;
  const single = document.getElementById("id_code");
  const zone = document.getElementById("folder-drop");
  const pathsBox = document.getElementById("folder-paths");
  const summary = document.getElementById("folder-summary");
  const errorBox = document.getElementById("folder-error");
  const entrypoint = document.getElementById("id_entrypoint");
  const progressBox = document.getElementById("folder-progress");
  const bar = document.getElementById("folder-bar");
  const statusText = document.getElementById("folder-status");
  const retryButton = document.getElementById("folder-retry");
  const foldersUrl = progressBox.dataset.foldersUrl;
  const csrf = (form.querySelector("[name=csrfmiddlewaretoken]") || {}).value || "";

  const SKIPPED = ["__pycache__", ".git", ".DS_Store"]; // as the server and `e31 submit` leave them out
  const RUNNABLE = /\.(py|sh)$/;
  const maxFiles = parseInt(input.dataset.maxFiles, 10) || Infinity;
  const maxEntries = parseInt(input.dataset.maxEntries, 10) || Infinity;
  const maxBytes = parseInt(input.dataset.maxBytes, 10) || Infinity;
  // The requests and their retries: static/js/chunks.js, shared with upload.js.
  const { MAX_TRIES, Refused, patiently: tried } = window.E31Chunks;
  const { request, json } = window.E31Chunks.client(csrf);
  const FILES_AT_ONCE = 3;
  const STORE = "e31-folder";

  // The folder being sent: {pairs, bytes, key, folder (as the API shows it), received (file id ->
  // bytes), done, failed, resumedAt, submitWhenDone, submitter}. Choosing another ends it.
  let current = null;
  // What the form sends instead of the files: the folder's id, once every byte has arrived.
  const reference = document.createElement("input");
  reference.type = "hidden";
  reference.name = "code_folder_upload";
  pathsBox.replaceChildren(reference);

  field.hidden = false;

  function sizeText(bytes) {
    // As Django's filesizeformat writes sizes on the pages.
    if (bytes < 1024) return bytes === 1 ? "1 byte" : `${bytes} bytes`;
    const units = ["KB", "MB", "GB", "TB"];
    let value = bytes / 1024;
    let unit = 0;
    while (value >= 1024 && unit < units.length - 1) {
      value /= 1024;
      unit += 1;
    }
    return `${value.toFixed(1)} ${units[unit]}`;
  }

  function skipped(path) {
    return path.split("/").some((part) => SKIPPED.includes(part));
  }

  // The paths as the job sees them: a browser starts each with the folder's own name
  // (myproj/src/train.py), which the server takes off when every path shares it.
  function relative(paths) {
    const tops = new Set(paths.map((path) => path.split("/")[0]));
    if (tops.size !== 1 || !paths.every((path) => path.includes("/"))) return { top: "", paths };
    const top = [...tops][0];
    return { top, paths: paths.map((path) => path.slice(top.length + 1)) };
  }

  function showError(message) {
    errorBox.textContent = message;
    errorBox.hidden = !message;
  }

  function clear(message) {
    current = null; // a folder still being sent stops at its next request
    reference.value = "";
    input.value = "";
    summary.textContent = "";
    progressBox.hidden = true;
    showError(message || "");
  }

  // A script named before stays; else train.py, or the only runnable file at the top.
  function suggestEntrypoint(paths) {
    if (!entrypoint || (entrypoint.value && entrypoint.value !== entrypoint.dataset.suggested)) return;
    const top = paths.filter((path) => !path.includes("/") && RUNNABLE.test(path));
    const choice = paths.includes("train.py") ? "train.py" : top.length === 1 ? top[0] : "";
    entrypoint.value = choice;
    entrypoint.dataset.suggested = choice;
  }

  // pairs: [[File, its path as the browser gave it (myproj/src/train.py)]]
  function use(pairs) {
    pairs = pairs.filter(([, path]) => !skipped(path));
    const bytes = pairs.reduce((sum, [file]) => sum + file.size, 0);
    if (!pairs.length) return clear("The folder has no files to send.");
    if (pairs.length > maxEntries) {
      return clear(`The folder has ${pairs.length} files, more than the ${maxEntries} an archive may hold.`);
    }
    if (bytes > maxBytes) return clear(`The folder holds ${sizeText(bytes)}, more than the ${sizeText(maxBytes)} a job's folder may hold.`);
    if (single) single.value = ""; // a folder or a single file, not both
    showError("");
    const { top, paths } = relative(pairs.map(([, path]) => path));
    const shown = paths.slice().sort();
    const more = shown.length > 12 ? `, and ${shown.length - 12} more` : "";
    const count = pairs.length === 1 ? "1 file" : `${pairs.length} files`;
    const listed = `${shown.slice(0, 12).join(", ")}${more}`;
    summary.textContent = `${top || "The folder"}: ${count}, ${sizeText(bytes)}, uploaded now and packed into a zip when the form is sent: ${listed}.`;
    suggestEntrypoint(paths);
    current = { pairs, bytes, key: storeKey(pairs), folder: null, received: new Map(), done: false, failed: null, resumedAt: 0 };
    reference.value = "";
    start(current);
  }

  // Sending it -------------------------------------------------------------------------------

  // The end of a folder replaced by another (E31Chunks.Refused: a refusal a retry cannot mend).
  class Stopped extends Error {}

  // One request, tried again after a network failure or a server error (E31Chunks.patiently),
  // for the folder being sent: a folder replaced by another stops at its next try.
  function patiently(state, what, send) {
    return tried(send, {
      what,
      check: () => {
        if (state !== current) throw new Stopped();
      },
      retrying: (text) => {
        if (state === current) statusText.textContent = `${what}: ${text}`;
      },
    });
  }

  // The key an upload of this very folder is kept under: its files' paths, sizes and times,
  // hashed (FNV-1a, twice 32 bits: a name, not a secret; the server's list is compared too).
  function storeKey(pairs) {
    const text = pairs.map(([file, path]) => `${path}\u0000${file.size}\u0000${file.lastModified}`).sort().join("\u0001");
    let first = 0x811c9dc5;
    let second = 0x01000193 ^ text.length;
    for (let i = 0; i < text.length; i += 1) {
      const code = text.charCodeAt(i);
      first = Math.imul(first ^ code, 16777619);
      second = Math.imul(second ^ code, 2246822519);
    }
    return `${STORE}|${(first >>> 0).toString(16)}${(second >>> 0).toString(16)}|${pairs.length}`;
  }

  function sameFiles(folder, pairs) {
    const sizes = new Map(pairs.map(([file, path]) => [path, file.size]));
    return folder.files.length === sizes.size && folder.files.every((f) => sizes.get(f.path) === f.size);
  }

  // The folder on the server: the one begun before for these very files (asked how far it got),
  // or a new one.
  async function resumeOrOpen(state) {
    const url = localStorage.getItem(state.key);
    if (url) {
      const answer = await patiently(state, "Asking how far the folder got", () => json("GET", url)).catch((error) => {
        if (error instanceof Refused) return null; // gone (404): start again
        throw error;
      });
      if (answer && answer.ok && answer.data.state !== "aborted" && sameFiles(answer.data, state.pairs)) return answer.data;
      localStorage.removeItem(state.key);
    }
    const files = state.pairs.map(([file, path]) => ({ path, size: file.size }));
    const answer = await patiently(state, "Starting the upload", () => json("POST", foldersUrl, { files }));
    localStorage.setItem(state.key, answer.data.url);
    return answer.data;
  }

  function arrived(state) {
    const files = state.folder ? state.folder.files : [];
    const bytes = files.reduce((sum, f) => sum + Math.min(f.size, state.received.get(f.id) || 0), 0);
    return { bytes, files: files.filter((f) => (state.received.get(f.id) || 0) >= f.size).length };
  }

  function showProgress(state) {
    if (state !== current) return;
    const { bytes, files } = arrived(state);
    const value = state.bytes ? Math.floor((100 * bytes) / state.bytes) : 100;
    bar.setAttribute("aria-valuenow", String(value));
    bar.firstElementChild.style.width = `${value}%`;
    const count = state.pairs.length;
    const resumed = state.resumedAt ? ` · resumed at ${sizeText(state.resumedAt)}` : "";
    if (state.done) {
      statusText.textContent = `Uploaded: ${sizeText(state.bytes)}, ${count === 1 ? "1 file" : `${count} files`}${resumed}. The form sends it by reference.`;
      return;
    }
    const waiting = state.submitWhenDone ? " · the form is sent once it has all arrived" : "";
    const doing = state.failed ? "Stopped" : "Uploading";
    statusText.textContent = `${doing}: ${sizeText(bytes)} of ${sizeText(state.bytes)} (${value}%) · ${files} of ${count} files arrived${resumed}${waiting}`;
  }

  async function send(state) {
    const folder = await resumeOrOpen(state);
    state.folder = folder;
    for (const f of folder.files) state.received.set(f.id, folder.state === "packed" ? f.size : f.received);
    state.resumedAt = arrived(state).bytes;
    showProgress(state);
    const files = new Map(state.pairs.map(([file, path]) => [path, file]));
    const waiting = folder.files.filter((f) => state.received.get(f.id) < f.size);
    let next = 0;
    async function worker() {
      while (next < waiting.length) {
        const entry = waiting[next];
        next += 1;
        const file = files.get(entry.path);
        let received = state.received.get(entry.id);
        let conflicts = 0;
        while (received < entry.size) {
          const offset = received;
          const chunk = file.slice(offset, Math.min(offset + entry.chunk_size, entry.size));
          const answer = await patiently(state, `${entry.path}: the chunk at ${sizeText(offset)}`, () =>
            request("PUT", `${entry.url}?offset=${offset}`, chunk, { "Content-Type": "application/octet-stream" }));
          received = answer.data.received; // a 409 too: where the server wants the next chunk
          conflicts = answer.ok ? 0 : conflicts + 1;
          if (conflicts >= MAX_TRIES) throw new Refused(answer.data.detail || `${entry.path}: the server keeps refusing its chunks.`);
          state.received.set(entry.id, received);
          showProgress(state);
        }
      }
    }
    // Several files at once (a folder of many small files is bound by round trips); the first
    // failure is reported once all have settled.
    const results = await Promise.allSettled(Array.from({ length: FILES_AT_ONCE }, worker));
    const failed = results.find((r) => r.status === "rejected");
    if (failed) throw failed.reason;
  }

  function start(state) {
    state.failed = null;
    retryButton.hidden = true;
    progressBox.hidden = false;
    showError("");
    showProgress(state);
    send(state).then(
      () => finished(state),
      (error) => stopped(state, error),
    );
  }

  function finished(state) {
    if (state !== current) return;
    state.done = true;
    reference.value = state.folder.id;
    showProgress(state);
    if (state.submitWhenDone) {
      state.submitWhenDone = false;
      form.requestSubmit(state.submitter || undefined);
    }
  }

  function stopped(state, error) {
    if (state !== current || error instanceof Stopped) return;
    state.failed = error;
    state.submitWhenDone = false;
    showProgress(state);
    const message = error && error.message ? error.message : String(error);
    if (error instanceof Refused) {
      showError(`The folder's upload was refused: ${message} Choose the folder again.`);
      return;
    }
    showError(`The folder's upload stopped: ${message} Retry: it goes on where it stopped.`);
    retryButton.hidden = false;
  }

  retryButton.addEventListener("click", () => current && !current.done && start(current));

  input.addEventListener("change", () => {
    const files = Array.from(input.files);
    if (!files.length) return clear();
    use(files.map((file) => [file, file.webkitRelativePath || file.name]));
  });

  if (single) single.addEventListener("change", () => single.files.length && clear());

  // Dropping: a folder's entries are walked (readEntries gives at most 100 at a time).
  function readAll(reader) {
    return new Promise((resolve, reject) => {
      const all = [];
      (function next() {
        reader.readEntries((batch) => {
          if (!batch.length) return resolve(all);
          all.push(...batch);
          next();
        }, reject);
      })();
    });
  }

  async function walk(entry, out) {
    if (entry.isFile) {
      const file = await new Promise((resolve, reject) => entry.file(resolve, reject));
      out.push([file, entry.fullPath.replace(/^\/+/, "")]);
    } else if (entry.isDirectory) {
      for (const child of await readAll(entry.createReader())) await walk(child, out);
    }
  }

  async function dropped(transfer) {
    // The entries are read now: the items are gone once the drop event returns.
    const items = Array.from(transfer.items || []).filter((item) => item.kind === "file");
    const entries = items.map((item) => (item.webkitGetAsEntry ? item.webkitGetAsEntry() : null)).filter(Boolean);
    if (entries.length === 1 && entries[0].isFile && single) {
      // One file: the script or archive field takes it.
      single.files = transfer.files;
      clear();
      single.dispatchEvent(new Event("change", { bubbles: true }));
      return;
    }
    if (!entries.length) {
      if (transfer.files && transfer.files.length) {
        showError("This browser cannot read a dropped folder: choose it with the button instead.");
      }
      return;
    }
    const pairs = [];
    try {
      for (const entry of entries) await walk(entry, pairs);
    } catch (error) {
      return clear(`The folder could not be read: ${error.message || error}.`);
    }
    use(pairs);
  }

  const idleBorder = zone.style.borderColor;
  zone.addEventListener("dragover", (event) => {
    event.preventDefault();
    zone.style.borderColor = "#2563eb";
  });
  zone.addEventListener("dragleave", () => (zone.style.borderColor = idleBorder));
  zone.addEventListener("drop", (event) => {
    event.preventDefault();
    zone.style.borderColor = idleBorder;
    dropped(event.dataTransfer);
  });

  form.addEventListener("submit", (event) => {
    if (current && !current.done) {
      // The form waits for the folder, and is sent once it has all arrived.
      event.preventDefault();
      current.submitWhenDone = true;
      current.submitter = event.submitter;
      if (current.failed) start(current);
      showProgress(current);
      field.scrollIntoView();
      return;
    }
    // Its files went up already: the form sends the folder's id alone.
    input.disabled = Boolean(current);
    // Django refuses a request with more files than it takes with a bare 400, the form lost:
    // so the page counts them all (the data's too) before sending.
    const inputs = Array.from(form.querySelectorAll("input[type=file]")).filter((element) => !element.disabled);
    const total = inputs.reduce((sum, element) => sum + element.files.length, 0);
    if (total > maxFiles) {
      event.preventDefault();
      input.disabled = false;
      showError(`The form holds ${total} files, more than the ${maxFiles} it may send at once: send the data as a dataset.`);
      field.scrollIntoView();
    }
  });
  // Back to the page (the browser's back button): the folder's field takes a folder again.
  window.addEventListener("pageshow", () => (input.disabled = false));
})();
