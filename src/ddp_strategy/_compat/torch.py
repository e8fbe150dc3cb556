"""Private torch internals, behind names that say what they do (shared by both Lightning namespaces)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

__all__ = [
    "ddp_comm_hooks",
    "default_store",
    "detach_ddp_reducer",
    "new_store_connection",
    "reset_per_bucket_hook_state",
    "sync_ddp_buffers",
    "tensor_version",
]


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


def ddp_comm_hooks(model: DistributedDataParallel) -> list[tuple[Any, Any]]:
    """The ``(hook, state)`` pairs registered with ``model.register_comm_hook``, in registration order.

    Lightning's ``ddp_comm_hook``/``ddp_comm_wrapper`` options and hooks users register themselves both land here;
    DDP's own mixed-precision upcast hook and built-in C++ hooks do not.
    """
    return list(getattr(model, "_comm_hooks", []))


def reset_per_bucket_hook_state(state: Any) -> None:
    """Forget a communication hook's state that is kept per gradient bucket, before the buckets are reassigned.

    torch's PowerSGD hook keeps its error feedback and low-rank factors per bucket index; a new reducer assigns
    parameters to buckets anew, so the old entries would have the wrong shapes. They are rebuilt at the next step
    (error feedback restarts from zero). Other states are left alone.
    """
    for attribute in ("error_dict", "p_memory_dict", "q_memory_dict"):
        memory = getattr(state, attribute, None)
        if isinstance(memory, dict):
            memory.clear()


def detach_ddp_reducer(model: DistributedDataParallel) -> None:
    """Make a DDP wrapper that is being replaced stop reducing: remove its gradient hooks from the parameters.

    The reducer's autograd hooks (and the post-accumulate-grad hooks of the compiled "python reducer") stay on the
    parameters as long as the wrapper lives; a second wrapper on the same parameters would otherwise all-reduce
    every gradient twice.
    """
    model._remove_autograd_hooks()  # type: ignore[no-untyped-call]
    for handle in getattr(model, "_accum_grad_hooks", []):
        handle.remove()
    model._accum_grad_hooks = []
