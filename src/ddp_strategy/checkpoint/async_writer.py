"""Asynchronous checkpoint writes: snapshot to CPU memory, write in a background thread, one write in flight.

Training is blocked only for the snapshot (a copy of every tensor to CPU memory, so later optimizer steps cannot
change what is being written). The snapshot's CPU tensors are kept and reused by the next save when its tensors
have the same shapes, dtypes and strides (the usual case): copying into memory that is already mapped costs a
fraction of allocating and page-faulting a fresh copy every time, at the price of holding one CPU copy of the
checkpoint's tensors while the writer exists. They are only overwritten after the previous write has finished.
The write itself (``CheckpointIO.save_checkpoint``, atomic and verified) runs in a background thread. A new
submission first waits for the previous write, so at most one is in flight and the writes land in order. Removals
of old checkpoints requested while a write is in flight are deferred until that write has succeeded, so an old
checkpoint is never deleted before its replacement is complete.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO

from ddp_strategy.errors import DDPStrategyError

__all__ = ["AsyncCheckpointWriter", "snapshot"]


def _reusable(buffer: Any, tensor: torch.Tensor) -> bool:
    """Whether ``buffer`` (a tensor of an earlier snapshot) can take a copy of ``tensor`` in place."""
    return (
        isinstance(buffer, torch.Tensor)
        and type(tensor) in (torch.Tensor, torch.nn.Parameter)
        and tensor.layout == torch.strided
        and not (tensor.is_quantized or tensor.is_conj() or tensor.is_neg())
        and buffer.device.type == "cpu"
        and buffer.dtype == tensor.dtype
        and buffer.shape == tensor.shape
        and buffer.stride() == tensor.stride()  # a fresh copy would have these strides too (dense layouts only)
        and buffer.data_ptr() != tensor.data_ptr()
    )


_THREADS_LOCK = threading.Lock()


def snapshot(obj: Any, reuse: Any = None) -> Any:
    """A copy of ``obj`` whose tensors are detached CPU copies (containers are rebuilt, other values shared).

    The copies run with one intra-op thread (torch's thread count is restored afterwards). A copy is limited by
    memory bandwidth, which one thread nearly saturates (384 MiB: 0.023 s with one thread, 0.024 s with two on the
    2-core machine of ``bench/checkpoint_save.py``), while torch's parallel copy waits for its slowest thread: with
    the other core busy (another rank, a data-loader worker, a neighbour), two threads took 0.19 s, eight times
    longer.

    Args:
        obj: the checkpoint (or any nesting of dicts, lists and tuples holding tensors).
        reuse: an earlier snapshot whose tensors may be overwritten. A tensor at the same place in it with the same
            shape, dtype and strides receives the copy (``copy_``) instead of a newly allocated one. The caller
            must make sure nothing reads that snapshot any more.
    """
    with _THREADS_LOCK:
        threads = torch.get_num_threads()
        if threads > 1:
            torch.set_num_threads(1)
        try:
            return _snapshot(obj, reuse)
        finally:
            if threads > 1:
                torch.set_num_threads(threads)


def _snapshot(obj: Any, reuse: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        if _reusable(reuse, obj):
            return reuse.copy_(obj.detach())
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        old = reuse if isinstance(reuse, dict) else {}
        items = ((key, _snapshot(value, old.get(key))) for key, value in obj.items())
        return OrderedDict(items) if isinstance(obj, OrderedDict) else dict(items)
    if isinstance(obj, list):
        old_list = reuse if isinstance(reuse, list) and len(reuse) == len(obj) else [None] * len(obj)
        return [_snapshot(value, previous) for value, previous in zip(obj, old_list, strict=True)]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        old_tuple = reuse if isinstance(reuse, tuple) and len(reuse) == len(obj) else (None,) * len(obj)
        return tuple(_snapshot(value, previous) for value, previous in zip(obj, old_tuple, strict=True))
    return obj


class AsyncCheckpointWriter:
    """Writes checkpoints with a ``CheckpointIO`` in a background thread, at most one at a time.

    Args:
        io: the ``CheckpointIO`` that does the actual (synchronous) write and removal.
        reuse_buffers: keep the last snapshot's CPU tensors and copy the next checkpoint into them (see the module
            docstring). ``False`` allocates a fresh snapshot per save and frees it when its write has finished.
    """

    def __init__(self, io: CheckpointIO, reuse_buffers: bool = True) -> None:
        self.io = io
        self.reuse_buffers = reuse_buffers
        self._buffers: Any = None  # the last snapshot, free for reuse once its write has finished
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
        frozen = snapshot(checkpoint, self._buffers)  # the previous write has finished: its buffers are free
        self._buffers = frozen if self.reuse_buffers else None
        self._thread = threading.Thread(
            target=self._write, args=(frozen, path, storage_options), name="ddp_strategy-checkpoint-writer", daemon=True
        )
        self._thread.start()
        return None

    def release_buffers(self) -> None:
        """Drop the kept snapshot (after the write in flight, if any, has finished); the next save allocates anew."""
        if self._thread is not None:
            self._thread.join()
        self._buffers = None

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
