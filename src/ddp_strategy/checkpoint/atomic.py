"""Atomic file replacement: write a temporary file beside the destination, fsync, rename, fsync the directory."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import uuid
from collections.abc import Iterator
from typing import BinaryIO

__all__ = ["atomic_file"]

log = logging.getLogger(__name__)

_HOST = socket.gethostname().replace(os.sep, "_")


def _fsync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_temporaries(directory: str) -> None:
    """Delete temporary files of interrupted writes in ``directory`` left by processes of this host that died.

    Names carry host and pid (``.<name>.tmp-<host>-<pid>-<random>``), so a live writer's file, or one of another
    host sharing the directory, is never touched.
    """
    marker = f".tmp-{_HOST}-"
    for entry in os.scandir(directory):
        if not entry.name.startswith("."):
            continue
        head, _, rest = entry.name.rpartition(marker)
        pid_text = rest.split("-", 1)[0]
        if not head or not pid_text.isdigit() or _pid_alive(int(pid_text)):
            continue
        with contextlib.suppress(FileNotFoundError):  # another process cleaned it up first
            os.remove(entry.path)
        log.info("ddp_strategy: removed %s, left by a write that was interrupted", entry.path)


@contextlib.contextmanager
def atomic_file(path: str) -> Iterator[BinaryIO]:
    """Open a temporary file that replaces ``path`` atomically and durably when the block ends without error.

    The temporary file lives in ``path``'s own directory, so the final ``os.replace`` never crosses a filesystem
    (it never becomes a copy). Until the replace, an existing file at ``path`` is untouched; if the block raises,
    the temporary file is removed and ``path`` is left as it was. Temporary files of dead writers of this host
    in that directory are removed first.
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    _remove_stale_temporaries(directory)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{_HOST}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as file:
            yield file
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
    _fsync_directory(directory)
