"""The exception types raised by ``ddp_strategy``.

Every error says what happened, on which rank(s), and what to do about it. All of them derive from
:class:`DDPStrategyError`, so ``except ddp_strategy.DDPStrategyError`` catches anything this package raises
on purpose.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = [
    "CheckpointIntegrityError",
    "CheckpointMismatchError",
    "CheckpointWriteError",
    "CollectiveMismatchError",
    "DDPStrategyError",
    "DuplicateDeviceError",
    "RankDivergenceError",
    "RendezvousError",
    "SetupMismatchError",
    "ShardingError",
    "UnevenEvaluationError",
    "UnevenInputsError",
    "UnsafeCheckpointError",
    "UnusedParametersError",
]


class DDPStrategyError(RuntimeError):
    """Base class of every error raised by ``ddp_strategy`` on purpose."""


class DuplicateDeviceError(DDPStrategyError):
    """Two or more ranks were placed on the same accelerator device.

    Attributes:
        device: the device that is shared, e.g. ``"cuda:0"``.
        host: the host name of the machine the ranks run on.
        ranks: the global ranks sharing the device.

    """

    def __init__(self, message: str, *, device: str, host: str, ranks: Sequence[int]) -> None:
        super().__init__(message)
        self.device = device
        self.host = host
        self.ranks = tuple(ranks)


class SetupMismatchError(DDPStrategyError):
    """Ranks disagree on their set-up: library versions, world size, or parameter names and shapes.

    Attributes:
        fields: the names of the facts that differ between ranks, e.g. ``("torch", "world_size")``.

    """

    def __init__(self, message: str, *, fields: Sequence[str]) -> None:
        super().__init__(message)
        self.fields = tuple(fields)


class RendezvousError(DDPStrategyError):
    """The ranks did not all meet at the start: the rendezvous store was unreachable, or ranks were missing.

    Raised by every rank that reached the store when ``rendezvous_timeout`` ends (or the store's host went away),
    and by a rank that could not reach ``MASTER_ADDR:MASTER_PORT`` at all.

    Attributes:
        address: ``MASTER_ADDR:MASTER_PORT``.
        missing_ranks: the global ranks that never joined (``(0,)`` for an unreachable store: rank 0 hosts it;
            empty when this rank could not tell).

    """

    def __init__(self, message: str, *, address: str, missing_ranks: Sequence[int]) -> None:
        super().__init__(message)
        self.address = address
        self.missing_ranks = tuple(missing_ranks)


class RankDivergenceError(DDPStrategyError):
    """Parameter or buffer values differ between ranks that should hold identical copies.

    Attributes:
        tensors: the names of the differing tensors, first differing one first.
        ranks: the global ranks whose values differ from rank 0's (or the majority's).

    """

    def __init__(self, message: str, *, tensors: Sequence[str], ranks: Sequence[int]) -> None:
        super().__init__(message)
        self.tensors = tuple(tensors)
        self.ranks = tuple(ranks)


class CollectiveMismatchError(DDPStrategyError):
    """A barrier or other collective was not reached by every rank in time, or ranks reached different ones.

    Attributes:
        name: the name of the barrier or collective that failed.
        missing_ranks: the global ranks that never arrived.
        reason: why: ``"missing"`` (they did not arrive within the timeout), ``"failed"`` (a missing rank published a
            failure), ``"went_on"`` (a missing rank's published position shows it went past this point without
            entering it, so it never will), ``"names"`` (ranks reached differently named barriers) or ``"store"``
            (the rendezvous store became unreachable).

    """

    def __init__(self, message: str, *, name: str, missing_ranks: Sequence[int], reason: str = "missing") -> None:
        super().__init__(message)
        self.name = name
        self.missing_ranks = tuple(missing_ranks)
        self.reason = reason


class UnevenInputsError(CollectiveMismatchError):
    """Ranks would run different numbers of training steps in an epoch, so DDP's gradient all-reduce would hang.

    Raised before the first step, when every rank's training batch count is known and they differ, and again
    before the first step of an epoch whose reloaded training dataloader gives the ranks different counts.

    Attributes:
        batches: each rank's number of training batches per epoch, in rank order.

    """

    def __init__(self, message: str, *, batches: Sequence[float]) -> None:
        counts = list(batches)
        most = max(counts)
        super().__init__(message, name="training batches", missing_ranks=[r for r, n in enumerate(counts) if n < most])
        self.batches = tuple(counts)


class CheckpointIntegrityError(DDPStrategyError):
    """A checkpoint file is truncated, altered, or not a checkpoint this package can verify.

    Attributes:
        path: the checkpoint file that failed verification.

    """

    def __init__(self, message: str, *, path: str) -> None:
        super().__init__(message)
        self.path = path


class UnsafeCheckpointError(DDPStrategyError):
    """A checkpoint needs arbitrary unpickling (it could run code) and loading it was not explicitly allowed.

    Attributes:
        path: the refused checkpoint file.

    """

    def __init__(self, message: str, *, path: str) -> None:
        super().__init__(message)
        self.path = path


class UnevenEvaluationError(DDPStrategyError):
    """A per-step collective was called during evaluation while ranks run different numbers of steps.

    With exact evaluation every sample goes to one rank, so ranks can take different numbers of evaluation steps;
    a collective inside a step (``self.log(..., on_step=True, sync_dist=True)``, ``self.all_gather``) would hang.
    """


class CheckpointWriteError(DDPStrategyError):
    """Writing a checkpoint failed; the previous checkpoint at that path is intact.

    Attributes:
        path: the checkpoint file that could not be written.

    """

    def __init__(self, message: str, *, path: str) -> None:
        super().__init__(message)
        self.path = path


class ShardingError(DDPStrategyError):
    """Ranks train on the same data: identical training batches, or DistributedSamplers that do not shard.

    Attributes:
        ranks: the global ranks involved (those receiving identical batches, or with inconsistent samplers).
        cause: one sentence naming the likely cause, as worked out from the training dataloader.

    """

    def __init__(self, message: str, *, ranks: Sequence[int], cause: str) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)
        self.cause = cause


class CheckpointMismatchError(DDPStrategyError):
    """A valid file that cannot be resumed from by this model: another model's checkpoint, or a bare state dict.

    Attributes:
        path: the checkpoint file.
        missing: keys of the model that the checkpoint lacks.
        unexpected: keys in the checkpoint that the model does not have.

    """

    def __init__(self, message: str, *, path: str, missing: Sequence[str] = (), unexpected: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.path = path
        self.missing = tuple(missing)
        self.unexpected = tuple(unexpected)


class UnusedParametersError(DDPStrategyError):
    """Trainable parameters took no part in the loss while DDP expects a gradient for each one.

    With DDP's default ``find_unused_parameters=False`` the gradients of such a parameter's bucket are never
    averaged, and the next step fails inside DDP.

    Attributes:
        parameters: per rank, the names (module paths, e.g. ``"aux_head.weight"``) of the parameters without a
            gradient.
        step: the training step (``trainer.global_step`` when it happened), ``None`` when not known.

    """

    def __init__(self, message: str, *, parameters: Mapping[int, Sequence[str]], step: int | None) -> None:
        super().__init__(message)
        self.parameters = {rank: tuple(names) for rank, names in parameters.items()}
        self.step = step
