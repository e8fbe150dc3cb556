"""Atomic file replacement: write a temporary file beside the destination, fsync, rename, fsync the directory.

Also :class:`EarlyWriteback`, which makes the final ``fsync`` of a large file short by asking the kernel to start
writing each part to disk as soon as it is written.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import socket
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import BinaryIO

__all__ = ["EarlyWriteback", "atomic_file"]

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

    The file is opened ``"w+b"`` (it can be read back while it is written). The temporary file lives in ``path``'s
    own directory, so the final ``os.replace`` never crosses a filesystem
    (it never becomes a copy). Until the replace, an existing file at ``path`` is untouched; if the block raises,
    the temporary file is removed and ``path`` is left as it was. Temporary files of dead writers of this host
    in that directory are removed first.
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    _remove_stale_temporaries(directory)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{_HOST}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "w+b") as file:  # readable too: HashingWriter(parallel=False) reads the zip directory back
            yield file
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
    _fsync_directory(directory)


_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start write-out of dirty pages in the range, do not wait for it


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    native = getattr(os, "sync_file_range", None)  # not in CPython's os module today; use it if it appears
    if native is not None:  # pragma: no cover

        def call(fd: int, offset: int, nbytes: int, flags: int) -> int:
            native(fd, offset, nbytes, flags)
            return 0

        return call
    try:
        function = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).sync_file_range
    except (OSError, AttributeError):  # pragma: no cover - every glibc and musl has it
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function  # a ctypes call releases the GIL while it runs


_sync_file_range = _load_sync_file_range()


class EarlyWriteback:
    """Starts the kernel's write-back of a file's new pages while the rest is still being written.

    A checkpoint written into the page cache and then ``fsync``ed makes ``fsync`` wait for the whole file to reach
    the disk. Calling ``sync_file_range(SYNC_FILE_RANGE_WRITE)`` on each part right after it is written lets the
    disk work in parallel with serialization, so the final ``fsync`` (still done; durability is unchanged) only
    waits for the last part. The call is made from a helper thread, because it blocks when the device's queue is
    full, and successive ranges are merged while it is busy. Linux only; elsewhere, or if the call fails, it does
    nothing.

    Args:
        fd: the file descriptor being written.
        start: the file offset that :meth:`advance`'s counts start from.
    """

    def __init__(self, fd: int, start: int = 0) -> None:
        self._fd = fd
        self._start = start
        self._issued = 0
        self._target = 0
        self._closed = False
        self._failed = _sync_file_range is None
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None

    def advance(self, written: int) -> None:
        """``written`` bytes from ``start`` are now in the page cache: start writing them to disk."""
        if self._failed:
            return
        with self._wake:
            self._target = max(self._target, written)
            self._wake.notify()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ddp_strategy-writeback", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Wait for the helper thread (the file descriptor must stay open until this returns)."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        assert _sync_file_range is not None
        while True:
            with self._wake:
                while self._target <= self._issued and not self._closed:
                    self._wake.wait()
                if self._closed or self._failed:
                    return  # the caller's fsync writes whatever is left
                start, end = self._issued, self._target
                self._issued = end
            if _sync_file_range(self._fd, self._start + start, end - start, _SYNC_FILE_RANGE_WRITE) != 0:
                self._failed = True  # e.g. a filesystem without support: the final fsync does all the work
                log.debug(
                    "ddp_strategy: sync_file_range failed (errno %d); not starting write-back early", ctypes.get_errno()
                )
                return

    def __enter__(self) -> EarlyWriteback:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
