"""``WeightSyncCheck``: verify during training that every rank still holds the same weights."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from typing import Any, Literal

from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from .._compat.lightning import Callback, pl, rank_zero_warn
from ..errors import RankDivergenceError
from ..fingerprint import fingerprint_tensors, named_tensors
from ..positions import format_ranks

__all__ = ["WeightSyncCheck"]

_MAX_LISTED = 5


def _buffers_broadcast_each_forward(trainer: pl.Trainer) -> bool:
    """Whether the strategy's model is a ``DistributedDataParallel`` that re-broadcasts buffers at each forward."""
    model = getattr(getattr(trainer, "strategy", None), "model", None)
    return isinstance(model, DistributedDataParallel) and bool(getattr(model, "broadcast_buffers", False))


class WeightSyncCheck(Callback):
    """Every ``every_n_steps`` optimizer steps, compare a fingerprint of every parameter and buffer across ranks.

    DDP keeps replicas equal only if nothing changes them rank-locally; a rank-local edit, a rank-local checkpoint
    load or a buffer updated differently silently splits the model. The check exchanges two integers per tensor
    (one small gather on the control plane of :class:`~ddp_strategy.SafeDDPStrategy`); only when they differ does
    it fetch the differing tensors to report the largest difference.

    Args:
        every_n_steps: check after every this many optimizer steps (``trainer.global_step``).
        on_mismatch: ``"raise"`` a :class:`~ddp_strategy.errors.RankDivergenceError` on every rank, or ``"warn"``.
        exclude: ``fnmatch`` patterns of tensor names to skip, e.g. ``("*.running_mean", "*.running_var")`` for
            BatchNorm statistics with ``broadcast_buffers=False``. With DDP's default ``broadcast_buffers=True``,
            buffers are never compared: each rank updates them with its own batch and DDP overwrites them with
            rank 0's at the next forward, so they differ at every step's end by design.
        include_optimizer_state: also compare the optimizers' state tensors (e.g. Adam moments).

    Raises:
        ValueError: ``every_n_steps`` is not a positive integer or ``on_mismatch`` is unknown.

    """

    def __init__(
        self,
        every_n_steps: int = 100,
        *,
        on_mismatch: Literal["raise", "warn"] = "raise",
        exclude: Sequence[str] = (),
        include_optimizer_state: bool = False,
    ) -> None:
        if not isinstance(every_n_steps, int) or isinstance(every_n_steps, bool) or every_n_steps < 1:
            raise ValueError(f"`every_n_steps` must be a positive integer, got {every_n_steps!r}.")
        if on_mismatch not in ("raise", "warn"):
            raise ValueError(f"`on_mismatch` must be 'raise' or 'warn', got {on_mismatch!r}.")
        self.every_n_steps = every_n_steps
        self.on_mismatch = on_mismatch
        self.exclude = tuple(exclude)
        self.include_optimizer_state = include_optimizer_state
        self._last_checked = -1

    def _tensors(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> list[tuple[str, str, Tensor]]:
        tensors = list(named_tensors(pl_module))
        if _buffers_broadcast_each_forward(trainer):
            # With DDP's default broadcast_buffers=True each rank updates its buffers (BatchNorm statistics) with
            # its own batch, and DDP overwrites them with rank 0's at the start of the next forward: they differ
            # at every step's end by design, and no difference survives. Only parameters (and state) can drift.
            tensors = [t for t in tensors if t[1] != "buffer"]
        if self.include_optimizer_state:
            for i, optimizer in enumerate(trainer.optimizers):
                for index, state in optimizer.state_dict()["state"].items():
                    for key, value in state.items():
                        if isinstance(value, Tensor):
                            tensors.append((f"optimizer{i}.state.{index}.{key}", "optimizer state", value))
        return [t for t in tensors if not any(fnmatch.fnmatchcase(t[0], pattern) for pattern in self.exclude)]

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step == 0 or step % self.every_n_steps or step == self._last_checked:
            return
        self._last_checked = step
        self.check(trainer, pl_module)

    def check(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Run the comparison now (every rank must call it)."""
        control = getattr(trainer.strategy, "control_plane", None)
        if control is None:
            if trainer.world_size > 1:
                rank_zero_warn("WeightSyncCheck needs SafeDDPStrategy (its control plane); the check is skipped.")
            return
        tensors = self._tensors(trainer, pl_module)
        digests = [fp.digest for fp in fingerprint_tensors(tensors)]
        gathered = control.all_gather_object(digests, name=f"weight-sync:step-{trainer.global_step}")
        counts = {len(g) for g in gathered}
        if len(counts) > 1:
            raise RankDivergenceError(
                f"Ranks compare different numbers of tensors at step {trainer.global_step} "
                f"({[len(g) for g in gathered]} by rank): the model or optimizer structure differs between ranks.",
                tensors=[],
                ranks=[r for r, g in enumerate(gathered) if len(g) != len(gathered[0])],
            )
        differing = [i for i in range(len(tensors)) if any(g[i] != gathered[0][i] for g in gathered[1:])]
        if not differing:
            return
        ranks = sorted({r for i in differing for r, g in enumerate(gathered) if g[i] != gathered[0][i]})
        largest = self._largest_differences(control, tensors, differing[:_MAX_LISTED])
        listed = ", ".join(
            f"{tensors[i][1]} '{tensors[i][0]}' (max |difference| {largest[j]:.3g})"
            for j, i in enumerate(differing[:_MAX_LISTED])
        )
        more = f" and {len(differing) - _MAX_LISTED} more" if len(differing) > _MAX_LISTED else ""
        message = (
            f"Model replicas diverged by step {trainer.global_step}: {listed}{more} differ on rank(s) "
            f"{format_ranks(ranks)} from rank 0. Something changed them on some ranks only (a rank-dependent edit "
            "or load, a buffer updated outside DDP with broadcast_buffers=False); exclude tensors that may "
            "legitimately differ with WeightSyncCheck(exclude=[...])."
        )
        if self.on_mismatch == "raise":
            raise RankDivergenceError(message, tensors=[tensors[i][0] for i in differing], ranks=ranks)
        rank_zero_warn(message)

    @staticmethod
    def _largest_differences(control: Any, tensors: list[tuple[str, str, Tensor]], indices: list[int]) -> list[float]:
        """Max |difference| from rank 0 over all ranks, for a few tensors (the slow path, only on a mismatch)."""
        local = {tensors[i][0]: tensors[i][2].detach().to("cpu", copy=True) for i in indices}
        everyone = control.all_gather_object(local, name="weight-sync:values")
        result = []
        for i in indices:
            name = tensors[i][0]
            reference = everyone[0][name].double()
            result.append(max(float((other[name].double() - reference).abs().max()) for other in everyone[1:]))
        return result
