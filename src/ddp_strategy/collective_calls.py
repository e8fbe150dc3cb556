"""``CollectiveCalls``: the strategy's own collectives (``reduce``, ``all_gather``, ``broadcast``) for desync detection.

While a :class:`~ddp_strategy.desync.DesyncMonitor` watches the run, each call first raises the desync the ranks
agreed on (if any), adds what it is to the monitor's :class:`~ddp_strategy.collective_record.CallLedger` (compared
across ranks), and runs inside a :class:`~ddp_strategy.collective_record.CallNotes` note that names its origin (the
``self.log(..., sync_dist=True)`` line, found through :class:`~ddp_strategy.collective_record.LogSites`). Without a
monitor a call goes straight to Lightning's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ._compat.lightning import logged_metric_of_caller
from .collective_record import CallNotes, LogSites
from .desync import DesyncMonitor
from .gather_shapes import check_gather_shapes
from .positions import call_site

__all__ = ["CollectiveCalls", "all_reduce_value", "mean_in_floating_point"]

_TEXTS_KEPT = 1024  # the texts of this many distinct reduces at most (then they are made anew)


def mean_in_floating_point(tensor: Tensor, reduce_op: Any) -> Tensor:
    """``tensor`` in double precision when a mean of integers is asked for, else itself.

    Lightning truncates an integer mean, in place: a ``self.log(..., sync_dist=True)`` mean over uneven batch counts
    (say 5 and 4 samples) was wrong.
    """
    if not torch.is_floating_point(tensor) and str(reduce_op).lower() in ("mean", "avg"):
        return tensor.double()
    return tensor


def all_reduce_value(value: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
    """``value`` reduced over ``group`` in place by one collective: Lightning's ``DDPStrategy.reduce``, no barrier.

    Lightning's ``_sync_ddp`` runs ``torch.distributed.barrier`` before each all-reduce of a ``self.log(...,
    sync_dist=True)`` value: two collectives per value. Here it is one. On NCCL it is the all-reduce. On gloo it is an
    all-gather, reduced on every rank in rank order (:func:`_gathered_reduction`): gloo aborts the whole process (a C++
    ``terminate`` in its network thread) when a rank's all-reduce is paired with a larger all-reduce of another rank,
    such as a value logged on rank 0 only against DDP's gradient all-reduce; the barrier used to keep those apart.
    An all-gather never pairs with an all-reduce, so that mistake stays a wait that desync detection names.

    The rest is Lightning's: ``"mean"`` is ``"avg"``; gloo has no average, so it sums and divides by the group's
    size (an integer tensor takes the quotient cast back to its dtype, as in Lightning: the strategy hands it a
    double for a mean, :func:`mean_in_floating_point`); another name is that ``ReduceOp`` member; ``None`` sums; a
    ``ReduceOp`` is used as given. An operation or a value the gather cannot reduce (complex or bool values, an
    average or a pre-multiplied sum op, more than ``_GATHERED_MOST_ELEMENTS`` gathered elements) takes Lightning's
    barrier and all-reduce on gloo. Anything but a tensor, or without an initialized process group, is returned
    unchanged.
    """
    if not isinstance(value, Tensor) or not (dist.is_available() and dist.is_initialized()):
        return value
    group = dist.group.WORLD if group is None else group
    gloo = dist.get_backend(group) == "gloo"
    op, divide = dist.ReduceOp.SUM if reduce_op is None else reduce_op, False
    if isinstance(reduce_op, str):
        name = "avg" if reduce_op == "mean" else reduce_op
        if name.lower() == "avg" and gloo:
            op, divide = dist.ReduceOp.SUM, True
        else:
            op = getattr(dist.ReduceOp, name.upper())
    world_size = dist.get_world_size(group)
    if not gloo:
        dist.all_reduce(value, op=op, group=group)
    elif (reduce := _gathered_reduction(value, op, world_size)) is not None:
        gathered = torch.empty(world_size * value.numel(), dtype=value.dtype, device=value.device)
        dist.all_gather_single(gathered, value.reshape(-1), group=group)
        value.copy_(reduce(gathered.view(world_size, -1)).view(value.shape))
    else:
        dist.barrier(group=group)
        dist.all_reduce(value, op=op, group=group)
    if not divide:
        return value
    return value.div_(world_size) if torch.is_floating_point(value) else value.copy_(value / world_size)


#: The most elements a gloo ``reduce`` gathers (world size times the value's): more take a barrier and an all-reduce.
_GATHERED_MOST_ELEMENTS = 1 << 20


def _gathered_reduction(value: Tensor, op: Any, world_size: int) -> Callable[[Tensor], Tensor] | None:
    """How to reduce the rows of ``value`` gathered from every rank as ``op`` would, or ``None`` when unsupported.

    Every rank reduces the same rows in the same order: the results are equal bit for bit on every rank.
    """
    if value.is_complex() or value.dtype == torch.bool or world_size * value.numel() > _GATHERED_MOST_ELEMENTS:
        return None
    try:
        if op == dist.ReduceOp.SUM:
            return _sum_rows
        if op == dist.ReduceOp.MAX:
            return _max_rows
        if op == dist.ReduceOp.MIN:
            return _min_rows
        if op == dist.ReduceOp.PRODUCT:
            return _product_rows
    except TypeError:  # not a ReduceOp
        pass
    return None  # another op: bitwise, average, pre-multiplied sum


def _sum_rows(rows: Tensor) -> Tensor:
    return rows.sum(0, dtype=rows.dtype)


def _max_rows(rows: Tensor) -> Tensor:
    return rows.amax(0)


def _min_rows(rows: Tensor) -> Tensor:
    return rows.amin(0)


def _product_rows(rows: Tensor) -> Tensor:
    return rows.prod(0, dtype=rows.dtype)


class CollectiveCalls:
    """Records the strategy's own collectives for desync detection; see the module docs.

    The run's life cycle (:class:`~ddp_strategy.lifecycle.RunLifecycle`) builds the monitor with :attr:`notes` and
    hands it over with :meth:`watched_by`; each method takes Lightning's implementation of the call as ``run``.
    """

    def __init__(self) -> None:
        #: What made each recent collective, read by the monitor when it describes one.
        self.notes = CallNotes()
        #: The lines of the module's ``self.log(..., sync_dist=True)`` calls.
        self.log_sites = LogSites()
        self.monitor: DesyncMonitor | None = None
        self._texts: dict[tuple[Any, ...], tuple[str, str]] = {}  # per logged value, dtype, shape and op

    def watched_by(self, monitor: DesyncMonitor | None) -> None:
        """Record the following calls for ``monitor`` (``None``: stop recording)."""
        self.monitor = monitor

    def reduce(self, run: Callable[..., Any], tensor: Any, group: Any | None, reduce_op: Any | None) -> Any:
        """``run(tensor, group=group, reduce_op=reduce_op)``, recorded with the ``self.log`` value it syncs."""
        monitor = self.monitor
        if monitor is None:
            return run(tensor, group=group, reduce_op=reduce_op)
        error = monitor.control.desync_error
        if error is not None:
            raise error
        # a step value syncs inside its `self.log` call; an epoch value later, from Lightning's code: found on the
        # stack (from the strategy's `reduce` on, its caller's 8 frames)
        logged = self.log_sites.current or logged_metric_of_caller(depth=9)
        # what the call is, for the ledger and its note: the same for every call of one logged value (made once)
        is_tensor = isinstance(tensor, Tensor)
        key: tuple[Any, ...] = (
            (logged, tensor.dtype, tensor.shape, reduce_op) if is_tensor else (logged, type(tensor), reduce_op)
        )
        try:
            texts = self._texts.get(key)
        except TypeError:  # an unhashable reduce_op: made anew at every call
            texts = self._reduce_texts(None, logged, tensor, reduce_op)
        ledger_text, note_text = texts or self._reduce_texts(key, logged, tensor, reduce_op)
        monitor.ledger.add(ledger_text)
        note = self.notes.begin(note_text)
        try:
            return run(tensor, group=group, reduce_op=reduce_op)
        finally:
            self.notes.end(note)

    def all_gather(
        self, run: Callable[..., Tensor], tensor: Tensor, group: Any | None, sync_grads: bool, device: Any
    ) -> Tensor:
        """``run(tensor, group=group, sync_grads=sync_grads)``, after the ranks compared their tensors' shapes.

        Raises:
            CollectiveMismatchError: the ranks' tensors differ in shape or dtype (gloo would abort the process).

        """
        monitor = self.monitor
        if monitor is None:
            return run(tensor, group=group, sync_grads=sync_grads)
        self._raise_agreed_desync(monitor)
        monitor.ledger.add(
            f"all_gather {tensor.dtype}{list(tensor.shape)}" if isinstance(tensor, Tensor) else "all_gather"
        )
        if isinstance(tensor, Tensor):
            check_gather_shapes(tensor, group=group, device=device, site=call_site(skip=3))
        note = self.notes.begin("self.all_gather / strategy.all_gather")
        try:
            return run(tensor, group=group, sync_grads=sync_grads)
        finally:
            self.notes.end(note)

    def broadcast(self, run: Callable[[Any, int], Any], obj: Any, src: int) -> Any:
        """``run(obj, src)``, recorded."""
        monitor = self.monitor
        if monitor is None:
            return run(obj, src)
        self._raise_agreed_desync(monitor)
        monitor.ledger.add(f"broadcast {src}")
        note = self.notes.begin(f"strategy.broadcast(obj, src={src})")
        try:
            return run(obj, src)
        finally:
            self.notes.end(note)

    def _reduce_texts(
        self, key: tuple[Any, ...] | None, logged: tuple[str, str] | None, tensor: Any, reduce_op: Any
    ) -> tuple[str, str]:
        """The ledger and note texts of a ``reduce`` not seen before, kept under ``key`` (``None``: not kept)."""
        is_tensor = isinstance(tensor, Tensor)
        shape = f"{tensor.dtype}{list(tensor.shape)}" if is_tensor else type(tensor).__name__
        ledger_text = f"reduce {'.'.join(logged) if logged else ''} {shape} {reduce_op}"
        texts = (ledger_text, self.log_sites.describe(*logged) if logged else "strategy.reduce")
        # kept once the note is final: the line of `self.log` is known from its first call on
        if key is not None and (logged is None or logged in self.log_sites.sites):
            if len(self._texts) >= _TEXTS_KEPT:
                self._texts.clear()
            self._texts[key] = texts
        return texts

    @staticmethod
    def _raise_agreed_desync(monitor: DesyncMonitor) -> None:
        if monitor.control.desync_error is not None:
            raise monitor.control.desync_error
