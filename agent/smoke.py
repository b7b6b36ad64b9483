"""A script's smoke run sees a sample of its data.

A built-in recipe cuts its own data (its `smoke` option); a script knows nothing of it, so the
runner cuts the staged inputs of a script's smoke run after staging and before the process
starts: 1% of the lines of a CSV or TSV file (its header line kept), a JSONL or a text file; of
each input's other files, 1%; at least one file and one data line. Which files and which lines
is decided by the pure functions here, seeded by the job's id, so a restarted smoke run sees the
same sample. `cut` writes the sample as new files in the job's own data folder: the staged files
there are hard links to the cache's blobs, which the full run stages again and must find whole.
"""

import os
import random
import tempfile
from pathlib import Path, PurePosixPath

PERCENT = 1
# Files cut by lines, and whether their first line is a header kept as it is.
LINE_FILES = {".csv": True, ".tsv": True, ".jsonl": False, ".ndjson": False, ".txt": False}
CHUNK = 1 << 20


def sample_size(total):
    """How many of total a smoke run keeps: 1%, rounded up; at least one (none of none)."""
    return min(total, max(1, -(-total * PERCENT // 100)))


def line_kind(path):
    """For a file cut by lines, whether its first line is a header; None for any other file."""
    return LINE_FILES.get(PurePosixPath(path).suffix.lower())


def input_of(dest):
    """The input a staged path (relative to the job's folder) belongs to: data/<input>/...;
    None for the code, the models and anything else that is not data."""
    parts = PurePosixPath(dest).parts
    return parts[1] if len(parts) > 2 and parts[0] == "data" else None


def choose_files(dests, seed):
    """Of the staged paths, those a smoke run drops: of each input's files that are not cut by
    lines, all but 1% (at least one kept), chosen at random, the same for the same seed."""
    others = {}
    for dest in dests:
        name = input_of(dest)
        if name is not None and line_kind(dest) is None:
            others.setdefault(name, []).append(dest)
    dropped = set()
    for name, paths in sorted(others.items()):
        paths = sorted(paths)
        kept = set(random.Random(f"{seed}:{name}").sample(paths, sample_size(len(paths))))
        dropped.update(path for path in paths if path not in kept)
    return dropped


def choose_lines(count, header, seed):
    """The lines (0-based, in order) a smoke run keeps of a file of count lines: the header,
    where it has one, and 1% of the others (at least one), chosen at random, the same for the
    same seed."""
    first = min(count, 1) if header else 0
    picked = random.Random(str(seed)).sample(range(first, count), sample_size(count - first))
    return [*range(first), *sorted(picked)]


def count_lines(path):
    """Lines of a file, the last counted even without its newline (read in chunks: a file may
    be one long line)."""
    count, last = 0, b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            count += chunk.count(b"\n")
            last = chunk[-1:]
    return count + (last != b"\n")


def copy_lines(source, target, lines):
    """The lines (sorted indexes) of the file source written to the open file target, each as it
    is (its newline, or none for a last line without one)."""
    wanted = iter(lines)
    want, line = next(wanted, None), 0
    with open(source, "rb") as f:
        while want is not None and (chunk := f.read(CHUNK)):
            start = 0
            while want is not None and start < len(chunk):
                end = chunk.find(b"\n", start)
                stop = len(chunk) if end < 0 else end + 1
                if line == want:
                    target.write(chunk[start:stop])
                if end < 0:
                    break  # the line goes on in the next chunk
                if line == want:
                    want = next(wanted, None)
                line, start = line + 1, stop


def cut(root, dests, seed):
    """Cut the staged data of a smoke run in the job's folder root (dests: the staged paths,
    relative to it). A dropped file's link goes; a file cut by lines is replaced by a new file
    (the cached blob it was linked to is never written). Returns {input: [files kept, files,
    lines kept, lines]}, lines of the files cut by lines."""
    root = Path(root)
    dropped = choose_files(dests, seed)
    summary = {}
    for dest in sorted(dests):
        name = input_of(dest)
        if name is None:
            continue
        counts = summary.setdefault(name, [0, 0, 0, 0])
        counts[1] += 1
        path = root / dest
        if dest in dropped:
            path.unlink()
            continue
        counts[0] += 1
        header = line_kind(dest)
        if header is None:
            continue
        total = count_lines(path)
        lines = choose_lines(total, header, f"{seed}:{dest}")
        counts[2] += len(lines)
        counts[3] += total
        if len(lines) < total:
            fd, partial = tempfile.mkstemp(dir=path.parent, prefix=".smoke-")
            try:
                with open(fd, "wb") as target:
                    copy_lines(path, target, lines)
                os.chmod(partial, 0o444)  # as the cache's files: the job's uid reads it
                os.replace(partial, path)  # the link to the blob goes; the blob stays whole
            except BaseException:
                os.unlink(partial)
                raise
    return summary


def describe(summary):
    """The sample, for the job's log: "train: 1 of 1 file, 11 of 1001 lines; ..."."""
    parts = []
    for name, (kept, files, lines, total) in sorted(summary.items()):
        text = f"{name}: {kept} of {files} file{'s' if files != 1 else ''}"
        if total:
            text += f", {lines} of {total} lines"
        parts.append(text)
    return "; ".join(parts) or "no data"
