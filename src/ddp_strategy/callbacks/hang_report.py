"""What a hung rank's report says: where its training thread is, its threads' stacks, and the cross-rank summary.

Pure functions of stacks, reports and published positions, used by :class:`~.hang_alarm.HangAlarm` once the
alarm of :class:`~ddp_strategy.callbacks.HangWatchdog` is raised: :func:`locate` turns a stack into a place
(``"waiting"`` in a barrier or collective, or ``"running"`` its own code), :func:`dump_threads` formats every
thread's stack, and :func:`summarize` writes the one-screen summary of all ranks, with which ranks differ from the
rest (a rank gone, one running its own code while the others wait for it, uneven inputs, no majority).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from types import FrameType
from typing import Any

from ..positions import Position, format_ranks, is_user_path, short_path

__all__ = ["BEFORE_BATCH", "PER_BATCH_WAITS", "Frame", "dump_threads", "frames", "is_alive", "locate", "summarize"]

_C10D_COLLECTIVES = frozenset(
    {
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_single",
        "all_gather_object",
        "all_reduce",
        "all_to_all",
        "all_to_all_single",
        "barrier",
        "batch_isend_irecv",
        "broadcast",
        "broadcast_object_list",
        "gather",
        "gather_object",
        "monitored_barrier",
        "recv",
        "recv_object_list",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "scatter",
        "scatter_object_list",
        "send",
        "send_object_list",
        "wait",
    }
)
# the control plane's waits, as frames of control.py: a barrier (it calls the wait in barrier_wait.py) and the object
# collectives behind one
_CONTROL_WAITS = frozenset({"barrier", "all_gather_object", "gather_object", "broadcast_object"})
# Lightning (>= 2.5) broadcasts a SIGTERM flag from rank 0 before every training batch, from this function (unless
# SafeDDPStrategy has SIGTERM: it skips it, _compat/signals.py; HangWatchdog also runs with stock DDPStrategy)
BEFORE_BATCH = "_broadcast_sigterm_tensor"
PER_BATCH_WAITS = ("backward pass: DDP's gradient all-reduce", "DDP ")  # locate()'s texts of per-batch waits

Frame = tuple[str, int, str]  # (file name, line number, function name)


def _text(frame: Frame) -> str:
    return f"{short_path(frame[0])}:{frame[1]} in {frame[2]}"


def _is_user(frame: Frame) -> bool:
    return is_user_path(frame[0])


def frames(frame: FrameType | None) -> list[Frame]:
    """The stack of ``frame``, innermost first."""
    found: list[Frame] = []
    while frame is not None:
        found.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return found


def locate(stack: list[Frame], position: Position | None) -> tuple[str, str]:
    """Say where a rank's training thread is, from its stack (innermost frame first) and its published position.

    Returns:
        ``(state, where)``: ``state`` is ``"waiting"`` (in a barrier, a collective or DDP's gradient
        synchronisation: waiting for other ranks) or ``"running"`` (in its own code: a loop, a sleep, I/O);
        ``where`` is a description without times, so ranks at the same place get the same text.

    """
    user = next((_text(f) for f in stack if _is_user(f)), "")
    via = f" from {user}" if user else ""
    for f in stack:
        path = f[0].replace(os.sep, "/")
        if path.endswith("ddp_strategy/control.py") and f[2] in _CONTROL_WAITS:
            if position is not None and position.kind in ("barrier", "collective"):
                site = f" at {position.site}" if position.site else ""
                return "waiting", f"{position.kind} '{position.name}'{site}"
            return "waiting", f"a control-plane barrier{via}"
        if "/torch/distributed/" in path and f[2] in _C10D_COLLECTIVES:
            if any(g[2] == BEFORE_BATCH for g in stack):
                per_batch = f"Lightning's per-batch {BEFORE_BATCH}, before the next training batch"
                return "waiting", f"collective torch.distributed.{f[2]} ({per_batch}){via}"
            return "waiting", f"collective torch.distributed.{f[2]}{via}"
    if stack:
        path = stack[0][0].replace(os.sep, "/")
        if "/torch/autograd/" in path:
            return "waiting", f"backward pass: DDP's gradient all-reduce{via}"
        if path.endswith("torch/nn/parallel/distributed.py"):
            return "waiting", f"DDP {stack[0][2]} (buffer/parameter sync){via}"
    if user:
        return "running", f"its own code at {user}"
    return "running", f"code at {_text(stack[0])}" if stack else "an unknown place (no Python stack)"


def dump_threads() -> str:
    """Every thread's Python stack, formatted like a traceback (most recent call last)."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    main = threading.main_thread().ident
    parts = []
    for ident, frame in sorted(sys._current_frames().items(), key=lambda item: item[0] != main):
        parts.append(f"Thread {names.get(ident, '<unknown>')} (ident {ident}), most recent call last:")
        parts.append("".join(traceback.format_stack(frame)).rstrip())
        parts.append("")
    return "\n".join(parts)


def summarize(
    reports: dict[int, dict[str, Any]],
    positions: dict[int, Position | None],
    world_size: int,
    *,
    trigger: str,
    exit_code: int,
    now: float | None = None,
    stale_after: float = 3.0,
) -> str:
    """The one-screen summary rank 0 prints: where each rank is, grouped, and which ranks differ from the rest.

    Args:
        reports: the reports the ranks published (see :meth:`.hang_alarm.HangAlarm.report`), by rank.
        positions: every rank's last published position (used for ranks without a report).
        world_size: the number of ranks.
        trigger: why the watchdog fired.
        exit_code: the code every rank exits with.
        now: the current wall-clock time (``time.time()``), for ages.
        stale_after: seconds without a heartbeat after which a rank without a report counts as gone; one whose
            heartbeat is newer is alive (its watchdog is off: it left the training loop, e.g. into teardown).

    """
    now = time.time() if now is None else now
    missing = [rank for rank in range(world_size) if rank not in reports]
    groups: dict[tuple[str, str], list[int]] = {}
    for rank, report in sorted(reports.items()):
        groups.setdefault((report["state"], report["where"]), []).append(rank)
    lines = [f"===== HangWatchdog: training hung; {trigger} =====", "Where each rank is:"]
    for (state, where), ranks in sorted(groups.items(), key=lambda item: item[1][0]):
        steps = sorted({reports[r]["step"] for r in ranks})
        step_text = ", ".join(str(s) for s in steps[:3]) + (", ..." if len(steps) > 3 else "")
        progress = reports[ranks[0]]["progress"]
        lines.append(
            f"  rank {format_ranks(ranks)}: {state} in {where}; training step {step_text}; "
            f"last progress: {progress} ({reports[ranks[0]]['idle']:.1f} s before the dump)"
        )
    alive = [rank for rank in missing if is_alive(positions.get(rank), now, stale_after)]
    for rank in missing[:8]:
        position = positions.get(rank)
        if rank in alive and position is not None:
            lines.append(
                f"  rank {rank}: alive, no report (its watchdog is off: it has left the training loop); "
                f"{position.describe(now)}"
            )
            continue
        seen = "never published a position" if position is None else f"last seen: {position.describe(now)}"
        lines.append(f"  rank {rank}: NO REPORT (dead, or frozen without running Python); {seen}")
    if len(missing) > 8:
        lines.append(f"  ... and {len(missing) - 8} more ranks without a report: {format_ranks(missing)}")
    lines.extend(_verdict(groups, [r for r in missing if r not in alive], alive, _uneven(reports, positions, alive)))
    dumps = [reports[r]["dump"] for r in sorted(reports) if reports[r].get("dump")]
    if dumps:
        folder = os.path.dirname(dumps[0])
        same = all(os.path.dirname(d) == folder for d in dumps)
        names = ", ".join(os.path.basename(d) if same else d for d in dumps[:8]) + (" ..." if len(dumps) > 8 else "")
        lines.append(f"Stack dumps (all threads): {names}" + (f" in {folder}" if same else ""))
    lines.append(f"Every rank now exits with code {exit_code}.")
    return "\n".join(lines)


def is_alive(position: Position | None, now: float, stale_after: float) -> bool:
    """Whether a rank's heartbeat is recent: it runs Python, even without a report."""
    return position is not None and position.kind != "failed" and now - position.heartbeat <= stale_after


def _uneven(reports: dict[int, dict[str, Any]], positions: dict[int, Position | None], alive: list[int]) -> str:
    """Uneven training inputs: a rank waits in a per-batch collective of an epoch another (live) rank ran out of.

    Rank ``b`` waits in DDP's gradient all-reduce or buffer sync, or in Lightning's per-batch broadcast; rank ``o``
    does not, and started fewer batches of that epoch (it ended the epoch, or left the training loop), or is in a
    later epoch. Ranks without a report count with their published position when alive (``alive``). Empty: none.
    """
    reached: dict[int, tuple[int, int]] = {
        r: (int(rep["epoch"]), int(rep["batches"])) for r, rep in reports.items() if rep.get("epoch") is not None
    }
    for rank in alive:
        position = positions.get(rank)
        if position is not None and position.epoch is not None:
            reached[rank] = (position.epoch, position.epoch_batch or 0)
    in_batch = [r for r, rep in reports.items() if rep.get("per_batch") and r in reached]

    def behind(o: int, b: int) -> bool:  # o ran out of the batches of b's epoch (it ended or left that epoch)
        (epoch_o, count_o), (epoch_b, count_b) = reached[o], reached[b]
        return epoch_o > epoch_b or (epoch_o == epoch_b and count_o < count_b)

    ran_out = sorted(o for o in reached if o not in in_batch and any(behind(o, b) for b in in_batch))
    if not ran_out:
        return ""
    counts = ", ".join(f"rank {r}: {n} (epoch {e})" for r, (e, n) in sorted(reached.items()))
    return (
        f"rank {format_ranks(ran_out)}: ran out of training batches while rank {format_ranks(in_batch)} still had "
        f"one (uneven inputs: the ranks' loaders yield different numbers of batches), so rank "
        f"{format_ranks(in_batch)} {'waits' if len(in_batch) == 1 else 'wait'} in a per-batch collective no other "
        f"rank enters. Batches started per rank in its epoch: {counts}. Give every rank the same number of batches "
        "(Lightning's DistributedSampler, or equal-length shards of an IterableDataset)"
    )


def _verdict(
    groups: dict[tuple[str, str], list[int]], missing: list[int], alive: list[int] | None = None, uneven: str = ""
) -> list[str]:
    waiting = sorted(r for (state, _), ranks in groups.items() if state == "waiting" for r in ranks)
    running = sorted(r for (state, _), ranks in groups.items() if state == "running" for r in ranks)
    found: list[str] = [uneven] if uneven else []
    if missing:
        found.append(f"rank {format_ranks(missing)}: gone (no report, heartbeat stopped): it died or exited early")
    if alive:
        verb = "waits" if len(waiting) == 1 else "wait"
        tail = f" while rank {format_ranks(waiting)} {verb} in it" if waiting else ""
        found.append(f"rank {format_ranks(alive)}: alive but outside the training loop (see above){tail}")
    if running and (waiting or missing):
        found.append(
            f"rank {format_ranks(running)}: running its own code (not in any collective) while "
            + (
                f"rank {format_ranks(waiting)} {'waits' if len(waiting) == 1 else 'wait'} for it"
                if waiting
                else "the others are gone"
            )
        )
    if not found and len(groups) > 1:
        sizes = sorted((len(ranks) for ranks in groups.values()), reverse=True)
        if sizes[0] > sizes[1]:
            largest = max(groups.values(), key=len)
            odd = sorted(r for ranks in groups.values() if ranks is not largest for r in ranks)
            found.append(f"rank {format_ranks(odd)}: at a different place than the others (see above)")
        else:
            found.append(
                "no majority: the ranks wait in different collectives (a rank-dependent branch around a barrier "
                "or collective is the usual cause)"
            )
    if not found:
        return [
            "Differs from the rest: none; every rank is at the same place (a collective all ranks entered hangs: "
            "look at the network or backend, or every rank is stuck in the same code)."
        ]
    return ["Differs from the rest:", *(f"  {line}" for line in found)]
