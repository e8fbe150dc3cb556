"""Name the other ranks behind an error that names none (a dead peer seen by the backend as a closed socket)."""

from __future__ import annotations

import time

from .control import ControlPlane
from .positions import Position

__all__ = ["describe_failed_peers"]


def _moved(before: Position | None, after: Position | None) -> bool:
    """Whether a rank showed life between two reads of its position (a new heartbeat, or a published failure)."""
    if after is None:
        return False
    return after.kind == "failed" or before is None or after.heartbeat > before.heartbeat


def describe_failed_peers(control: ControlPlane, rank: int, exception: BaseException) -> str | None:
    """Which other ranks failed first or are gone, after an error on ``rank`` that names no rank.

    A backend error for a dead peer (gloo's ``Connection closed by peer [127.0.0.1]:20362``) names an address.
    Peers that published a failure are named at once; peers whose heartbeat does not move within
    ``max(1 s, 3 heartbeat intervals)`` are named as gone.

    Args:
        control: this rank's control plane.
        rank: this rank's global rank.
        exception: the error this rank stops with.

    Returns:
        A message for the log, or ``None`` when every peer is alive (or there are none).

    """
    if control.world_size < 2:
        return None
    cause = f"{type(exception).__name__}: {exception}".splitlines()[0][:200]
    try:
        first = control.read_positions()
        failed = {r: p for r, p in first.items() if r != rank and p is not None and p.kind == "failed"}
        if failed:
            names = "; ".join(f"rank {r} {p.describe()}" for r, p in sorted(failed.items()))
            return (
                f"ddp_strategy: rank {rank} stops after {cause}. The first failure was on another rank: {names}. "
                "Look at that rank's own error for the cause."
            )
        pending = {r for r, p in first.items() if r != rank and p is not None}
        latest = first
        if control.heartbeat_interval > 0:
            deadline = time.monotonic() + max(1.0, 3 * control.heartbeat_interval)
            while pending and time.monotonic() < deadline:
                time.sleep(min(0.1, control.heartbeat_interval / 2))
                latest = control.read_positions()
                pending = {r for r in pending if not _moved(first[r], latest[r])}
        else:
            pending = set()
    except Exception as err:  # the store is gone with the process that hosts it
        return (
            f"ddp_strategy: rank {rank} stops after {cause}, and the rendezvous store is unreachable ({err}): rank 0 "
            "(or, under torchrun, node 0's agent), which hosts it, has most likely died or exited. Look at its output "
            "(or its exit signal) for the cause."
        )
    gone = sorted(pending | {r for r, p in first.items() if p is None and r != rank})
    if not gone:
        return None
    seen = "; ".join(
        f"rank {r}: "
        + (latest_position.describe() if (latest_position := latest[r]) is not None else "never published a position")
        for r in gone
    )
    return (
        f"ddp_strategy: rank {rank} stops after {cause}. Rank(s) {', '.join(map(str, gone))} stopped sending "
        f"heartbeats: killed (SIGKILL, out-of-memory killer), crashed without a Python error, or exited early. "
        f"Last seen: {seen}."
    )
