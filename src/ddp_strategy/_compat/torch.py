"""Private torch internals, behind names that say what they do (shared by both Lightning namespaces)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

__all__ = ["default_store", "new_store_connection", "sync_ddp_buffers", "tensor_version"]


def default_store() -> Any:
    """The rendezvous store of the default process group (the ``TCPStore`` ``init_process_group`` created)."""
    return dist.distributed_c10d._get_default_store()


def new_store_connection(store: Any) -> Any:
    """A second client connection to ``store``, for a background thread (``Store.clone``, torch >= 2.8)."""
    return store.clone()


def tensor_version(tensor: torch.Tensor) -> int:
    """The tensor's in-place version counter: it changes whenever the storage is written in place."""
    return int(tensor._version)


def sync_ddp_buffers(model: DistributedDataParallel) -> None:
    """Broadcast rank 0's module buffers, as DDP does at the start of a forward (when it syncs buffers at all)."""
    if model.will_sync_module_buffers():  # type: ignore[no-untyped-call]
        model._sync_buffers()  # type: ignore[no-untyped-call]
