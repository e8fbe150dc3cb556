"""The shape check before ``all_gather``: ranks that gather tensors of different shapes get one named error.

gloo aborts the whole process (``gloo::EnforceNotMet``, SIGABRT) when the ranks gather tensors of different sizes;
:func:`check_gather_shapes` compares every rank's shape and dtype first, in one small fixed-size gather.
"""

from __future__ import annotations

import zlib
from typing import Any

from .desync_verdict import rank_lines
from .errors import CollectiveMismatchError

__all__ = ["check_gather_shapes"]

_MAX_DIMS = 8


def check_gather_shapes(tensor: Any, *, group: Any = None, device: Any = None, site: str = "") -> None:
    """Before ``all_gather``: gather every rank's shape and dtype (one small fixed-size gather) and compare them.

    gloo aborts the whole process (``gloo::EnforceNotMet``, SIGABRT) when the ranks gather tensors of different
    sizes. A fixed-size gather of the shapes first lets every rank raise the same named error instead.

    Raises:
        CollectiveMismatchError: the ranks' tensors differ in shape or dtype (``reason="shapes"``).

    """
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) < 2:
        return
    shape = list(tensor.shape)
    if len(shape) > _MAX_DIMS:
        return
    meta = torch.tensor(
        [zlib.crc32(str(tensor.dtype).encode()), len(shape), *shape, *([0] * (_MAX_DIMS - len(shape)))],
        dtype=torch.int64,
        device=device,
    )
    gathered = [torch.empty_like(meta) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, meta, group=group)
    rows = [tuple(int(x) for x in g.tolist()) for g in gathered]
    if len(set(rows)) == 1:
        return
    described = {}
    for rank, row in enumerate(rows):
        dims = row[2 : 2 + row[1]]
        described[rank] = f"shape {list(dims)}" + ("" if row[0] == rows[0][0] else " (another dtype than rank 0's)")
    lines = [
        f"`all_gather` at {site or 'an unknown site'}: the ranks passed tensors of different shapes or dtypes, "
        "which the backend cannot gather (gloo aborts the process):",
        *rank_lines(described),
        "Every rank must gather a tensor of the same shape and dtype: pad to a common shape (gather the sizes "
        "first), or use `trainer.strategy.all_gather_object` / torchmetrics' `gather_all_tensors` for uneven shapes.",
    ]
    raise CollectiveMismatchError("\n".join(lines), name="all_gather", missing_ranks=[], reason="shapes")
