"""Asynchronous checkpoint writes: snapshot to CPU memory, write in a background thread, one write in flight.

Training is blocked only for the snapshot (a copy of every tensor to CPU memory, so later optimizer steps cannot
change what is being written). The write itself (``CheckpointIO.save_checkpoint``, atomic and verified) runs in
a background thread. A new submission first waits for the previous write, so at most one is in flight and the
writes land in order. Removals of old checkpoints requested while a write is in flight are deferred until that
write has succeeded, so an old checkpoint is never deleted before its replacement is complete.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO

from ddp_strategy.errors import DDPStrategyError

__all__ = ["AsyncCheckpointWriter", "snapshot"]


def snapshot(obj: Any) -> Any:
    """A copy of ``obj`` whose tensors are detached CPU copies (containers are rebuilt, other values shared)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, OrderedDict):
        return OrderedDict((key, snapshot(value)) for key, value in obj.items())
    if isinstance(obj, dict):
        return {key: snapshot(value) for key, value in obj.items()}
    if isinstance(obj, list):
        return [snapshot(value) for value in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(snapshot(value) for value in obj)
    return obj


class AsyncCheckpointWriter:
    """Writes checkpoints with a ``CheckpointIO`` in a background thread, at most one at a time.

    Args:
        io: the ``CheckpointIO`` that does the actual (synchronous) write and removal.
    """

    def __init__(self, io: CheckpointIO) -> None:
        self.io = io
        self._thread: threading.Thread | None = None
        self._error: str | None = None
        self._deferred_removals: list[str] = []
        self._lock = threading.Lock()

    @property
    def busy(self) -> bool:
        """Whether a write is in flight."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> str | None:
        """Wait for the write in flight (if any); return its error message, or ``None`` when it succeeded.

        Deferred removals run after a successful write and are dropped after a failed one (the old checkpoints
        are then still the newest complete ones).
        """
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            error, self._error = self._error, None
            removals, self._deferred_removals = self._deferred_removals, []
        if error is None:
            for path in removals:
                self.io.remove_checkpoint(path)
        return error

    def submit(self, checkpoint: dict[str, Any], path: str, storage_options: Any | None = None) -> str | None:
        """Wait for the previous write, snapshot ``checkpoint`` and start writing it in the background.

        Returns:
            The previous write's error message, or ``None``. On an error the new checkpoint is not submitted.
        """
        previous = self.wait()
        if previous is not None:
            return previous
        frozen = snapshot(checkpoint)
        self._thread = threading.Thread(
            target=self._write, args=(frozen, path, storage_options), name="ddp_strategy-checkpoint-writer", daemon=True
        )
        self._thread.start()
        return None

    def remove_checkpoint(self, path: str) -> None:
        """Remove ``path`` now, or after the write in flight has succeeded."""
        if self.busy:
            with self._lock:
                self._deferred_removals.append(path)
        else:
            self.io.remove_checkpoint(path)

    def _write(self, checkpoint: dict[str, Any], path: str, storage_options: Any | None) -> None:
        try:
            self.io.save_checkpoint(checkpoint, path, storage_options=storage_options)
        except DDPStrategyError as err:
            self._fail(str(err))
        except Exception as err:  # reported to every rank at the next save or at teardown, never dropped
            self._fail(f"{type(err).__name__}: {err}")

    def _fail(self, message: str) -> None:
        with self._lock:
            self._error = message
