"""Per-rank random-number-generator state, in a form ``torch.load(weights_only=True)`` accepts.

Each rank's state (Python ``random``, NumPy's global generator, torch CPU, and torch CUDA when used) is captured
at save time, gathered into the one checkpoint by rank 0, and restored on each rank at resume, so dropout,
augmentation and shuffling continue exactly as in an uninterrupted run. When the world size changed, the saved
states cannot be mapped onto ranks: every rank is reseeded deterministically from the checkpoint's step and its
rank instead, and a warning says so.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import numpy as np
import torch

from .._compat.lightning import collect_rng_states, set_rng_states

__all__ = ["capture", "reseed", "restore"]


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]


def capture() -> dict[str, Any]:
    """This process's RNG states, using only tensors, numbers, strings, tuples and lists."""
    states = collect_rng_states(include_cuda=_cuda_in_use())
    name, keys, pos, has_gauss, cached = states["numpy"]
    states["numpy"] = (
        str(name),
        torch.from_numpy(np.asarray(keys, dtype=np.uint32).astype(np.int64)),
        int(pos),
        int(has_gauss),
        float(cached),
    )
    version, internal, gauss = states["python"]
    states["python"] = (int(version), list(internal), gauss)
    return states


def _on_cpu(obj: Any) -> Any:
    """``obj`` with every tensor moved to the CPU (containers rebuilt)."""
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {key: _on_cpu(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_on_cpu(value) for value in obj)
    return obj


def restore(states: dict[str, Any]) -> None:
    """Restore RNG states captured by :func:`capture` (CUDA states only when CUDA is in use here).

    The states may arrive on an accelerator (the strategy loads a checkpoint with ``map_location`` set to the rank's
    own device, which moves every tensor there); generator states are CPU tensors, so they are moved back first.
    """
    native = _on_cpu(dict(states))
    name, keys, pos, has_gauss, cached = native["numpy"]
    native["numpy"] = (
        name,
        np.asarray(keys.numpy() if isinstance(keys, torch.Tensor) else keys, dtype=np.uint32),
        pos,
        has_gauss,
        cached,
    )
    if not _cuda_in_use():
        native.pop("torch.cuda", None)
    set_rng_states(native)


def reseed(base: int, rank: int) -> int:
    """Seed Python, NumPy and torch (all devices) from ``(base, rank)``; returns the seed used.

    Used on resume when the world size differs from the checkpoint's: the same inputs give the same seeds, so
    such a resumed run is still reproducible, though not identical to the uninterrupted one.
    """
    digest = hashlib.sha256(f"ddp_strategy-reseed:{base}:{rank}".encode()).digest()
    seed = int.from_bytes(digest[:4], "little")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    return seed
