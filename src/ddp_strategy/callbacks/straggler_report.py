"""The statistics and outputs of :class:`~ddp_strategy.callbacks.StragglerMonitor`: plain functions, no collective.

A rank's batch times summarized (:func:`summarize`), each rank's work time against the others' (:func:`work_ratios`,
:func:`slow_ranks`), the warning naming a slow rank (:func:`slow_rank_warning`), the metrics logged every window
(:func:`window_metrics`), and the end-of-fit outputs (:func:`write_csv`, :func:`write_png`).
"""

from __future__ import annotations

import csv
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .._compat.lightning import rank_zero_warn

__all__ = [
    "PHASES",
    "median",
    "slow_rank_warning",
    "slow_ranks",
    "summarize",
    "window_metrics",
    "work_ratios",
    "write_csv",
    "write_png",
]

#: The phases of one training batch, in order; their sum is the batch's wall-clock time.
PHASES = ("data", "forward", "backward", "other")
_PER_RANK_METRICS_UP_TO = 16  # world sizes above this log only the summary metrics


def median(values: Any) -> float:
    """The median of ``values``, ``0.0`` when there are none."""
    return float(statistics.median(values)) if len(values) else 0.0


def summarize(host: str, series: Mapping[str, Sequence[float]]) -> dict[str, Any]:
    """One rank's summary of its batches: its host, the batch count and the medians of its times per batch.

    Args:
        host: the rank's host name.
        series: the seconds of each batch, per phase (:data:`PHASES`); other keys are ignored.

    Returns:
        ``host``, ``batches``, ``work`` (the batch time minus ``backward``, where fast ranks wait for a slow one),
        ``total`` and one entry per phase: the medians over the batches, in seconds.

    """
    n = len(series["data"])
    total = [sum(series[p][i] for p in PHASES) for i in range(n)]
    work = [total[i] - series["backward"][i] for i in range(n)]
    return {
        "host": host,
        "batches": n,
        "work": median(work),
        "total": median(total),
        **{p: median(series[p]) for p in PHASES},
    }


def work_ratios(stats: Sequence[Mapping[str, Any]]) -> list[float]:
    """Each rank's work time over the median work time of the other ranks (``stats``: :func:`summarize`'s)."""
    ratios = []
    for rank, mine in enumerate(stats):
        others = median([s["work"] for r, s in enumerate(stats) if r != rank])
        ratios.append(mine["work"] / others if others > 0 else 1.0)
    return ratios


def slow_ranks(stats: Sequence[Mapping[str, Any]], slow_factor: float) -> dict[int, float]:
    """The ranks whose work ratio (:func:`work_ratios`) is above ``slow_factor``, with it; none for one rank."""
    if len(stats) < 2:
        return {}
    return {rank: ratio for rank, ratio in enumerate(work_ratios(stats)) if ratio > slow_factor}


def slow_rank_warning(rank: int, stats: Sequence[Mapping[str, Any]], when: str, slow_factor: float) -> str:
    """The warning naming ``rank`` as persistently slower than the others ``when`` (``stats``: every rank's)."""
    mine = stats[rank]
    others = [s for r, s in enumerate(stats) if r != rank]
    work = median([s["work"] for s in others])
    backward = median([s["backward"] for s in others])
    return (
        f"StragglerMonitor: rank {rank} (host {mine['host']}) is persistently slower than the others {when}: "
        f"its median time per batch outside the gradient sync (data + forward + optimizer) is "
        f"{mine['work']:.4f} s, {mine['work'] / work if work > 0 else float('inf'):.1f}x the other ranks' "
        f"median ({work:.4f} s; slow_factor={slow_factor:g}), and they wait for it in backward "
        f"(DDP's gradient all-reduce: {backward:.4f} s against {mine['backward']:.4f} s on rank {rank}). "
        f"Its data wait is {mine['data']:.4f} s and its forward {mine['forward']:.4f} s: look at rank {rank}'s "
        "data loading, device or host load."
    )


def window_metrics(stats: Sequence[Mapping[str, Any]], slow: Mapping[int, float]) -> dict[str, float]:
    """The metrics logged for one window: the medians, the slowest rank, and per rank up to 16 ranks."""
    ratios = work_ratios(stats) if len(stats) > 1 else [1.0]
    slowest = max(range(len(stats)), key=lambda r: ratios[r])
    metrics: dict[str, float] = {
        "straggler/median_batch_s": median([s["total"] for s in stats]),
        "straggler/median_work_s": median([s["work"] for s in stats]),
        "straggler/slowest_rank": float(slowest),
        "straggler/slowest_ratio": ratios[slowest],
        "straggler/slow_ranks": float(len(slow)),
    }
    if len(stats) <= _PER_RANK_METRICS_UP_TO:
        for rank, s in enumerate(stats):
            metrics[f"straggler/rank{rank}_work_s"] = s["work"]
            metrics[f"straggler/rank{rank}_data_s"] = s["data"]
            metrics[f"straggler/rank{rank}_backward_s"] = s["backward"]
    return metrics


def write_csv(path: Path, gathered: Sequence[Mapping[str, Any]]) -> Path:
    """Write every kept batch of every rank (``gathered``: each rank's history) to ``path``, one row a batch."""
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


def write_png(
    path: Path, gathered: Sequence[Mapping[str, Any]], overall: Sequence[Mapping[str, Any]], warned: Sequence[int]
) -> Path | None:
    """Plot each rank's work per batch and where its batch time goes to ``path`` (needs matplotlib).

    Args:
        path: the PNG to write.
        gathered: each rank's history of batch times.
        overall: each rank's :func:`summarize` of its whole history.
        warned: the ranks a warning named as slow (shown in red).

    Returns:
        ``path``, or ``None`` (with a warning) when matplotlib is not installed.

    """
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
    slow = set(warned)
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
    median_work = 1000 * median([o["work"] for o in overall])
    left.axhline(median_work, color="grey", linestyle="--", linewidth=1, label=f"median of ranks {median_work:.1f} ms")
    shown = [r for r in ranks if r % every == 0 or r in slow]
    left.set_xticks(shown, [f"rank {r}" + (" (slow)" if r in slow else "") for r in shown], rotation=90 * (every > 1))
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
        ratios = work_ratios(overall)
        named = ", ".join(f"rank {r} ({ratios[r]:.1f}x the others' work)" for r in sorted(slow))
        title = f"StragglerMonitor: SLOW {named}"
    else:
        title = "StragglerMonitor: no persistently slow rank"
    fig.suptitle(f"{title}; {world} ranks, {batches} batches", color="tab:red" if slow else "black")
    fig.savefig(path, dpi=100)
    return path
