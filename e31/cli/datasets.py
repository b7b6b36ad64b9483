"""`e31 datasets upload DIR`: a folder into a dataset's open version, chunk by chunk, resumable.

Run again after a break (Ctrl-C, a lost network), it continues where it stopped: files the
version already holds with the same SHA-256 are skipped, and a file whose upload was under way
continues from the bytes the server says it has received (the open version lists its
unfinished uploads). Chunks that fail with 503 or a network error are sent again.
"""

import hashlib
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from e31.cli.errors import JOB_FAILED, SERVER, USAGE, CliError
from e31.cli.spec import files_of

if TYPE_CHECKING:
    from e31.cli.client import Client
    from e31.cli.ui import ProgressBar

T = TypeVar("T")

RETRIES = 6
COMPLETION_POLL_SECONDS = 2


def sha256_of(path: str | os.PathLike[str]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1024 * 1024), b""):
            digest.update(block)
    return digest.hexdigest()


def local_manifest(folder: str | os.PathLike[str]) -> list[dict[str, Any]]:
    folder = Path(folder)
    if not folder.is_dir():
        raise CliError(f"{folder} is not a folder.", USAGE)
    files = [{"path": name, "size": path.stat().st_size, "sha256": sha256_of(path), "local": path} for name, path in files_of(folder)]
    if not files:
        raise CliError(f"{folder} holds no files to upload.", USAGE)
    return files


def stop_after_chunks() -> int | None:
    """A test hook: E31_CLI_STOP_AFTER_CHUNKS=N stops (as Ctrl-C would) after N chunks."""
    value = os.environ.get("E31_CLI_STOP_AFTER_CHUNKS", "")
    return int(value) if value.isdigit() else None


class Uploader:
    def __init__(self, client: "Client", sleep: Callable[[float], None] = time.sleep, say: Callable[[str], None] | None = None) -> None:
        self.client = client
        self.sleep = sleep
        self.say = say or (lambda text: None)
        self.sent_bytes = 0  # chunk bytes sent by this run
        self.resumed_bytes = 0  # bytes the server already had for uploads under way
        self.skipped_files: list[str] = []  # already in the version
        self.resumed_files: list[str] = []
        self.chunks_sent = 0
        self.stop_after = stop_after_chunks()

    # The dataset and its open version ----------------------------------------------------

    def find_dataset(self, name: str) -> dict[str, Any] | None:
        for dataset in self.client.pages("/api/datasets/"):
            if dataset.get("name") == name:
                return dataset
        return None

    def dataset(self, name: str) -> tuple[dict[str, Any], bool]:
        found = self.find_dataset(name)
        if found is not None:
            return found, False
        return self.client.post("/api/datasets/", json={"name": name}), True

    def open_version(self, dataset: dict[str, Any]) -> dict[str, Any]:
        return self.client.post(f"/api/datasets/{dataset['id']}/versions/")

    # Files --------------------------------------------------------------------------------

    def upload(self, folder: str | os.PathLike[str], name: str, bar: "ProgressBar") -> dict[str, Any]:
        files = local_manifest(folder)
        total = sum(f["size"] for f in files)
        bar.update(total=total)
        dataset, created = self.dataset(name)
        if dataset.get("source") not in (None, "upload"):
            raise CliError(f"Dataset {name} is a registered bucket: it changes by scanning it again, not by uploads.", USAGE)
        latest = dataset.get("latest_version")
        if not created and dataset.get("open_version") is None and latest is not None:
            ready = self.client.get(f"/api/datasets/{dataset['id']}/versions/{latest}/")
            if ready.get("state") == "ready" and self.holds_all(ready, files):
                bar.advance(total)
                self.skipped_files = [f["path"] for f in files]
                return self.result(dataset, ready, files, up_to_date=True)
        version = self.open_version(dataset)
        number = version["number"]
        have = {f["path"]: f for f in version.get("manifest", [])}
        under_way = {u["path"]: u for u in version.get("uploads", []) if u.get("state") in ("open", "completing")}
        for entry in files:
            kept = have.get(entry["path"])
            if kept and kept.get("sha256") == entry["sha256"] and kept.get("size") == entry["size"]:
                self.skipped_files.append(entry["path"])
                bar.advance(entry["size"])
                continue
            upload = under_way.get(entry["path"])
            if not (upload and upload.get("size") == entry["size"] and upload.get("sha256") in (None, "", entry["sha256"])):
                upload = self.client.post(
                    f"/api/datasets/{dataset['id']}/versions/{number}/uploads/",
                    json={"path": entry["path"], "size": entry["size"], "sha256": entry["sha256"]},
                )
            elif upload.get("received"):
                self.resumed_files.append(entry["path"])
                self.resumed_bytes += upload["received"]
                self.say(f"resuming {entry['path']} at {upload['received']:,} of {entry['size']:,} bytes")
            self.send(upload, entry, bar)
        sealed = self.client.post(f"/api/datasets/{dataset['id']}/versions/{number}/seal/")
        return self.result(dataset, sealed, files)

    @staticmethod
    def holds_all(version: dict[str, Any], files: list[dict[str, Any]]) -> bool:
        manifest = {f["path"]: (f.get("size"), f.get("sha256")) for f in version.get("manifest", [])}
        return all(manifest.get(f["path"]) == (f["size"], f["sha256"]) for f in files)

    def send(self, upload: dict[str, Any], entry: dict[str, Any], bar: "ProgressBar") -> None:
        """The chunks of one file from what the server has, then complete it."""
        size, chunk_size = entry["size"], int(upload["chunk_size"])
        offset = int(upload.get("received") or 0)
        offset -= offset % chunk_size if offset < size else 0
        bar.advance(offset)
        with open(entry["local"], "rb") as f:
            while offset < size:
                f.seek(offset)
                data = f.read(min(chunk_size, size - offset))
                received = self.put_chunk(upload, offset, data)
                bar.advance(received - offset)
                offset = received
        done = self.retrying(lambda: self.client.post(upload_path(upload) + "complete/", json={"sha256": entry["sha256"]}))
        # A large file is completed by the server after the request (202, "completing"): wait for it.
        reopened = 0
        while isinstance(done, dict) and done.get("state") == "completing":
            self.sleep(COMPLETION_POLL_SECONDS)
            done = self.retrying(lambda: self.client.get(upload_path(upload)))
            if done.get("state") == "open":  # storage failed on the server's side: complete it again
                reopened += 1
                if reopened >= RETRIES:
                    raise CliError(f"{entry['path']}: the server failed to complete it {RETRIES} times ({done.get('error')}); run the upload again", SERVER)
                done = self.retrying(lambda: self.client.post(upload_path(upload) + "complete/", json={"sha256": entry["sha256"]}))
        if isinstance(done, dict) and done.get("state") == "failed":
            raise CliError(f"{entry['path']}: {done.get('error') or 'the server could not complete the upload'}", JOB_FAILED)

    def put_chunk(self, upload: dict[str, Any], offset: int, data: bytes) -> int:
        """Send one chunk; returns how far the upload has arrived."""
        path = upload_path(upload)
        for attempt in range(RETRIES):
            try:
                answer = self.client.json(
                    "PUT",
                    path,
                    params={"offset": offset},
                    content=data,
                    headers={"Content-Type": "application/octet-stream"},
                )
            except CliError as error:
                if error.status == 409 and isinstance(error.body, dict) and isinstance(error.body.get("received"), int):
                    return error.body["received"]  # the server has more (or less): go on from there
                if not retriable(error) or attempt == RETRIES - 1:
                    raise
                self.say(f"chunk at {offset:,} of {upload['path']} failed ({error.message.splitlines()[0]}); sending it again")
                self.sleep(min(2**attempt * 0.5, 10))
                continue
            self.sent_bytes += len(data)
            self.chunks_sent += 1
            if self.stop_after is not None and self.chunks_sent >= self.stop_after:
                raise KeyboardInterrupt
            return int(answer.get("received", offset + len(data)))
        raise CliError("unreachable", SERVER)

    def retrying(self, call: Callable[[], T]) -> T:
        for attempt in range(RETRIES):
            try:
                return call()
            except CliError as error:
                if not retriable(error) or attempt == RETRIES - 1:
                    raise
                self.sleep(min(2**attempt * 0.5, 10))
        raise CliError("unreachable", SERVER)

    def result(self, dataset: dict[str, Any], version: dict[str, Any], files: list[dict[str, Any]], up_to_date: bool = False) -> dict[str, Any]:
        return {
            "dataset": dataset.get("name"),
            "dataset_id": dataset.get("id"),
            "version": version.get("number"),
            "state": version.get("state"),
            "ref": f"{dataset.get('name')}@{version.get('number')}",
            "up_to_date": up_to_date,
            "files": len(files),
            "bytes": sum(f["size"] for f in files),
            "sent_bytes": self.sent_bytes,
            "resumed_bytes": self.resumed_bytes,
            "skipped_files": self.skipped_files,
            "resumed_files": self.resumed_files,
            "manifest": version.get("manifest", []),
        }


def upload_path(upload: dict[str, Any]) -> str:
    return f"/api/datasets/uploads/{upload['id']}/"


def retriable(error: CliError) -> bool:
    """Storage trouble (503), a server error or a lost connection: worth sending again."""
    return error.code == SERVER
