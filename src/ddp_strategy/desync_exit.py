"""How the ranks go down together once they agreed on a desync: rank 0, which hosts the store, goes last.

Rank 0 hosts the rendezvous store the inquiry's reports and verdict are in: a rank that has not read the verdict
when rank 0 exits never learns it and fails with the backend's unnamed "Connection reset by peer". So each rank
counts itself in :data:`HOLDING_KEY` once it holds the verdict, rank 0 waits for all of them before it exits
(:func:`rank0_stopping`) and says so in :data:`RANK0_STOPPING_KEY`, which the others wait for (:func:`await_rank0`)
so that rank 0 prints the error first. Used by :class:`~ddp_strategy.desync.DesyncMonitor`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from .store import Store

__all__ = [
    "HOLDING_KEY",
    "RANK0_STOPPING_KEY",
    "VERDICT_WAIT",
    "await_rank0",
    "poll_pause",
    "rank0_gone",
    "rank0_stopping",
]

log = logging.getLogger("ddp_strategy.desync")

#: How many ranks hold the agreed error, one line per rank (rank 0 hosts the store: it waits for all of them).
HOLDING_KEY = "desync/holding"
#: Rank 0 has printed the agreed error (it may exit any moment now).
RANK0_STOPPING_KEY = "desync/rank0-stopping"
#: Seconds rank 0, before it exits, waits for the others to hold the verdict (the store is its).
VERDICT_WAIT = 6.0


def poll_pause(world_size: int) -> float:
    """Seconds between two looks at one key by every rank: 50 ms up to 64 ranks, then longer in proportion.

    All ranks together then look about 1300 times a second, whatever their number.
    """
    return 0.05 * max(1.0, world_size / 64)


def _holding(store: Store) -> set[int]:
    """The ranks that hold the agreed error (one key)."""
    if not store.check([HOLDING_KEY]):
        return set()
    return {int(line) for line in store.get(HOLDING_KEY).decode().split()}


def _a_silent_rank_among(control: Any, store: Store, ranks: Sequence[int]) -> bool:
    """Whether one of ``ranks`` failed or stopped its heartbeat: it never will do what is awaited of it."""
    if not ranks:
        return False
    positions = control.heartbeat.read_positions(store, ranks)
    now = time.time()
    stale = max(2.0, 4 * control.heartbeat.interval)
    return any(p is None or p.kind == "failed" or now - p.heartbeat > stale for p in positions.values())


def rank0_stopping(control: Any, store: Store | None = None, *, await_verdicts: bool = True) -> None:
    """On rank 0, before it exits with the agreed error: let the others take the verdict, then say it stops.

    Rank 0 first waits (at most ``VERDICT_WAIT`` seconds, less when a rank without it has died) until every rank
    holds the verdict. Best effort: the error being raised is what matters.

    Args:
        control: rank 0's control plane.
        store: the store connection to use (the calling thread's own); the training thread's by default.
        await_verdicts: ``False`` when every rank got the error from one gather (the end-of-stage comparison).

    """
    store = store if store is not None else control.store
    try:
        if await_verdicts:
            world = control.world_size
            deadline = time.monotonic() + VERDICT_WAIT
            next_look = time.monotonic()
            while time.monotonic() < deadline:
                holding = _holding(store)
                if len(holding) >= world:
                    break
                if time.monotonic() >= next_look:  # twice a second: whether a rank without it has died
                    next_look = time.monotonic() + 0.5
                    if _a_silent_rank_among(control, store, [r for r in range(world) if r not in holding]):
                        break
                time.sleep(0.05)
        store.set(RANK0_STOPPING_KEY, "1")
    except Exception as err:  # the error being raised is what matters
        log.debug("ddp_strategy: rank 0 could not announce its stop: %s", err)


def rank0_gone(store: Store) -> bool:
    """Whether rank 0 said it stops (:func:`rank0_stopping`), or its store cannot be reached: it has exited."""
    try:
        return bool(store.check([RANK0_STOPPING_KEY]))
    except Exception as err:  # rank 0 hosts the store: it is gone
        log.debug("ddp_strategy: rank 0's store is gone (%s)", err)
        return True


def await_rank0(control: Any, timeout: float = 3.0) -> None:
    """On another rank, before it exits with the agreed error: wait (at most ``timeout``) until rank 0 showed it.

    Under Lightning's subprocess launcher rank 0 is the parent of its node's other ranks and kills itself as soon
    as one of them exits with an error; waiting lets rank 0 print the error first.
    """
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and not control.store.check([RANK0_STOPPING_KEY]):
            time.sleep(poll_pause(control.world_size))
    except Exception as err:  # rank 0's store is gone: it has exited already
        log.debug("ddp_strategy: rank %d: rank 0's store is gone (%s)", control.rank, err)
