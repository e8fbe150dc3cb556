"""Bit-exact fingerprints of tensors, computed where the tensor lives.

A fingerprint is two integers computed from the raw bits of a tensor. Equal tensors (bit for bit, including NaNs
and signed zeros) always have equal fingerprints; any realistic difference (one changed element, swapped
elements) changes them. Only the two integers per tensor are exchanged, so comparing a model across ranks costs
one small gather whatever the model's size.

* CPU tensors: the CRC-32 of the tensor's bytes (zlib, zero-copy) and the byte count. A CRC-32 detects every
  change confined to 32 consecutive bits and any other change with probability ``1 - 2**-32``; it runs at several
  GB/s (0.06 s for 384 MiB on the 2-core benchmark machine, 5x faster than the BLAKE2b used before and 15x faster
  than integer arithmetic in torch), which matters because ``WeightSyncCheck`` fingerprints the whole model
  periodically during training. It is not a defence against deliberate collisions; nothing here needs one.
* Accelerator tensors: a plain sum and a position-weighted sum of the values viewed as integers, modulo
  ``2**31 - 1``, computed on the device so that nothing but two integers crosses to the host.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["TensorFingerprint", "fingerprint_module", "fingerprint_tensors", "named_tensors"]

_PRIME = 2**31 - 1
_ROW = 1024  # elements per row of the position weighting
_CHUNK = _ROW * 4096  # elements processed at once, bounds the temporary memory to ~32 MiB
_WEIGHT_MOD = 2**20 - 3  # keeps row sums below 2**62: |value| < 2**31, weight < 2**20, 1024 terms


@dataclass(frozen=True)
class TensorFingerprint:
    """The identity and content fingerprint of one named tensor.

    Attributes:
        name: the parameter or buffer name, e.g. ``"layer1.0.conv.weight"``.
        kind: ``"parameter"`` or ``"buffer"``.
        shape: the tensor's shape.
        dtype: the tensor's dtype, as a string such as ``"torch.float32"``.
        digest: the two fingerprint integers, or ``None`` for tensors that cannot be read (meta, sparse).

    """

    name: str
    kind: str
    shape: tuple[int, ...]
    dtype: str
    digest: tuple[int, int] | None

    @property
    def signature(self) -> tuple[str, str, tuple[int, ...], str]:
        """Everything but the values: what must agree before values can be compared."""
        return (self.name, self.kind, self.shape, self.dtype)


def named_tensors(module: nn.Module) -> Iterator[tuple[str, str, Tensor]]:
    """Yield ``(name, kind, tensor)`` for every parameter and buffer of ``module``, in registration order.

    Names of a ``DistributedDataParallel``-wrapped module are those of the inner module (no ``module.``).
    """
    inner = module.module if isinstance(module, nn.parallel.DistributedDataParallel) else module
    for name, param in inner.named_parameters():
        yield name, "parameter", param
    for name, buf in inner.named_buffers():
        yield name, "buffer", buf


@functools.cache
def _weights(device: torch.device) -> Tensor:
    """The fixed per-column weights of the positional sum, built once per device."""
    idx = torch.arange(1, _ROW + 1, dtype=torch.int64)
    return ((idx * 2654435761) % _WEIGHT_MOD + 1).to(device)


def _as_integers(tensor: Tensor) -> Tensor:
    """The tensor's bits as a flat integer tensor (int16/int32/uint8 lanes), without copying when possible."""
    flat = tensor.detach()
    if flat.is_complex():
        flat = torch.view_as_real(flat)
    flat = flat.contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        return flat.view(torch.uint8)
    nbytes = flat.numel() * flat.element_size()
    if flat.element_size() >= 4 and nbytes % 4 == 0:
        return flat.view(torch.int32)
    if flat.element_size() == 2:
        return flat.view(torch.int16)
    return flat.view(torch.uint8)


def _host_digest(tensor: Tensor) -> tuple[int, int]:
    """``(CRC-32 of a CPU tensor's bytes, byte count)``; ``zlib.crc32`` releases the GIL while it runs."""
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    data = flat.view(torch.uint8).numpy().data if flat.numel() else b""
    return zlib.crc32(data), len(data)


def _digest(tensor: Tensor) -> Tensor:
    """Two int64 values on the tensor's device: ``[sum mod p, position-weighted sum mod p]``."""
    ints = _as_integers(tensor)
    device = ints.device
    weights = _weights(device)
    total = torch.zeros((), dtype=torch.int64, device=device)
    positional = torch.zeros((), dtype=torch.int64, device=device)
    for start in range(0, ints.numel(), _CHUNK):
        chunk = ints[start : start + _CHUNK].to(torch.int64)
        total = (total + chunk.sum()) % _PRIME
        pad = (-chunk.numel()) % _ROW
        if pad:
            chunk = torch.nn.functional.pad(chunk, (0, pad))
        rows = chunk.view(-1, _ROW)
        row_sums = (rows * weights).sum(dim=1) % _PRIME
        first_row = start // _ROW
        row_ids = torch.arange(first_row + 1, first_row + 1 + rows.shape[0], dtype=torch.int64, device=device)
        positional = (positional + ((row_sums * (row_ids % _PRIME)) % _PRIME).sum()) % _PRIME
    return torch.stack([total, positional])


def fingerprint_tensors(tensors: list[tuple[str, str, Tensor]]) -> list[TensorFingerprint]:
    """Fingerprint named tensors; one device-to-host transfer per accelerator, however many tensors.

    Args:
        tensors: ``(name, kind, tensor)`` triples, as yielded by :func:`named_tensors`.

    """
    values: dict[int, tuple[int, int]] = {}
    pending: dict[torch.device, list[tuple[int, Tensor]]] = {}
    for i, (_, _, tensor) in enumerate(tensors):
        if tensor.layout != torch.strided or tensor.device.type == "meta":
            continue  # unreadable: the digest stays None
        if tensor.device.type == "cpu":
            values[i] = _host_digest(tensor)
        else:
            pending.setdefault(tensor.device, []).append((i, _digest(tensor)))
    for items in pending.values():  # one device-to-host transfer per device
        stacked = torch.stack([d for _, d in items]).cpu().tolist()
        for (i, _), pair in zip(items, stacked, strict=True):
            values[i] = (int(pair[0]), int(pair[1]))
    return [
        TensorFingerprint(name=name, kind=kind, shape=tuple(t.shape), dtype=str(t.dtype), digest=values.get(i))
        for i, (name, kind, t) in enumerate(tensors)
    ]


def fingerprint_module(module: nn.Module) -> list[TensorFingerprint]:
    """Fingerprint every parameter and buffer of ``module`` (see :func:`named_tensors`)."""
    return fingerprint_tensors(list(named_tensors(module)))
