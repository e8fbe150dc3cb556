"""DDP's gradient-bucket layout, kept in checkpoints so that a resumed run reduces every gradient as the saved one did.

Why it matters: a ring all-reduce (gloo's, and NCCL's ring algorithm) cuts a bucket into one chunk per rank and sums
each chunk starting at a different rank, so the order in which an element's ``W`` values are added depends on where
the element lies in its bucket. Float addition is commutative but not associative: at 2 ranks every order gives the
same sum, from 3 ranks on another order can change the last bit of a weight. DDP fills its buckets in construction
order and rebuilds them once, in the order the gradients became ready, after the first backward pass: every later
step of a run reduces with the rebuilt layout. A resumed run builds a fresh DDP wrapper, whose first step would reduce
with the construction layout where the uninterrupted run used the rebuilt one (2^-33 on one weight, seen at 3 and 4
CPU ranks).

What :class:`BucketLayoutKeeper` does about it:

1. after every optimizer step, until it has happened, it asks DDP for the rebuild DDP would otherwise do at the start
   of the next forward pass (same layout, same broadcast of the bucket indices, just earlier), so that a checkpoint
   saved after any step holds the layout the next step reduces with;
2. it reads that layout once per wrapper and puts it into every checkpoint (parameter names, bucket by bucket, and
   the backend facts that choose the all-reduce algorithm);
3. a resumed run builds its DDP wrapper with the checkpoint's layout (when its trainable parameters are the same), so
   its first step reduces as the saved run's next step would have;
4. after the resumed run's own rebuild it compares: a layout that differs (gradients became ready in another order),
   or another backend, NCCL version or NCCL algorithm setting, is named in a warning at 3+ ranks, where it can change
   a last bit; never a silent difference.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ._compat.torch import ddp_bucket_parameters, ddp_construction_buckets, rebuild_ddp_buckets
from .checkpoint.keys import BUCKET_LAYOUT_KEY

__all__ = ["BucketLayout", "BucketLayoutKeeper", "reduction_facts"]

log = logging.getLogger(__name__)

_BUCKETS, _FACTS = "buckets", "reduction"
#: Environment variables that choose NCCL's all-reduce algorithm (and with it the order of the additions).
_NCCL_ALGORITHM_ENV = ("NCCL_ALGO", "NCCL_PROTO", "NCCL_NTHREADS", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS")


def reduction_facts() -> dict[str, str]:
    """What, besides the bucket layout, decides the order of the additions in DDP's gradient all-reduce.

    The backend of the default process group; for NCCL its version and the environment variables that select its
    algorithm (a resumed run on other hardware may let NCCL pick another algorithm; that is outside the strategy's
    control, so it is recorded and compared, not fixed).
    """
    facts = {"backend": str(dist.get_backend()) if dist.is_available() and dist.is_initialized() else "none"}
    if facts["backend"] == "nccl":
        version = torch.cuda.nccl.version() if torch.cuda.is_available() else ()  # type: ignore[no-untyped-call]
        facts["nccl"] = ".".join(str(part) for part in version) if isinstance(version, tuple) else str(version)
        facts.update({name: os.environ[name] for name in _NCCL_ALGORITHM_ENV if name in os.environ})
    return facts


@dataclass(frozen=True)
class BucketLayout:
    """Which parameters DDP reduces together, in reduction order: one tuple of parameter names per bucket.

    Attributes:
        buckets: the parameter names of each bucket, in the order of their gradients inside the bucket.
        reduction: :func:`reduction_facts` of the run that used the layout.

    """

    buckets: tuple[tuple[str, ...], ...]
    reduction: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, model: DistributedDataParallel) -> BucketLayout:
        """The layout ``model`` reduces with now (reads DDP's buckets: a transient buffer of the gradients' size)."""
        names = _parameter_names(model.module)
        return cls(
            buckets=tuple(tuple(names[id(p)] for p in bucket) for bucket in ddp_bucket_parameters(model)),
            reduction=tuple(sorted(reduction_facts().items())),
        )

    def to_dict(self) -> dict[str, Any]:
        """The checkpoint entry (plain lists and strings: loads with ``weights_only=True``)."""
        return {_BUCKETS: [list(bucket) for bucket in self.buckets], _FACTS: dict(self.reduction)}

    @classmethod
    def from_dict(cls, entry: object) -> BucketLayout | None:
        """The layout of a checkpoint entry, or ``None`` when it is absent or not of this shape."""
        if not isinstance(entry, dict):
            return None
        buckets, facts = entry.get(_BUCKETS), entry.get(_FACTS, {})
        if not isinstance(buckets, list) or not all(isinstance(b, list) for b in buckets):
            return None
        names = [name for bucket in buckets for name in bucket]
        if not all(isinstance(name, str) for name in names) or len(set(names)) != len(names):
            return None
        if not isinstance(facts, dict) or not all(isinstance(v, str) for v in facts.values()):
            return None
        return cls(tuple(tuple(bucket) for bucket in buckets), tuple(sorted(facts.items())))

    def indices_for(self, parameters: Sequence[torch.Tensor], module: nn.Module) -> list[list[int]] | None:
        """This layout as DDP's bucket indices into ``parameters``, or ``None`` when they are other parameters."""
        names = _parameter_names(module)
        position = {names.get(id(p), ""): i for i, p in enumerate(parameters)}
        mine = [name for bucket in self.buckets for name in bucket]
        if sorted(mine) != sorted(position) or "" in position:
            return None
        return [[position[name] for name in bucket] for bucket in self.buckets]

    def bucket_difference(self, saved: BucketLayout) -> str | None:
        """How this layout's buckets differ from ``saved``'s, in words, or ``None`` when they are the same."""
        if self.buckets == saved.buckets:
            return None
        pairs = zip(self.buckets, saved.buckets, strict=False)
        first = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(self.buckets), len(saved.buckets)))
        return (
            f"DDP rebuilt its gradient buckets in another order than the saved run (from bucket {first} on; "
            f"{len(self.buckets)} buckets here, {len(saved.buckets)} when saved): the gradients became ready in "
            "another order"
        )

    def reduction_difference(self, saved: BucketLayout) -> str | None:
        """Which :func:`reduction_facts` differ from ``saved``'s, in words, or ``None`` when none does."""
        mine, theirs = dict(self.reduction), dict(saved.reduction)
        differing = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        if not differing:
            return None
        changes = ", ".join(f"{k} {theirs.get(k, 'unset')} when saved, {mine.get(k, 'unset')} now" for k in differing)
        return f"the all-reduce may add in another order ({changes})"


def _parameter_names(module: nn.Module) -> dict[int, str]:
    """Parameter identity -> its first name in ``module`` (DDP reduces a shared parameter once)."""
    return {id(p): name for name, p in module.named_parameters()}


class BucketLayoutKeeper:
    """Keeps DDP's bucket layout across checkpoints (see the module docstring); one per strategy.

    Contract:
        - :meth:`resume_from` with the ``ddp_strategy`` section of a checkpoint being loaded, before the model is
          wrapped;
        - :meth:`constructing` around the construction of the DDP wrapper;
        - :meth:`after_optimizer_step` after every optimizer step, on every rank (it may run DDP's rebuild, which
          broadcasts), unless the wrapper is :attr:`settled`;
        - :meth:`state` for the checkpoint entry (``None``: DDP has not rebuilt, the construction layout is in use,
          and a resumed run starts with the same).
    """

    def __init__(self, world_size: int = 1) -> None:
        self.world_size = world_size
        self._saved: BucketLayout | None = None  # the layout of the checkpoint being resumed
        self._applied: BucketLayout | None = None  # the saved layout the current wrapper was built with
        self._current: BucketLayout | None = None  # the current wrapper's layout after its rebuild
        self._wrapper: DistributedDataParallel | None = None  # the wrapper _current belongs to
        #: The wrapper whose rebuild has run: until a new wrapper is built, :meth:`after_optimizer_step` has nothing
        #: to do (an identity test per step instead of a call).
        self.settled: DistributedDataParallel | None = None
        #: Why the last resumed run may reduce differently from the saved one (``None``: it reduces alike).
        self.mismatch: str | None = None

    def resume_from(self, section: object) -> None:
        """Take the layout of the checkpoint section being resumed (or none: the checkpoint has no layout)."""
        self._saved = BucketLayout.from_dict(section.get(BUCKET_LAYOUT_KEY) if isinstance(section, dict) else None)
        self.mismatch = None

    @contextmanager
    def constructing(self, module: nn.Module) -> Iterator[None]:
        """Build the DDP wrapper of ``module`` inside: it starts with the resumed checkpoint's layout, if any."""
        saved, self._saved = self._saved, None
        self._applied, self._current, self._wrapper, self.settled = None, None, None, None
        if saved is None:
            yield
            return

        def choose(parameters: Sequence[torch.Tensor]) -> list[list[int]] | None:
            indices = saved.indices_for(parameters, module)
            if indices is None:
                self._name_mismatch("the checkpoint's gradient buckets hold other parameters than the trainable ones")
            else:
                self._applied = saved
            return indices

        with ddp_construction_buckets(choose):
            yield
        now = BucketLayout(saved.buckets, tuple(sorted(reduction_facts().items())))
        difference = now.reduction_difference(saved) if self._applied is not None else None
        if difference is not None:
            self._name_mismatch(difference)

    def after_optimizer_step(self, model: object) -> None:
        """Run DDP's pending bucket rebuild now, once per wrapper; read the layout it chose and compare."""
        if not isinstance(model, DistributedDataParallel):
            return
        if model is not self._wrapper:
            self._wrapper, self._current, self.settled = model, None, None
        if self.settled is model or not rebuild_ddp_buckets(model):
            return
        self.settled = model
        self._current = BucketLayout.of(model)
        difference = self._current.bucket_difference(self._applied) if self._applied is not None else None
        if difference is not None:
            self._name_mismatch(difference)

    def state(self) -> dict[str, Any] | None:
        """The checkpoint entry: the layout the next step reduces with, or ``None`` for DDP's construction layout."""
        layout = self._current if self.settled is not None else self._applied
        return layout.to_dict() if layout is not None else None

    def _name_mismatch(self, what: str) -> None:
        self.mismatch = what
        if self.world_size >= 3:  # a sum of two floats does not depend on the order: only 3+ ranks can differ
            log.warning(
                "ddp_strategy: %s; from 3 ranks on, the resumed run may differ from an uninterrupted one in the last "
                "bits of the weights (bit-exact resume needs the same model, DDP options, backend and world size).",
                what,
            )
