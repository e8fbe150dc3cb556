"""Do all ranks still hold the same weights? The one comparison behind every weight-agreement check.

DDP keeps the replicas equal only as long as nothing changes them on some ranks only. This module compares them:
each rank fingerprints the tensors that must agree on its own device (two integers per tensor, see
:mod:`ddp_strategy.fingerprint`), the fingerprints are compared over the control plane, and only when they differ
are the differing tensors fetched, to report the largest difference. It is used

* by :class:`~ddp_strategy.SafeDDPStrategy` before every checkpoint save (the fingerprints travel in the save's
  own gather, see :func:`ddp_strategy.checkpoint.protocol.save`, so a save costs no extra collective), at the end
  of every training epoch, and when the set of trainable parameters changes;
* by :class:`~ddp_strategy.callbacks.WeightSyncCheck`, the "every N steps" setting of the same comparison.

Which tensors must agree (:meth:`WeightAgreement.tensors`): every parameter; the buffers only when DDP does not
re-broadcast them at each forward (``broadcast_buffers=False``, or no DDP wrapper): with the default
``broadcast_buffers=True`` every rank updates its buffers (BatchNorm statistics) with its own batch and DDP
overwrites them with rank 0's at the next forward, so they differ at every step's end by design and no difference
survives. Tensors DDP itself ignores (``_ddp_params_and_buffers_to_ignore``) are never compared.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from .control import ControlPlane
from .errors import RankDivergenceError
from .fingerprint import fingerprint_tensors, named_tensors
from .positions import format_ranks
from .unused_parameters import missing_gradients_cause

__all__ = [
    "LIKELY_CAUSES",
    "Comparison",
    "Divergence",
    "WeightAgreement",
    "buffers_rebroadcast",
    "compare",
]

#: A tensor to compare: ``(name, kind, tensor)``, kind being ``"parameter"``, ``"buffer"`` or ``"optimizer state"``.
NamedTensor = tuple[str, str, Tensor]
#: One rank's fingerprints, in the order of its compared tensors (``None`` for a tensor that cannot be read).
Digests = list[tuple[int, int] | None]

_MAX_LISTED = 5
#: Layers whose running statistics each rank updates from its own batch (``SyncBatchNorm`` is not one of them).
_PER_RANK_NORMS = (
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
)
_NORM_STATISTICS = ("running_mean", "running_var", "num_batches_tracked")

#: What usually makes replicas differ, quoted by every divergence message.
LIKELY_CAUSES = (
    "Likely causes: a rank-local edit (code that runs on some ranks only, e.g. under `if trainer.global_rank == 0:` "
    "or in a hook with a rank-dependent branch, changed these tensors); a change of `requires_grad` after DDP was "
    "built that DDP did not follow (stock DDPStrategy, or SafeDDPStrategy(track_trainable_set=False)), so some "
    "gradients were never all-reduced; a rank-local load (`load_state_dict` or a checkpoint loaded on some ranks "
    "only); or a buffer updated outside DDP with broadcast_buffers=False. Make such changes on every rank. Tensors "
    "that may legitimately differ can be skipped with `exclude=[...]` (WeightSyncCheck) or "
    "SafeDDPStrategy(weight_check_exclude=[...]); SafeDDPStrategy(weight_check=None) turns the default check off."
)


def buffers_rebroadcast(model: object) -> bool:
    """Whether ``model`` is a ``DistributedDataParallel`` that re-broadcasts rank 0's buffers at each forward."""
    return isinstance(model, DistributedDataParallel) and bool(getattr(model, "broadcast_buffers", False))


def _ignored_by_ddp(model: object) -> set[str]:
    """The parameter and buffer names DDP ignores (``_ddp_params_and_buffers_to_ignore``): rank-local by design."""
    if not isinstance(model, DistributedDataParallel):
        return set()
    return set(getattr(model, "parameters_to_ignore", ()) or ())


def _per_rank_statistics(module: nn.Module) -> set[str]:
    """Names of the running statistics of ``module``'s per-rank normalisation layers (BatchNorm, InstanceNorm)."""
    found: set[str] = set()
    for prefix, layer in module.named_modules():
        if isinstance(layer, _PER_RANK_NORMS):
            found.update(f"{prefix}.{name}" if prefix else name for name in _NORM_STATISTICS)
    return found


@dataclass(frozen=True)
class Divergence:
    """What differs between the ranks' fingerprints (the same on every rank that compared them).

    Attributes:
        indices: positions of the differing tensors in the compared list, first differing one first.
        ranks: the ranks whose values differ from rank 0's.
        counts: the number of tensors each rank compared, when they differ (the structure differs; ``indices`` is
            then empty), else ``()``.

    """

    indices: tuple[int, ...]
    ranks: tuple[int, ...]
    counts: tuple[int, ...] = ()


def compare(gathered: Sequence[Sequence[tuple[int, int] | None]]) -> Divergence | None:
    """Compare every rank's fingerprints with rank 0's; ``None`` when all agree.

    Args:
        gathered: each rank's fingerprints, indexed by rank.

    """
    counts = [len(digests) for digests in gathered]
    if len(set(counts)) > 1:
        return Divergence(
            indices=(), ranks=tuple(r for r, n in enumerate(counts) if n != counts[0]), counts=tuple(counts)
        )
    reference = gathered[0]
    indices = tuple(i for i in range(len(reference)) if any(other[i] != reference[i] for other in gathered[1:]))
    if not indices:
        return None
    ranks = tuple(r for r, other in enumerate(gathered) if any(other[i] != reference[i] for i in indices))
    return Divergence(indices=indices, ranks=ranks)


@dataclass
class Comparison:
    """One comparison of one rank's tensors with the other ranks' (every rank builds its own).

    Attributes:
        tensors: the tensors compared, in the same order on every rank.
        when: the moment, for messages, e.g. ``"by step 8"``.
        name: the name of the agreement, for the control plane's barriers and errors.

    """

    tensors: list[NamedTensor]
    when: str
    name: str

    def digests(self) -> Digests:
        """This rank's fingerprints (computed where each tensor lives; two integers per tensor reach the host)."""
        return [fp.digest for fp in fingerprint_tensors(self.tensors)]

    def error(
        self, control: ControlPlane, divergence: Divergence, outcome: str = "", cause: str = ""
    ) -> RankDivergenceError:
        """The error naming the differing tensors, the ranks and the largest differences. Every rank must call it.

        Fetching the largest differences is a collective (one gather of the listed tensors, only on a mismatch),
        so every rank that learnt ``divergence`` calls this, and raises (or warns with) what it returns.

        Args:
            control: the control plane.
            divergence: what :func:`compare` found.
            outcome: a sentence on what was done about it, e.g. that a checkpoint was not written.
            cause: the cause found on this rank, said before the usual likely causes.

        """
        tail = f" {outcome}" if outcome else ""
        if divergence.counts:
            return RankDivergenceError(
                f"Ranks compare different numbers of tensors {self.when} ({list(divergence.counts)} by rank): the "
                f"model or optimizer structure differs between ranks.{tail}",
                tensors=[],
                ranks=divergence.ranks,
            )
        shown = list(divergence.indices[:_MAX_LISTED])
        largest = _largest_differences(control, self.tensors, shown, name=f"weight-values:{self.name}")
        listed = ", ".join(
            f"{self.tensors[i][1]} '{self.tensors[i][0]}' (max |difference| {largest[j]:.3g})"
            for j, i in enumerate(shown)
        )
        more = len(divergence.indices) - len(shown)
        more_text = f" and {more} more" if more > 0 else ""
        return RankDivergenceError(
            f"Model replicas diverged {self.when}: {listed}{more_text} differ on rank(s) "
            f"{format_ranks(list(divergence.ranks))} from rank 0.{tail} {cause + ' ' if cause else ''}{LIKELY_CAUSES}",
            tensors=[self.tensors[i][0] for i in divergence.indices],
            ranks=divergence.ranks,
        )


def _largest_differences(control: Any, tensors: list[NamedTensor], indices: list[int], *, name: str) -> list[float]:
    """Max |difference| from rank 0 over all ranks, for a few tensors (the slow path, only on a mismatch)."""
    local = {tensors[i][0]: tensors[i][2].detach().to("cpu", copy=True) for i in indices}
    everyone = control.all_gather_object(local, name=name)
    result = []
    for i in indices:
        key = tensors[i][0]
        reference = everyone[0][key].double()
        result.append(max(float((other[key].double() - reference).abs().max()) for other in everyone[1:]))
    return result


class WeightAgreement:
    """Which tensors must agree across ranks, and the comparison of them.

    Args:
        exclude: ``fnmatch`` patterns of tensor names never to compare.
        include_optimizer_state: also compare the optimizers' state tensors (e.g. Adam moments).
        norm_statistics: with buffers compared (no re-broadcast), also compare the running statistics of
            BatchNorm/InstanceNorm layers. Each rank updates them from its own batch, so they differ by design
            unless the layers are ``SyncBatchNorm``; ``SafeDDPStrategy``'s default check leaves them out.

    """

    def __init__(
        self, *, exclude: Sequence[str] = (), include_optimizer_state: bool = False, norm_statistics: bool = True
    ) -> None:
        self.exclude = tuple(exclude)
        self.include_optimizer_state = include_optimizer_state
        self.norm_statistics = norm_statistics
        #: The training step of the last comparison that found every rank in agreement (the same on every rank).
        self.last_step: int | None = None

    def tensors(
        self, model: object, *, module: nn.Module | None = None, optimizers: Iterable[Any] = ()
    ) -> list[NamedTensor]:
        """The tensors to compare, in registration order (the same on every rank holding the same model).

        Args:
            model: the strategy's model: a ``DistributedDataParallel`` wrapper (whose options say which buffers
                must agree) or the module itself.
            module: the module whose tensors are compared (default: ``model``, unwrapped).
            optimizers: the optimizers, for ``include_optimizer_state``.

        """
        if module is None:
            if not isinstance(model, nn.Module):
                return []
            module = model.module if isinstance(model, DistributedDataParallel) else model
        ignored = _ignored_by_ddp(model)
        rebroadcast = buffers_rebroadcast(model)
        if not rebroadcast and not self.norm_statistics:
            ignored |= _per_rank_statistics(module)
        found = [t for t in named_tensors(module) if t[0] not in ignored and not (rebroadcast and t[1] == "buffer")]
        if self.include_optimizer_state:
            for i, optimizer in enumerate(optimizers):
                for index, state in optimizer.state_dict()["state"].items():
                    for key, value in state.items():
                        if isinstance(value, Tensor):
                            found.append((f"optimizer{i}.state.{index}.{key}", "optimizer state", value))
        return [t for t in found if not any(fnmatch.fnmatchcase(t[0], pattern) for pattern in self.exclude)]

    def comparison(
        self,
        model: object,
        *,
        when: str,
        name: str,
        module: nn.Module | None = None,
        optimizers: Iterable[Any] = (),
    ) -> Comparison:
        """A :class:`Comparison` of the tensors :meth:`tensors` selects."""
        return Comparison(self.tensors(model, module=module, optimizers=optimizers), when=when, name=name)

    def check(
        self,
        control: ControlPlane,
        model: object,
        *,
        step: int,
        name: str,
        module: nn.Module | None = None,
        optimizers: Iterable[Any] = (),
        moment: str = "",
    ) -> RankDivergenceError | None:
        """Compare now: one gather of the fingerprints on the control plane (every rank must call it).

        Args:
            control: the control plane.
            model: the strategy's model (see :meth:`tensors`).
            step: the training step, for messages and :attr:`last_step`.
            name: the name of the agreement.
            module: see :meth:`tensors`.
            optimizers: see :meth:`tensors`.
            moment: said after the step in messages, e.g. ``" (end of training epoch 1)"``.

        Returns:
            ``None`` when every rank agrees (and :attr:`last_step` becomes ``step``), else the error to raise or
            warn with, the same on every rank.

        """
        comparison = self.comparison(
            model, when=f"by step {step}{moment}", name=name, module=module, optimizers=optimizers
        )
        gathered = control.all_gather_object(comparison.digests(), name=name)
        divergence = compare(gathered)
        if divergence is None:
            self.last_step = step
            return None
        return comparison.error(control, divergence, cause=missing_gradients_cause(model))
