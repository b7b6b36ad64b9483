"""Reading what a job wrote in its own folder, without following anything it put there.

The runner is often root and the job's folder is the job's: every name in it may be a symlink
to something of the runner's or of another job's, and may be swapped for one between a look
and a read. O_NOFOLLOW on a whole path guards only its last component, so every helper here
walks from the folder's descriptor one component at a time (openat with O_NOFOLLOW), reads only
regular files (checked with fstat on the descriptor it reads from), and never blocks on a pipe.

The standard library only: no Django, so the helpers can be used and tested anywhere.
"""

import errno
import os
import stat
from pathlib import PurePosixPath

FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
# Folders held open at once by a walk: deeper ones are found again from the top (see _folders),
# so a job that nests thousands of folders cannot run the runner out of descriptors.
KEEP_OPEN = 16


class NotRegularFile(OSError):
    """A file was asked for and something else is there: a folder, a pipe, a socket, a device."""


def _parts(relative):
    """The components of a path below the job's folder; never absolute, never '..'."""
    path = PurePosixPath(relative)
    if path.is_absolute() or any(part == ".." for part in path.parts):
        raise ValueError(f"not a path inside the job's folder: {relative!r}")
    return [part for part in path.parts if part != "."]


def _open_root(root):
    """A descriptor of the job's folder (a new one, the caller closes it). root is a path or a
    descriptor already open on it."""
    if isinstance(root, int):
        return os.dup(root)
    return os.open(root, FOLDER)


def _descend(fd, parts):
    """A new descriptor of the folder parts below fd, one component at a time."""
    current = os.dup(fd)
    try:
        for part in parts:
            below = os.open(part, FOLDER, dir_fd=current)
            os.close(current)
            current = below
    except BaseException:
        os.close(current)
        raise
    return current


def open_dir(root, relative=""):
    """A descriptor of the folder root/relative; OSError if any component is a link (ELOOP) or
    not a folder (ENOTDIR). The caller closes it."""
    parts = _parts(relative)
    top = _open_root(root)
    try:
        return _descend(top, parts)
    finally:
        os.close(top)


def open_file(root, relative, flags=0):
    """A read-only descriptor of the regular file root/relative; no component may be a link.
    Anything but a regular file is refused (NotRegularFile) without blocking: a pipe is opened
    with O_NONBLOCK only to be looked at and closed. The caller closes the descriptor."""
    parts = _parts(relative)
    if not parts:
        raise IsADirectoryError(errno.EISDIR, "the job's folder is not a file", str(relative))
    folder = open_dir(root, PurePosixPath(*parts[:-1]))
    try:
        return _open_in(folder, parts[-1], flags)
    finally:
        os.close(folder)


def _open_in(folder, name, flags=0):
    # Looked at first, so that nothing but a regular file is ever opened (a device, say); and
    # checked again on the descriptor, for what was swapped in between.
    if not stat.S_ISREG(os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode):
        raise NotRegularFile(errno.EINVAL, "not a regular file", name)
    fd = os.open(name, FILE | flags, dir_fd=folder)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFile(errno.EINVAL, "not a regular file", name)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _folders(top):
    """(parts, fd, [(name, lstat)]) for the folder top (a descriptor) and every folder below it,
    depth first in name order. A folder is entered only through openat with O_NOFOLLOW and
    O_DIRECTORY, so a link (or a folder swapped for one after the look) is never followed.
    fd is valid only until the next item is asked for."""
    # Each frame: [parts, fd or None, names of the subfolders still to visit]
    stack = [[(), os.dup(top), None]]
    try:
        while stack:
            frame = stack[-1]
            parts, fd, left = frame
            if left is None:
                entries = []
                try:
                    names = sorted(os.listdir(fd))
                except OSError:
                    names = []
                for name in names:
                    try:
                        entries.append((name, os.stat(name, dir_fd=fd, follow_symlinks=False)))
                    except OSError:  # gone since the listing
                        continue
                yield parts, fd, entries
                frame[2] = left = [name for name, st in reversed(entries) if stat.S_ISDIR(st.st_mode)]
            if not left:
                stack.pop()
                if fd is not None:
                    os.close(fd)
                continue
            name = left.pop()
            if fd is None:  # closed to bound the descriptors held: found again from the top
                try:
                    frame[1] = fd = _descend(stack[0][1], parts)
                except OSError:
                    frame[2] = []
                    continue
            try:
                below = os.open(name, FOLDER, dir_fd=fd)
            except OSError:  # a link, or no longer a folder
                continue
            stack.append([(*parts, name), below, None])
            held = [f for f in stack[1:-1] if f[1] is not None]
            if len(held) >= KEEP_OPEN:
                os.close(held[0][1])
                held[0][1] = None
    finally:
        for frame in stack:
            if frame[1] is not None:
                os.close(frame[1])


def regular_files(root, relative=""):
    """(name, fd) of every regular file under root/relative, name relative to that folder
    ('a/b.txt'), in name order. Links are never followed, in any component, and only regular
    files are opened. fd is open for the body of the caller's loop and closed when the next item
    is asked for (os.dup it to keep it). OSError if root/relative itself cannot be opened as a
    folder (a link, say)."""
    top = open_dir(root, relative)
    walk = _folders(top)
    try:
        for parts, folder, entries in walk:
            for name, st in entries:
                if not stat.S_ISREG(st.st_mode):
                    continue
                try:
                    fd = _open_in(folder, name)
                except OSError:  # swapped for a link, a pipe or a folder since the look
                    continue
                try:
                    yield "/".join((*parts, name)), fd
                finally:
                    os.close(fd)
    finally:
        walk.close()
        os.close(top)


def disk_used(root, skip_inodes=frozenset()):
    """Bytes of disk the files under root take (each inode once; the staged files, shared with
    the cache, not counted). Symlinks are not followed: a link counts as itself."""
    seen = set()
    total = 0
    try:
        top = open_dir(root)
    except OSError:  # no folder (yet, or any more): nothing used
        return 0
    walk = _folders(top)
    try:
        for _, _, entries in walk:
            for _, st in entries:
                key = (st.st_dev, st.st_ino)
                if key in seen or key in skip_inodes:
                    continue
                seen.add(key)
                total += st.st_blocks * 512
    finally:
        walk.close()
        os.close(top)
    return total
