"""Gather and broadcast picklable objects over a gloo group, without freeing tensors on gloo's threads.

``torch.distributed.all_gather_object`` and its siblings build byte tensors, run the collective and drop the
tensors as soon as the call returns. gloo's worker thread still holds the finished work and releases it a moment
later; being the last owner of a tensor that Python created, it must take the GIL to free the tensor, and to take
the GIL it creates a Python thread state (``PyThreadState_New``, which locks the interpreter's thread list without
the GIL). A ``fork`` in that instant (a ``DataLoader`` starting its workers at the next epoch) copies the locked
list into the child, and on CPython before 3.11.10 the child then deadlocks in ``PyOS_AfterFork_Child``
(`CPython gh-112275 <https://github.com/python/cpython/issues/112275>`_): the rank waits forever for a batch.

The functions here hold every tensor of the last few collectives in a :class:`KeepAlive` owned by the caller, so
gloo's release is never the last one and the tensors are freed on the calling thread, later.
"""

from __future__ import annotations

import pickle
from collections import deque
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["KeepAlive", "all_gather_objects", "broadcast_object", "gather_objects"]


class KeepAlive:
    """The tensors of a group's most recent collectives, freed on the calling thread when newer ones come in.

    gloo runs a group's collectives in order on its worker threads, so by the time ``depth`` newer collectives of
    the same group have completed, the worker has long released the oldest one.
    """

    def __init__(self, depth: int = 8) -> None:
        self._held: deque[tuple[torch.Tensor, ...]] = deque(maxlen=depth)

    def hold(self, *tensors: torch.Tensor) -> None:
        """Keep ``tensors`` until ``depth`` more collectives have been held."""
        self._held.append(tensors)

    def clear(self) -> None:
        """Free everything held (call once the group is destroyed: no worker can still hold a reference)."""
        self._held.clear()


def _to_bytes(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def _from_bytes(data: torch.Tensor, size: int) -> Any:
    return pickle.loads(data[:size].numpy().tobytes())  # peers of one job only, as torch's *_object calls


def _gather_sizes(data: torch.Tensor, group: Any, world_size: int, keep: KeepAlive) -> list[int]:
    size = torch.tensor([data.numel()], dtype=torch.long)
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(world_size)]
    dist.all_gather(sizes, size, group=group)
    keep.hold(size, *sizes)
    return [int(s.item()) for s in sizes]


def _padded(data: torch.Tensor, length: int) -> torch.Tensor:
    out = torch.zeros(length, dtype=torch.uint8)
    out[: data.numel()] = data
    return out


def all_gather_objects(obj: Any, *, group: Any, world_size: int, keep: KeepAlive) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank (as ``all_gather_object``, on the CPU).

    Args:
        obj: this rank's picklable object.
        group: a gloo process group of ``world_size`` ranks, this one among them.
        world_size: the group's size.
        keep: where the collective's tensors stay until later (see the module docstring).

    """
    data = _to_bytes(obj)
    sizes = _gather_sizes(data, group, world_size, keep)
    mine = _padded(data, max(sizes))
    outs = [torch.empty(max(sizes), dtype=torch.uint8) for _ in range(world_size)]
    dist.all_gather(outs, mine, group=group)
    keep.hold(data, mine, *outs)
    return [_from_bytes(out, size) for out, size in zip(outs, sizes, strict=True)]


def gather_objects(obj: Any, *, dst: int, rank: int, group: Any, world_size: int, keep: KeepAlive) -> list[Any] | None:
    """Every rank's ``obj`` on ``dst`` (a group rank), ``None`` elsewhere (as ``gather_object``, on the CPU).

    Args:
        obj: this rank's picklable object.
        dst: the receiving rank.
        rank: this rank.
        group: a gloo process group of ``world_size`` ranks.
        world_size: the group's size.
        keep: where the collective's tensors stay until later.

    """
    data = _to_bytes(obj)
    sizes = _gather_sizes(data, group, world_size, keep)
    mine = _padded(data, max(sizes))
    outs = [torch.empty(max(sizes), dtype=torch.uint8) for _ in range(world_size)] if rank == dst else None
    dist.gather(mine, outs, dst=dst, group=group)
    keep.hold(data, mine, *(outs or []))
    if outs is None:
        return None
    return [_from_bytes(out, size) for out, size in zip(outs, sizes, strict=True)]


def broadcast_object(obj: Any, *, src: int, rank: int, group: Any, keep: KeepAlive) -> Any:
    """``src``'s ``obj`` on every rank (the value passed elsewhere is ignored; as ``broadcast_object_list``).

    Args:
        obj: the object to send (read on ``src`` only).
        src: the sending rank.
        rank: this rank.
        group: a gloo process group.
        keep: where the collective's tensors stay until later.

    """
    data = _to_bytes(obj) if rank == src else torch.empty(0, dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.long)
    dist.broadcast(size, src=src, group=group)
    buffer = data if rank == src else torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(buffer, src=src, group=group)
    keep.hold(data, size, buffer)
    return _from_bytes(buffer, int(size.item()))
