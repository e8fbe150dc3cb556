"""``ProgressHooks``: the Lightning hooks whose calls show that a rank's training thread makes progress.

:class:`~ddp_strategy.callbacks.HangWatchdog` derives from it. Each hook in :data:`PROGRESS_HOOKS` notes the time
and its own name (with the batch index or the epoch where it has one) as the rank's last progress; the watchdog
thread compares that time with its timeout and the report names the hook. The hooks are made from the table, one
entry per hook, so that Lightning finds each by name on the class and none can drift from the others.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeAlias

from .._compat.lightning import Callback, pl

__all__ = ["PROGRESS_HOOKS", "Detail", "ProgressHooks"]

#: What a hook adds to its name in the "last progress" text, from the hook's arguments after ``pl_module``
#: (positional and by keyword). ``None``: nothing.
Detail: TypeAlias = Callable[[pl.Trainer, tuple[Any, ...], dict[str, Any]], str] | None


def _epoch(trainer: pl.Trainer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    return f" (epoch {trainer.current_epoch})"


def _batch(position: int) -> Detail:
    """`` (batch N)``: ``batch_idx``, the hook's argument at ``position`` after ``pl_module`` (or passed by name)."""

    def detail(trainer: pl.Trainer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        return f" (batch {kwargs['batch_idx'] if 'batch_idx' in kwargs else args[position]})"

    return detail


_BATCH_START = _batch(1)  # (batch, batch_idx[, dataloader_idx])
_BATCH_END = _batch(2)  # (outputs, batch, batch_idx[, dataloader_idx])

#: Every Lightning hook that counts as progress, and what it adds to its name in the "last progress" text. The
#: hooks that also end a stage (``on_train_end``, ``on_validation_end``, ...) are ``HangWatchdog``'s own.
PROGRESS_HOOKS: dict[str, Detail] = {
    "on_fit_start": None,
    "on_sanity_check_start": None,
    "on_sanity_check_end": None,
    "on_train_start": None,
    "on_train_epoch_start": _epoch,
    "on_train_epoch_end": _epoch,
    "on_train_batch_start": _BATCH_START,
    "on_train_batch_end": _BATCH_END,
    "on_before_backward": None,
    "on_after_backward": None,
    "on_before_optimizer_step": None,
    "on_before_zero_grad": None,
    "on_validation_start": None,
    "on_validation_epoch_start": None,
    "on_validation_epoch_end": None,
    "on_validation_batch_start": _BATCH_START,
    "on_validation_batch_end": _BATCH_END,
    "on_test_start": None,
    "on_test_batch_start": _BATCH_START,
    "on_test_batch_end": _BATCH_END,
    "on_predict_start": None,
    "on_predict_batch_start": _BATCH_START,
    "on_predict_batch_end": _BATCH_END,
    "on_save_checkpoint": None,
}


class ProgressHooks(Callback):
    """A callback that notes, at each hook of :data:`PROGRESS_HOOKS`, when and where the training thread last was.

    A subclass calls :meth:`_note` in its ``__init__`` (the first progress) and reads ``_progress_at`` and
    ``_progress_what`` from another thread.
    """

    _progress_at: float  # time.monotonic() of the last progress
    _progress_what: str  # the hook (or life-cycle step) that made it

    def _note(self, what: str) -> None:
        """Record progress now, made by ``what``."""
        self._progress_at = time.monotonic()
        self._progress_what = what


def _progress_hook(name: str, detail: Detail) -> Callable[..., None]:
    """The hook ``name``: it notes ``name`` (plus ``detail`` of its arguments) as the last progress."""

    def hook(
        self: ProgressHooks, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        self._note(name if detail is None else name + detail(trainer, args, kwargs))

    hook.__name__, hook.__qualname__ = name, f"{ProgressHooks.__qualname__}.{name}"
    hook.__doc__ = f"Note ``{name}`` as this rank's last progress."
    return hook


for _name, _detail in PROGRESS_HOOKS.items():
    setattr(ProgressHooks, _name, _progress_hook(_name, _detail))
