"""Asynchronous checkpoint writes: snapshot to CPU memory, write in a background thread, one write in flight.

Training is blocked only for the snapshot (a copy of every tensor to CPU memory, so later optimizer steps cannot
change what is being written), and with an *overlapped* snapshot not even for most of that: tensors that only the
optimizer changes (parameters and optimizer state, chosen by the caller with ``deferred``) are copied by the
background thread while training runs its next forward and backward, and
:meth:`AsyncCheckpointWriter.wait_for_snapshot`, called right before the next optimizer update, blocks only for
what is left of that copy. Everything else (buffers
such as BatchNorm statistics, which a forward changes, and all containers) is copied before ``submit`` returns. Each
deferred tensor's version counter is compared before and after its copy: an in-place change that slipped in
before its copy finished (something other than the optimizer changed a parameter) fails that write loudly instead
of writing a torn checkpoint.

The snapshot's CPU tensors are kept and reused by the next save when its tensors
have the same shapes, dtypes and strides (the usual case): copying into memory that is already mapped costs a
fraction of allocating and page-faulting a fresh copy every time, at the price of holding one CPU copy of the
checkpoint's tensors while the writer exists. They are only overwritten after the previous write has finished.
The write itself (``CheckpointIO.save_checkpoint``, atomic and verified) runs in a background thread. A new
submission first waits for the previous write, so at most one is in flight and the writes land in order. Removals
of old checkpoints requested while a write is in flight are deferred until that write has succeeded, so an old
checkpoint is never deleted before its replacement is complete.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .._compat.lightning import CheckpointIO
from .._compat.torch import tensor_version
from ..errors import DDPStrategyError

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


#: A deferred copy: (destination CPU tensor, source tensor, the source's version counter when it was submitted).
_Pending = tuple[torch.Tensor, torch.Tensor, int]


def _deferrable(tensor: torch.Tensor) -> bool:
    """Whether a tensor's copy can be made later into a plain contiguous CPU tensor allocated now."""
    return (
        type(tensor) in (torch.Tensor, torch.nn.Parameter)
        and tensor.layout == torch.strided
        and not (tensor.is_quantized or tensor.is_conj() or tensor.is_neg())
        and tensor.is_contiguous()
    )


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
    frozen, _ = _snapshot_in_one_thread(obj, reuse, None)
    return frozen


def _snapshot_in_one_thread(
    obj: Any, reuse: Any, deferred: Callable[[torch.Tensor], bool] | None
) -> tuple[Any, list[_Pending]]:
    pending: list[_Pending] = []
    with _one_intra_op_thread():
        return _snapshot(obj, reuse, deferred, pending), pending


@contextlib.contextmanager
def _one_intra_op_thread() -> Iterator[None]:
    """Run the calling thread's torch ops with one intra-op thread.

    The count is per OS thread (OpenMP's ``nthreads`` setting is thread-local), so this never changes the intra-op
    threads of the training thread when the writer thread uses it.
    """
    threads = torch.get_num_threads()
    if threads > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if threads > 1:
            torch.set_num_threads(threads)


def _snapshot(obj: Any, reuse: Any, deferred: Callable[[torch.Tensor], bool] | None, pending: list[_Pending]) -> Any:
    if isinstance(obj, torch.Tensor):
        if deferred is not None and _deferrable(obj) and deferred(obj):
            target = reuse if _reusable(reuse, obj) else torch.empty(obj.shape, dtype=obj.dtype, device="cpu")
            pending.append((target, obj.detach(), tensor_version(obj)))
            return target
        if _reusable(reuse, obj):
            return reuse.copy_(obj.detach())
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        old = reuse if isinstance(reuse, dict) else {}
        items = ((key, _snapshot(value, old.get(key), deferred, pending)) for key, value in obj.items())
        return OrderedDict(items) if isinstance(obj, OrderedDict) else dict(items)
    if isinstance(obj, list):
        old_list = reuse if isinstance(reuse, list) and len(reuse) == len(obj) else [None] * len(obj)
        return [_snapshot(value, previous, deferred, pending) for value, previous in zip(obj, old_list, strict=True)]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        old_tuple = reuse if isinstance(reuse, tuple) and len(reuse) == len(obj) else (None,) * len(obj)
        return tuple(
            _snapshot(value, previous, deferred, pending) for value, previous in zip(obj, old_tuple, strict=True)
        )
    return obj


def _copy_deferred(pending: list[_Pending]) -> str | None:
    """Make the deferred copies (in the writer thread); a message if a source changed before its copy was done."""
    changed = 0
    with _one_intra_op_thread():
        for target, source, version in pending:
            target.copy_(source)
            if tensor_version(source) != version:
                changed += 1
    if changed:
        return (
            f"{changed} parameter or optimizer-state tensor(s) were changed in place before the overlapped "
            "snapshot of the checkpoint had copied them (something other than the optimizer step changed them "
            "after the save, e.g. a callback). This checkpoint was not written; the previous one is intact. Use "
            "SafeDDPStrategy(async_save=True, async_snapshot='blocking') to copy everything before training "
            "continues."
        )
    return None


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
        self._snapshot_done = threading.Event()
        self._snapshot_done.set()
        #: Seconds :meth:`wait_for_snapshot` has blocked its callers in total.
        self.snapshot_wait_seconds = 0.0
        #: Submissions whose snapshot was (partly) copied in the background.
        self.overlapped_submissions = 0

    @property
    def snapshot_pending(self) -> bool:
        """Whether the background thread is still copying deferred tensors of the last submission."""
        return not self._snapshot_done.is_set()

    def wait_for_snapshot(self) -> None:
        """Block until the deferred tensors of the last submission are copied (call before changing them)."""
        if self._snapshot_done.is_set():
            return
        start = time.perf_counter()
        self._snapshot_done.wait()
        self.snapshot_wait_seconds += time.perf_counter() - start

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

    def submit(
        self,
        checkpoint: dict[str, Any],
        path: str,
        storage_options: Any | None = None,
        *,
        deferred: Callable[[torch.Tensor], bool] | None = None,
    ) -> str | None:
        """Wait for the previous write, snapshot ``checkpoint`` and start writing it in the background.

        Args:
            checkpoint: the checkpoint dict; its tensors are copied, containers rebuilt.
            path: destination, passed to the ``CheckpointIO``.
            storage_options: passed to the ``CheckpointIO``.
            deferred: tensors for which this returns ``True`` (and that are plain dense contiguous tensors) are
                copied by the background thread instead of before returning; the caller must call
                :meth:`wait_for_snapshot` before anything changes them. ``None`` copies everything now.

        Returns:
            The previous write's error message, or ``None``. On an error the new checkpoint is not submitted.
        """
        previous = self.wait()
        if previous is not None:
            return previous
        # the previous write has finished: its buffers are free
        frozen, pending = _snapshot_in_one_thread(checkpoint, self._buffers, deferred)
        self._buffers = frozen if self.reuse_buffers else None
        if pending:
            self._snapshot_done.clear()
            self.overlapped_submissions += 1
        self._thread = threading.Thread(
            target=self._copy_and_write,
            args=(frozen, pending, path, storage_options),
            name="ddp_strategy-checkpoint-writer",
            daemon=True,
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

    def _copy_and_write(
        self, checkpoint: dict[str, Any], pending: list[_Pending], path: str, storage_options: Any | None
    ) -> None:
        try:
            problem = _copy_deferred(pending) if pending else None
        except Exception as err:  # e.g. out of memory: reported like a failed write
            problem = f"copying the checkpoint snapshot failed: {type(err).__name__}: {err}"
        finally:
            self._snapshot_done.set()
        if problem is not None:
            self._fail(problem)
            return
        try:
            self.io.save_checkpoint(checkpoint, path, storage_options=storage_options)
        except DDPStrategyError as err:
            self._fail(str(err))
        except Exception as err:  # reported to every rank at the next save or at teardown, never dropped
            self._fail(f"{type(err).__name__}: {err}")

    def _fail(self, message: str) -> None:
        with self._lock:
            self._error = message
