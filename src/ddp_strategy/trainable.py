"""Which parameters DDP reduces: noticing that ``requires_grad`` changed after the wrapper was built.

``DistributedDataParallel`` registers its gradient hooks, once, on the parameters that require a gradient when it is
constructed. A parameter unfrozen afterwards (Lightning's ``BackboneFinetuning``, gradual unfreezing, adapters) then
gets gradients that are never all-reduced: every rank trains its own copy, silently. A parameter frozen afterwards
leaves the reducer waiting for a gradient that never comes.

:class:`TrainableSetWatcher` remembers the ``requires_grad`` flags DDP was built with and tells, before each training
step, whether they changed. The test is local, so nothing is exchanged while nothing changes, but it reads every
tracked parameter: inside a training step, where the step's own work has taken the caches, about 0.3 us per
parameter tensor (``bench/trainable_test.py``). The parameters that were frozen are read in one call into torch, the
others from Python up to the first one frozen. When it fires, the strategy makes the ranks agree on the new set over
the control plane (:func:`agree_on_trainable_set`) and builds a new DDP wrapper with the same options.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ._compat.torch import any_requires_grad
from .consistency import Comparison, Divergence, compare
from .control import ControlPlane, RankFailure, also_failed, first_failure
from .errors import CollectiveMismatchError, RankDivergenceError
from .positions import Position, format_ranks

__all__ = ["TrainableSet", "TrainableSetWatcher", "agree_on_trainable_set", "describe_change"]

_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_MAX_LISTED = 8


class TrainableSetWatcher:
    """The ``requires_grad`` flags a DDP wrapper was built with, and a cheap test of whether they changed."""

    def __init__(self) -> None:
        self._names: list[str] = []
        self._params: list[nn.Parameter] = []
        self._flags: list[bool] = []
        self._trainable_at_build: list[nn.Parameter] = []  # the parameters DDP reduces
        self._frozen_at_build: list[nn.Parameter] = []  # the others it tracks
        #: How many times the set changed and the wrapper was rebuilt in this run.
        self.rebuilds = 0

    def track(self, model: DistributedDataParallel) -> None:
        """Remember the flags of the parameters ``model`` reduces (those DDP ignores by design are left out)."""
        ignored = set(getattr(model, "parameters_to_ignore", ()) or ())
        named = [(name, param) for name, param in model.module.named_parameters() if name not in ignored]
        self._names = [name for name, _ in named]
        self._params = [param for _, param in named]
        self._flags = list(map(_REQUIRES_GRAD, self._params))
        self._trainable_at_build = [param for param, flag in zip(self._params, self._flags, strict=True) if flag]
        self._frozen_at_build = [param for param, flag in zip(self._params, self._flags, strict=True) if not flag]

    def changed(self) -> bool:
        """Whether any tracked parameter's ``requires_grad`` differs from when the wrapper was built (no I/O).

        Before every training step: a parameter unfrozen since (one call into torch for all of them), or one frozen
        since (read from Python, up to the first one found).
        """
        frozen = self._frozen_at_build
        unfrozen = bool(frozen) and any_requires_grad(frozen)  # no call for none: the usual, all trainable
        return unfrozen or not all(map(_REQUIRES_GRAD, self._trainable_at_build))

    def current(self) -> TrainableSet:
        """This rank's change: the parameters unfrozen and frozen since the wrapper was built."""
        now = list(map(_REQUIRES_GRAD, self._params))
        flags = list(zip(self._names, self._flags, now, strict=True))
        return TrainableSet(
            unfrozen=tuple(name for name, before, after in flags if after and not before),
            frozen=tuple(name for name, before, after in flags if before and not after),
            trainable=sum(now),
        )


@dataclass(frozen=True)
class TrainableSet:
    """One rank's change of the trainable set since the DDP wrapper was built (what the ranks agree on).

    Attributes:
        unfrozen: parameters that require a gradient now but did not then.
        frozen: parameters that required a gradient then but do not now.
        trainable: how many parameters require a gradient now.

    """

    unfrozen: tuple[str, ...]
    frozen: tuple[str, ...]
    trainable: int


def _listed(names: Sequence[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED])
    more = len(names) - _MAX_LISTED
    return shown + (f" and {more} more" if more > 0 else "") if names else "none"


def describe_change(change: TrainableSet) -> str:
    """``"now trainable: a, b; now frozen: none"``."""
    return f"now trainable: {_listed(change.unfrozen)}; now frozen: {_listed(change.frozen)}"


def agree_on_trainable_set(
    control: ControlPlane,
    change: TrainableSet,
    *,
    batch: int,
    step: int,
    weights: Comparison | None,
) -> None:
    """Make every rank that noticed a change agree that the change, and the weights, are the same on every rank.

    Called by a rank whose :meth:`TrainableSetWatcher.changed` fired before training batch ``batch``. A rank whose
    test did not fire never enters: once its published position shows it went on with batch ``batch``, the ranks
    waiting here stop within a heartbeat or two instead of waiting for the barrier timeout.

    Args:
        control: the control plane.
        change: this rank's change.
        batch: the training batch count of this run, this batch included (the same on every rank).
        step: the training step, for messages.
        weights: the weights to compare at the same time (a rebuilt wrapper starts from rank 0's copy, which must
            then be every rank's copy), or ``None``.

    Raises:
        RankDivergenceError: the ranks changed different parameters, some changed none, or their weights differ.

    """
    name = f"trainable-set:batch-{batch}"
    rank = control.rank

    def local() -> tuple[TrainableSet, list[tuple[int, int] | None] | None]:
        return change, weights.digests() if weights is not None else None

    def failed(failures: list[RankFailure]) -> BaseException:
        first = failures[0]
        return RankDivergenceError(
            f"Rank {first.rank} could not describe its trainable parameters: {first.message}{also_failed(failures)}",
            tensors=[],
            ranks=[f.rank for f in failures],
        )

    def decide(
        values: Sequence[tuple[TrainableSet, list[tuple[int, int] | None] | None] | RankFailure],
    ) -> Divergence | None:
        every = first_failure(failed)(values)
        changes = [value[0] for value in every]
        if any(c != changes[0] for c in changes[1:]):
            differing = [r for r, c in enumerate(changes) if c != changes[0]]
            table = "\n".join(f"  rank {r}: {describe_change(c)}" for r, c in enumerate(changes))
            raise RankDivergenceError(
                f"The set of trainable parameters changed differently on different ranks before training step "
                f"{step} (batch {batch} of this run):\n{table}\nDDP reduces the same parameters on every rank, so "
                "`requires_grad` must change the same way everywhere: make the change in code every rank runs "
                "(a callback, `on_train_epoch_start`), not under a rank-dependent branch.",
                tensors=sorted({n for c in changes for n in (*c.unfrozen, *c.frozen)}),
                ranks=differing,
            )
        digests = [value[1] for value in every]
        if weights is None or any(d is None for d in digests):
            return None
        return compare([d for d in digests if d is not None])

    def went_on(position: Position) -> bool:
        return position.kind == "training step" and position.batch is not None and position.batch >= batch

    try:
        divergence = control.agree(name, local, decide, passed=went_on)
    except CollectiveMismatchError as err:
        if err.reason != "went_on":
            raise
        raise RankDivergenceError(
            f"The set of trainable parameters changed on rank {rank} before training step {step} (batch {batch} of "
            f"this run; {describe_change(change)}), but rank(s) {format_ranks(list(err.missing_ranks))} went on "
            "training with the parameters DDP was built with: `requires_grad` was changed on some ranks only. DDP "
            "reduces the same parameters on every rank; make the change in code every rank runs (a callback, "
            "`on_train_epoch_start`), not under a rank-dependent branch.",
            tensors=[*change.unfrozen, *change.frozen],
            ranks=[rank],
        ) from err
    if divergence is not None and weights is not None:
        raise weights.error(
            control,
            divergence,
            outcome="(Found when the set of trainable parameters changed, before the DDP wrapper was rebuilt.)",
        )
