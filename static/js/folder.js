// The new-job form's folder upload: a folder chosen (<input webkitdirectory>) or dropped is sent
// as its files, each with its path in a hidden `code_paths` input, in the same order as the
// files (Django keeps only a file's bare name); the server packs them into a zip the job unpacks
// (jobs/folders.py). A dropped folder is read with DataTransferItem.webkitGetAsEntry. Without
// JavaScript the folder field stays hidden and the single-file field works as it always did.
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

  const SKIPPED = ["__pycache__", ".git", ".DS_Store"]; // as the server and `e31 submit` leave them out
  const RUNNABLE = /\.(py|sh)$/;
  const maxFiles = parseInt(input.dataset.maxFiles, 10) || Infinity;
  const maxBytes = parseInt(input.dataset.maxBytes, 10) || Infinity;

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
    input.value = "";
    pathsBox.replaceChildren();
    summary.textContent = "";
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
    if (pairs.length > maxFiles) {
      return clear(
        `The folder has ${pairs.length} files, more than the ${maxFiles} one form may send: ` +
          "zip it and send the archive, or use e31 submit, which packs a folder.",
      );
    }
    if (bytes > maxBytes) return clear(`The folder holds ${sizeText(bytes)}, more than the ${sizeText(maxBytes)} a job's folder may hold.`);
    const transfer = new DataTransfer();
    const hidden = pairs.map(([file, path]) => {
      transfer.items.add(file);
      const element = document.createElement("input");
      element.type = "hidden";
      element.name = "code_paths";
      element.value = path;
      return element;
    });
    input.files = transfer.files;
    pathsBox.replaceChildren(...hidden);
    if (single) single.value = ""; // a folder or a single file, not both
    showError("");
    const { top, paths } = relative(pairs.map(([, path]) => path));
    const shown = paths.slice().sort();
    const more = shown.length > 12 ? `, and ${shown.length - 12} more` : "";
    const count = pairs.length === 1 ? "1 file" : `${pairs.length} files`;
    const listed = `${shown.slice(0, 12).join(", ")}${more}`;
    summary.textContent = `${top || "The folder"}: ${count}, ${sizeText(bytes)}, packed into a zip when the form is sent: ${listed}.`;
    suggestEntrypoint(paths);
  }

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

  // Django refuses a request with more files than it takes with a bare 400, the form lost:
  // so the page counts them all (the data's too) before sending.
  form.addEventListener("submit", (event) => {
    const total = Array.from(form.querySelectorAll("input[type=file]")).reduce((sum, element) => sum + element.files.length, 0);
    if (total > maxFiles) {
      event.preventDefault();
      showError(`The form holds ${total} files, more than the ${maxFiles} it may send at once: zip the folder, or send the data as a dataset.`);
      field.scrollIntoView();
    }
  });
})();
