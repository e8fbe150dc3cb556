"""``StragglerMonitor``: per-rank step times, a warning naming a persistently slow rank, a CSV and a plot."""

from __future__ import annotations

import logging
import os
import socket
import time
from array import array
from pathlib import Path
from typing import Any, cast

from typing_extensions import override

from .._compat.lightning import Callback, pl, rank_zero_warn
from ..control import ControlPlane
from .straggler_report import PHASES, slow_rank_warning, slow_ranks, summarize, window_metrics, write_csv, write_png

__all__ = ["PHASES", "StragglerMonitor"]

log = logging.getLogger(__name__)


class StragglerMonitor(Callback):
    """Measure each rank's time per training batch, name a persistently slow rank, and plot the distributions.

    Every batch is split, with ``time.perf_counter`` only (no device synchronisation, no collective), into

    * ``data``: from the end of the previous batch to the start of this one (waiting for the dataloader, plus
      whatever other callbacks do there);
    * ``forward``: batch start to ``on_before_backward`` (``training_step``);
    * ``backward``: ``on_before_backward`` to ``on_after_backward``; it includes DDP's gradient all-reduce,
      which is where fast ranks wait for a slow one;
    * ``other``: ``on_after_backward`` to batch end (optimizer step, other hooks).

    A synchronised job makes every rank's total time per batch nearly equal; what differs is *where* the time
    goes: a slow rank spends it working, the others spend it waiting in the gradient sync. So ranks are compared
    on their *work* time, the batch time minus ``backward``. Every ``every_n_steps`` optimizer steps the ranks
    send the medians of their last window to rank 0 (one small gather on the control plane), which logs them to
    the Trainer's loggers and warns when a rank's work time exceeds ``slow_factor`` times the median of the other
    ranks in ``patience`` consecutive windows. At the end of ``fit`` rank 0 gathers every batch's times once and
    writes ``step_times.csv`` and (with matplotlib, the ``plots`` extra) ``step_times.png`` to ``output_dir``.

    On GPUs kernels run asynchronously, so the split shows where the *host* waited; the slow rank still stands
    out, because the host of a fast rank waits in the gradient all-reduce.

    Args:
        every_n_steps: compare ranks every this many optimizer steps (``trainer.global_step``).
        slow_factor: a rank is slow in a window when its median work time is above this many times the median
            of the other ranks' median work times (must be > 1).
        patience: warn after this many consecutive slow windows (the end-of-fit check over the whole run warns
            too, for runs shorter than that).
        output_dir: where the CSV and the PNG go. Default: ``<trainer.default_root_dir>/straggler``.
        plot: write the PNG (needs matplotlib; skipped with a warning when it is missing).
        max_batches: at most this many batches per rank are kept for the CSV and the plot; a longer run keeps an
            evenly spaced subset (every 2nd, 4th, ... batch), so memory and the final gather stay bounded.

    Raises:
        ValueError: an argument is out of range.

    Attributes:
        slow_ranks: on rank 0, the ranks named in a warning so far.
        csv_path: on rank 0 after ``fit``, the CSV written (``None`` before).
        png_path: on rank 0 after ``fit``, the PNG written (``None`` when not written).

    """

    def __init__(
        self,
        every_n_steps: int = 50,
        *,
        slow_factor: float = 1.5,
        patience: int = 3,
        output_dir: str | os.PathLike[str] | None = None,
        plot: bool = True,
        max_batches: int = 10_000,
    ) -> None:
        if not isinstance(every_n_steps, int) or isinstance(every_n_steps, bool) or every_n_steps < 1:
            raise ValueError(f"`every_n_steps` must be a positive integer, got {every_n_steps!r}.")
        if isinstance(slow_factor, bool) or not isinstance(slow_factor, (int, float)) or not slow_factor > 1:
            raise ValueError(f"`slow_factor` must be a number above 1 (e.g. 1.5), got {slow_factor!r}.")
        if not isinstance(patience, int) or isinstance(patience, bool) or patience < 1:
            raise ValueError(f"`patience` must be a positive integer, got {patience!r}.")
        if not isinstance(max_batches, int) or isinstance(max_batches, bool) or max_batches < 2:
            raise ValueError(f"`max_batches` must be an integer of at least 2, got {max_batches!r}.")
        self.max_batches = max_batches
        self.every_n_steps = every_n_steps
        self.slow_factor = float(slow_factor)
        self.patience = patience
        self.output_dir = None if output_dir is None else Path(output_dir)
        self.plot = plot
        self.slow_ranks: list[int] = []
        self.csv_path: Path | None = None
        self.png_path: Path | None = None
        self._reset()

    def _reset(self) -> None:
        self._window: dict[str, array[float]] = {phase: array("d") for phase in PHASES}
        self._history: dict[str, array[Any]] = {"batch": array("q"), "step": array("q")}
        self._history.update({phase: array("d") for phase in PHASES})
        self._batches = 0
        self._stride = 1
        self._last_checked = -1
        self._strikes: dict[int, int] = {}
        self._last_end: float | None = None
        self._start = 0.0
        self._step = 0
        self._before_backward: float | None = None
        self._after_backward: float | None = None
        self._warned_no_control = False

    # ------------------------------------------------------------------ timing (the hot path: no I/O)
    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reset()
        self.slow_ranks = []
        self.csv_path = self.png_path = None

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_end = time.perf_counter()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._last_end is not None:  # validation inside an epoch is not time spent waiting for data
            self._last_end = time.perf_counter()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._start = time.perf_counter()
        self._step = trainer.global_step
        self._before_backward = self._after_backward = None

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        self._before_backward = time.perf_counter()

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._after_backward = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        end = time.perf_counter()
        start = self._start
        forward_end = self._before_backward if self._before_backward is not None else end
        backward_end = self._after_backward if self._after_backward is not None else forward_end
        values = (start - self._last_end if self._last_end is not None else 0.0, forward_end - start,
                  backward_end - forward_end, end - backward_end)  # fmt: skip
        window = self._window
        for phase, value in zip(PHASES, values, strict=True):
            window[phase].append(value)
        if len(window["data"]) > self.max_batches:  # every_n_steps > max_batches: keep the recent half
            for series in window.values():
                del series[: len(series) // 2]
        if self._batches % self._stride == 0:
            self._keep(values)
        self._batches += 1
        self._last_end = end
        step = trainer.global_step
        if step > 0 and step % self.every_n_steps == 0 and step != self._last_checked:
            self._last_checked = step
            self._compare(trainer, step)

    def _keep(self, values: tuple[float, ...]) -> None:
        history = self._history
        history["batch"].append(self._batches)
        history["step"].append(self._step)
        for phase, value in zip(PHASES, values, strict=True):
            history[phase].append(value)
        if len(history["batch"]) > self.max_batches:  # keep every other one, and from now on every 2*stride-th
            for key, series in history.items():
                history[key] = series[::2]
            self._stride *= 2

    # ------------------------------------------------------------------ the periodic comparison
    def _take_window(self) -> dict[str, Any]:
        window = self._window
        self._window = {phase: array("d") for phase in PHASES}
        return summarize(socket.gethostname(), window)

    def _gather(self, trainer: pl.Trainer, obj: Any, name: str) -> list[Any] | None:
        """Gather ``obj`` from every rank onto rank 0 (``None`` elsewhere); only this rank's without a control plane."""
        control = getattr(trainer.strategy, "control_plane", None)
        if control is not None:
            return cast(ControlPlane, control).gather_object(obj, name=name)
        if trainer.world_size > 1 and not self._warned_no_control:
            self._warned_no_control = True
            rank_zero_warn(
                "StragglerMonitor compares ranks through SafeDDPStrategy's control plane, which this run does not "
                f"have ({type(trainer.strategy).__name__}); only rank 0's own times are reported."
            )
        return [obj] if trainer.is_global_zero else None

    def _compare(self, trainer: pl.Trainer, step: int) -> None:
        gathered = self._gather(trainer, self._take_window(), name=f"straggler:step-{step}")
        if gathered is None:
            return
        slow = slow_ranks(gathered, self.slow_factor)
        for rank in range(len(gathered)):
            self._strikes[rank] = self._strikes.get(rank, 0) + 1 if rank in slow else 0
            if self._strikes[rank] >= self.patience and rank not in self.slow_ranks:
                self._warn(rank, gathered, f"in {self.patience} consecutive windows of {self.every_n_steps} steps")
        self._log(trainer, gathered, slow, step)

    def _warn(self, rank: int, stats: list[dict[str, Any]], when: str) -> None:
        self.slow_ranks.append(rank)
        rank_zero_warn(slow_rank_warning(rank, stats, when, self.slow_factor))

    def _log(self, trainer: pl.Trainer, stats: list[dict[str, Any]], slow: dict[int, float], step: int) -> None:
        if not trainer.loggers:
            return
        metrics = window_metrics(stats, slow)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

    # ------------------------------------------------------------------ end of fit
    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        mine = {"host": socket.gethostname(), **self._history}
        gathered = self._gather(trainer, mine, name="straggler:final")
        if gathered is None:
            return
        folder = self.output_dir if self.output_dir is not None else Path(trainer.default_root_dir) / "straggler"
        folder.mkdir(parents=True, exist_ok=True)
        overall = [summarize(g["host"], g) for g in gathered]
        for rank in slow_ranks(overall, self.slow_factor):
            if rank not in self.slow_ranks:
                self._warn(rank, overall, f"over the whole run ({overall[rank]['batches']} batches)")
        self.csv_path = write_csv(folder / "step_times.csv", gathered)
        if self.plot:
            self.png_path = write_png(folder / "step_times.png", gathered, overall, self.slow_ranks)
