"""Removing a directory a submission could write to, without letting it steer the removal.

Everything is done through file descriptors opened with ``O_NOFOLLOW``: a symlink put in place of a
directory (even while the removal runs) is unlinked, never followed, so nothing outside the
directory is changed or removed. Permissions the submission took away are given back through those
descriptors, and as root the immutable and append-only flags are cleared the same way.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import stat
import struct
import sys
from pathlib import Path

_FS_IOC_GETFLAGS, _FS_IOC_SETFLAGS = 0x80086601, 0x40086602
_FS_PINNED = 0x10 | 0x20  # FS_IMMUTABLE_FL | FS_APPEND_FL


def remove_tree(path: str | Path) -> None:
    """Remove ``path`` and everything below it; best effort, never following a symlink."""
    path = str(path)
    if not hasattr(os, "O_PATH"):  # not Linux: no O_PATH; shutil's own removal is still fd-based there
        shutil.rmtree(path, ignore_errors=True)
        return
    parent = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        _remove(os.path.basename(path), parent)
    finally:
        os.close(parent)


def _remove(name: str, parent: int) -> None:
    try:
        info = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except OSError:
        return
    if stat.S_ISDIR(info.st_mode):
        directory = _open_directory(name, parent)
        if directory is not None:
            try:
                for entry in os.listdir(directory):
                    _remove(entry, directory)
            finally:
                os.close(directory)
        _retry(lambda: os.rmdir(name, dir_fd=parent), name, parent)
    else:
        _retry(lambda: os.unlink(name, dir_fd=parent), name, parent)


def _open_directory(name: str, parent: int) -> int | None:
    """A readable descriptor of the directory ``name`` itself (never a symlink's target), made
    writable and unpinned first."""
    try:
        handle = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY, dir_fd=parent)
    except OSError:
        return None
    try:
        _unpin(handle)
        try:
            os.chmod(f"/proc/self/fd/{handle}", 0o700)  # the descriptor's own inode, not a path
        except OSError:
            pass
        return os.open(f"/proc/self/fd/{handle}", os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None
    finally:
        os.close(handle)


def _retry(remove, name: str, parent: int) -> None:
    """Run ``remove``; if a flag pinned the entry, clear it (through a descriptor) and try again."""
    try:
        remove()
        return
    except OSError:
        pass
    try:
        handle = os.open(name, os.O_PATH | os.O_NOFOLLOW, dir_fd=parent)
    except OSError:
        return
    try:
        _unpin(handle)
    finally:
        os.close(handle)
    try:
        remove()
    except OSError:
        pass


def _unpin(handle: int) -> None:
    """Clear the immutable and append-only flags of a regular file or directory (root only)."""
    if os.geteuid() != 0 or not sys.platform.startswith("linux"):
        return
    try:
        mode = os.fstat(handle).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            return  # never open a device or a fifo
        fd = os.open(f"/proc/self/fd/{handle}", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return
    try:
        flags = struct.unpack("i", fcntl.ioctl(fd, _FS_IOC_GETFLAGS, b"\0" * 4))[0]
        if flags & _FS_PINNED:
            fcntl.ioctl(fd, _FS_IOC_SETFLAGS, struct.pack("i", flags & ~_FS_PINNED))
    except OSError:
        pass
    finally:
        os.close(fd)
