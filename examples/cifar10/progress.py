"""A minimal progress callback that prints one summary line per validation epoch on global rank zero."""

from __future__ import annotations

from collections.abc import Callable

from lightning.pytorch import Callback, LightningModule, Trainer

__all__ = ["EpochSummary"]


class EpochSummary(Callback):
    """Print ``epoch {e}: val_acc=... val_loss=...`` after every validation epoch, once per run.

    Only the global-rank-zero process prints, and the sanity-check validation before training is skipped.
    The values are read from ``trainer.callback_metrics``, which hold the epoch-level, cross-process-reduced
    metrics logged by the module (``val_acc`` and ``val_loss``). Printed values are kept in :attr:`history`.

    Args:
        printer: Function receiving each line (defaults to :func:`print` with flushing, so lines are not
            held back by output buffering when stdout is a pipe).

    """

    def __init__(self, printer: Callable[[str], None] | None = None) -> None:
        super().__init__()
        self.printer: Callable[[str], None] = printer if printer is not None else _print_flush
        self.history: list[dict[str, float]] = []

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Print and record the validation metrics of the epoch that just ended."""
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        metrics = trainer.callback_metrics
        if "val_acc" not in metrics or "val_loss" not in metrics:
            return
        acc = float(metrics["val_acc"])
        loss = float(metrics["val_loss"])
        self.history.append({"epoch": float(trainer.current_epoch), "val_acc": acc, "val_loss": loss})
        self.printer(f"epoch {trainer.current_epoch}: val_acc={acc:.4f} val_loss={loss:.4f}")


def _print_flush(line: str) -> None:
    print(line, flush=True)
