"""The local files a job spec names, with the line each is named on.

The server parses and checks the spec; the client only finds what it must upload:
work.code, data.train_files, data.heldout_files, data.base_model and each named input's
data.inputs.<name>.files, each absent, a string or a list of strings, relative to the spec
file's folder.
"""

import io
import json
import os
import tarfile
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import yaml

from e31.cli.errors import USAGE, CliError

# (section, key) -> the multipart field the files go in.
LOCAL_FIELDS = {
    ("work", "code"): "code",
    ("data", "train_files"): "data",
    ("data", "heldout_files"): "heldout",
    ("data", "base_model"): "base_model",
}


@dataclass
class LocalRef:
    field: str  # the form field: code, data, heldout, base_model
    text: str  # the path as written
    line: int  # 1-based line of the spec it is written on
    path: Path  # resolved against the spec's folder


def line_of(node: yaml.Node) -> int:
    return node.start_mark.line + 1


def mapping_get(node: yaml.Node | None, key: str) -> yaml.Node | None:
    """The value node under key in a YAML mapping node, or None."""
    if not isinstance(node, yaml.MappingNode):
        return None
    for key_node, value_node in node.value:
        if isinstance(key_node, yaml.ScalarNode) and key_node.value == key:
            return value_node
    return None


MAX_DEPTH = 32  # as the server's (jobs.specfile): mappings and lists inside each other


class SpecLoader(yaml.SafeLoader):
    """What the server refuses, refused before any file is uploaded: YAML anchors and aliases
    (a few lines of them expand to gigabytes), and nesting past MAX_DEPTH."""

    depth = 0

    def compose_node(self, parent: yaml.Node | None, index: object) -> yaml.Node | None:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
            raise yaml.composer.ComposerError(None, None, "YAML anchors and aliases are not accepted: write each value out", event.start_mark)
        nests = isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent))
        self.depth += nests
        if self.depth > MAX_DEPTH:
            raise yaml.composer.ComposerError(None, None, f"nested too deeply (more than {MAX_DEPTH} levels)", event.start_mark)
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= nests


def compose(text: str, spec_name: str) -> yaml.Node | None:
    try:
        return yaml.compose(text, Loader=SpecLoader)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error)
        raise CliError(f"{spec_name}{where}: not valid YAML or JSON: {problem}", USAGE) from None


def local_refs(text: str, spec_name: str, base_dir: str | os.PathLike[str]) -> list[LocalRef]:
    """Every local file or folder the spec names, in order, as LocalRefs."""
    root = compose(text, spec_name)
    if root is None:
        raise CliError(f"{spec_name}: the spec is empty.", USAGE)
    if not isinstance(root, yaml.MappingNode):
        raise CliError(f"{spec_name} line {line_of(root)}: the spec must be a mapping (name: ..., work: ..., ...).", USAGE)
    refs: list[LocalRef] = []
    places = [((section, key), field, mapping_get(mapping_get(root, section), key)) for (section, key), field in LOCAL_FIELDS.items()]
    # A named input's files (data.inputs.<name>.files) go in the field input:<name>.
    inputs = mapping_get(mapping_get(root, "data"), "inputs")
    for name_node, value_node in inputs.value if isinstance(inputs, yaml.MappingNode) else []:
        places.append((("data", f"inputs.{name_node.value}.files"), f"input:{name_node.value}", mapping_get(value_node, "files")))
    for (section, key), field, node in places:
        if node is None:
            continue
        values = node.value if isinstance(node, yaml.SequenceNode) else [node]
        for value in values:
            if not isinstance(value, yaml.ScalarNode):
                raise CliError(f"{spec_name} line {line_of(value)}: {section}.{key} must be a path or a list of paths.", USAGE)
            if value.tag == "tag:yaml.org,2002:null" or value.value in ("", "~", "null"):
                continue
            written = value.value
            path = Path(os.path.expanduser(written))
            if not path.is_absolute():
                path = Path(base_dir) / path
            refs.append(LocalRef(field, written, line_of(value), path))
    return refs


def check_exist(refs: Iterable[LocalRef], spec_name: str) -> None:
    for ref in refs:
        if not ref.path.exists():
            raise CliError(f"{spec_name} line {ref.line}: {ref.text} does not exist", USAGE)
        if ref.field == "code" and ref.path.is_dir() and not any(p.is_file() for p in ref.path.rglob("*")):
            raise CliError(f"{spec_name} line {ref.line}: {ref.text} is an empty folder", USAGE)


def files_of(path: str | os.PathLike[str]) -> list[tuple[str, Path]]:
    """(name to send, path) of a file, or of every file under a folder (names relative to it)."""
    path = Path(path)
    if path.is_file():
        return [(path.name, path)]
    return [(p.relative_to(path).as_posix(), p) for p in sorted(path.rglob("*")) if p.is_file() and not skipped(p, path)]


def skipped(path: Path, root: Path) -> bool:
    """Files nobody means to upload: caches and version control."""
    parts = path.relative_to(root).parts
    return any(part in ("__pycache__", ".git", ".DS_Store") for part in parts)


def pack_folder(folder: str | os.PathLike[str]) -> IO[bytes]:
    """A folder as a .tar.gz in a temporary file (rewound), with its files at the top level."""
    folder = Path(folder)
    out = tempfile.TemporaryFile(suffix=".tar.gz")  # noqa: SIM115 - returned open, for the caller to send
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        for name, path in files_of(folder):
            tar.add(path, arcname=name, recursive=False)
    out.seek(0)
    return out


def upload_files(refs: Iterable[LocalRef]) -> list[tuple[str, str, IO[bytes]]]:
    """[(field, filename, open binary file)] of everything to send; a code folder is packed."""
    out: list[tuple[str, str, IO[bytes]]] = []
    for ref in refs:
        if ref.field == "code" and ref.path.is_dir():
            out.append((ref.field, f"{ref.path.resolve().name or 'code'}.tar.gz", pack_folder(ref.path)))
            continue
        for name, path in files_of(ref.path):
            out.append((ref.field, name, open(path, "rb")))  # noqa: SIM115 - the caller sends and closes them
    return out


def size_of(fileobj: IO[bytes]) -> int:
    position = fileobj.tell()
    fileobj.seek(0, io.SEEK_END)
    size = fileobj.tell()
    fileobj.seek(position)
    return size


def assignments(items: Sequence[str] | None, option: str) -> dict[str, Any]:
    """NAME=VALUE pairs as a mapping; a value that reads as JSON (3, 0.1, true) is that value."""
    found: dict[str, Any] = {}
    for item in items or []:
        name, sep, text = item.partition("=")
        if not sep or not name:
            raise CliError(f"{option} takes NAME=VALUE, not {item!r}.", USAGE)
        try:
            found[name] = json.loads(text)
        except ValueError:
            found[name] = text
    return found
