"""``StragglerMonitor``: per-rank step times, a warning naming a persistently slow rank, a CSV and a plot."""

from __future__ import annotations

import csv
import logging
import os
import socket
import statistics
import time
from array import array
from pathlib import Path
from typing import Any, cast

from typing_extensions import override

from .._compat.lightning import Callback, pl, rank_zero_warn
from ..control import ControlPlane

__all__ = ["PHASES", "StragglerMonitor"]

log = logging.getLogger(__name__)

#: The phases of one training batch, in order; their sum is the batch's wall-clock time.
PHASES = ("data", "forward", "backward", "other")
_PER_RANK_METRICS_UP_TO = 16  # world sizes above this log only the summary metrics


def _median(values: Any) -> float:
    return float(statistics.median(values)) if len(values) else 0.0


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
        n = len(window["data"])
        medians = {phase: _median(window[phase]) for phase in PHASES}
        total = [sum(window[p][i] for p in PHASES) for i in range(n)]
        work = [total[i] - window["backward"][i] for i in range(n)]
        return {
            "host": socket.gethostname(),
            "batches": len(work),
            "work": _median(work),
            "total": _median(total),
            **medians,
        }

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
        slow = self._slow(gathered)
        for rank in range(len(gathered)):
            self._strikes[rank] = self._strikes.get(rank, 0) + 1 if rank in slow else 0
            if self._strikes[rank] >= self.patience and rank not in self.slow_ranks:
                self._warn(rank, gathered, f"in {self.patience} consecutive windows of {self.every_n_steps} steps")
        self._log(trainer, gathered, slow, step)

    def _ratios(self, stats: list[dict[str, Any]]) -> list[float]:
        """Each rank's work time over the median work time of the other ranks."""
        ratios = []
        for rank, mine in enumerate(stats):
            others = _median([s["work"] for r, s in enumerate(stats) if r != rank])
            ratios.append(mine["work"] / others if others > 0 else 1.0)
        return ratios

    def _slow(self, stats: list[dict[str, Any]]) -> dict[int, float]:
        if len(stats) < 2:
            return {}
        return {rank: ratio for rank, ratio in enumerate(self._ratios(stats)) if ratio > self.slow_factor}

    def _warn(self, rank: int, stats: list[dict[str, Any]], when: str) -> None:
        self.slow_ranks.append(rank)
        mine = stats[rank]
        others = [s for r, s in enumerate(stats) if r != rank]
        work = _median([s["work"] for s in others])
        backward = _median([s["backward"] for s in others])
        rank_zero_warn(
            f"StragglerMonitor: rank {rank} (host {mine['host']}) is persistently slower than the others {when}: "
            f"its median time per batch outside the gradient sync (data + forward + optimizer) is "
            f"{mine['work']:.4f} s, {mine['work'] / work if work > 0 else float('inf'):.1f}x the other ranks' "
            f"median ({work:.4f} s; slow_factor={self.slow_factor:g}), and they wait for it in backward "
            f"(DDP's gradient all-reduce: {backward:.4f} s against {mine['backward']:.4f} s on rank {rank}). "
            f"Its data wait is {mine['data']:.4f} s and its forward {mine['forward']:.4f} s: look at rank {rank}'s "
            "data loading, device or host load."
        )

    def _log(self, trainer: pl.Trainer, stats: list[dict[str, Any]], slow: dict[int, float], step: int) -> None:
        if not trainer.loggers:
            return
        ratios = self._ratios(stats) if len(stats) > 1 else [1.0]
        slowest = max(range(len(stats)), key=lambda r: ratios[r])
        metrics: dict[str, float] = {
            "straggler/median_batch_s": _median([s["total"] for s in stats]),
            "straggler/median_work_s": _median([s["work"] for s in stats]),
            "straggler/slowest_rank": float(slowest),
            "straggler/slowest_ratio": ratios[slowest],
            "straggler/slow_ranks": float(len(slow)),
        }
        if len(stats) <= _PER_RANK_METRICS_UP_TO:
            for rank, s in enumerate(stats):
                metrics[f"straggler/rank{rank}_work_s"] = s["work"]
                metrics[f"straggler/rank{rank}_data_s"] = s["data"]
                metrics[f"straggler/rank{rank}_backward_s"] = s["backward"]
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
        overall = [self._overall(g) for g in gathered]
        for rank in self._slow(overall):
            if rank not in self.slow_ranks:
                self._warn(rank, overall, f"over the whole run ({overall[rank]['batches']} batches)")
        self.csv_path = self._write_csv(folder / "step_times.csv", gathered)
        if self.plot:
            self.png_path = self._write_png(folder / "step_times.png", gathered, overall)

    @staticmethod
    def _overall(record: dict[str, Any]) -> dict[str, Any]:
        n = len(record["step"])
        total = [sum(record[p][i] for p in PHASES) for i in range(n)]
        work = [total[i] - record["backward"][i] for i in range(n)]
        return {
            "host": record["host"],
            "batches": n,
            "work": _median(work),
            "total": _median(total),
            **{p: _median(record[p]) for p in PHASES},
        }

    @staticmethod
    def _write_csv(path: Path, gathered: list[dict[str, Any]]) -> Path:
        with open(path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["rank", "host", "batch", "global_step", *(f"{p}_s" for p in PHASES), "total_s", "work_s"])
            for rank, record in enumerate(gathered):
                for i, (batch, step) in enumerate(zip(record["batch"], record["step"], strict=True)):
                    values = [record[p][i] for p in PHASES]
                    total = sum(values)
                    row = [rank, record["host"], batch, step, *(f"{v:.6f}" for v in values)]
                    writer.writerow([*row, f"{total:.6f}", f"{total - record['backward'][i]:.6f}"])
        return path

    def _write_png(self, path: Path, gathered: list[dict[str, Any]], overall: list[dict[str, Any]]) -> Path | None:
        try:
            from matplotlib.figure import Figure
        except ImportError:
            rank_zero_warn(
                "StragglerMonitor: matplotlib is not installed, so no plot was written (the CSV was). "
                "Install the `plots` extra: pip install 'ddp_strategy[plots]'."
            )
            return None
        world = len(gathered)
        ranks = list(range(world))
        slow = set(self.slow_ranks)
        fig = Figure(figsize=(min(24.0, max(9.0, 3.0 + 0.6 * world)), 4.8), layout="constrained")
        every = max(1, world // 32)  # tick labels for at most ~32 ranks per panel
        left, right = fig.subplots(1, 2)
        work = [
            [1000 * (sum(record[p][i] for p in PHASES) - record["backward"][i]) for i in range(len(record["step"]))]
            for record in gathered
        ]
        boxes = left.boxplot(work, positions=ranks, widths=0.6, patch_artist=True, showfliers=True)
        for rank, box in enumerate(boxes["boxes"]):
            box.set_facecolor("tab:red" if rank in slow else "tab:blue")
            box.set_alpha(0.7)
        median_work = 1000 * _median([o["work"] for o in overall])
        left.axhline(
            median_work, color="grey", linestyle="--", linewidth=1, label=f"median of ranks {median_work:.1f} ms"
        )
        shown = [r for r in ranks if r % every == 0 or r in slow]
        left.set_xticks(
            shown, [f"rank {r}" + (" (slow)" if r in slow else "") for r in shown], rotation=90 * (every > 1)
        )
        left.set_ylabel("ms per batch")
        left.set_title("Work per batch (data + forward + optimizer),\nexcluding the gradient-sync wait")
        left.legend(loc="upper left")
        bottom = [0.0] * world
        colours = {"data": "tab:orange", "forward": "tab:red", "backward": "tab:green", "other": "tab:purple"}
        labels = {
            "data": "data wait",
            "forward": "forward (training_step)",
            "backward": "backward + DDP sync wait",
            "other": "optimizer + hooks",
        }
        for phase in PHASES:
            heights = [1000 * o[phase] for o in overall]
            right.bar(ranks, heights, bottom=bottom, color=colours[phase], label=labels[phase], width=0.6)
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        right.set_xticks(shown, [f"rank {r}" for r in shown], rotation=90 * (every > 1))
        right.set_ylim(0, 1.4 * max(bottom) if max(bottom) > 0 else 1.0)  # room for the legend
        right.set_ylabel("median ms per batch")
        right.set_title("Where each rank's batch time goes (medians)")
        right.legend(loc="upper left", fontsize="small")
        batches = sum(o["batches"] for o in overall)
        if slow:
            ratios = self._ratios(overall)
            named = ", ".join(f"rank {r} ({ratios[r]:.1f}x the others' work)" for r in sorted(slow))
            title = f"StragglerMonitor: SLOW {named}"
        else:
            title = "StragglerMonitor: no persistently slow rank"
        fig.suptitle(f"{title}; {world} ranks, {batches} batches", color="tab:red" if slow else "black")
        fig.savefig(path, dpi=100)
        return path
