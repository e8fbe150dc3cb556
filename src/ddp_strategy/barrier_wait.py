"""One rank's side of a monitored barrier: arrive, wait for the decision, and the error that names who is missing.

The store protocol is in :mod:`ddp_strategy.store_barrier`; :class:`MonitoredBarrier` runs it for one rank of a
:class:`~ddp_strategy.control.ControlPlane`. Every rank arrives, then waits for the barrier's ``done`` key (a few
quick looks, then a blocking ``wait`` on a thread of its own). The first rank to arrive, the leader, looks at the
missing ranks once per scan interval and ends the barrier when one failed, went past it, or at the timeout; every
rank then raises the same :class:`~ddp_strategy.errors.CollectiveMismatchError`, naming the missing ranks and
where each was last seen.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta

from .errors import CollectiveMismatchError
from .positions import Position, format_ranks
from .store import Store, get_if_set
from .store_barrier import (
    SHOWN_POSITIONS,
    Outcome,
    abort,
    arrive,
    arrived,
    done_key,
    leave,
    read_positions_of,
    scan_interval,
)

__all__ = ["MonitoredBarrier"]

# the control plane's records keep the logger they had before the barrier's wait became a module of its own
log = logging.getLogger("ddp_strategy.control")

# a barrier's first looks at `done` before it blocks: the common case, every rank arriving within a few ms; beyond
# _QUICK_WORLD ranks the arrivals spread wider than that, and each look is W operations on the store: one look
_QUICK_POLLS, _QUICK_POLL, _QUICK_WORLD = 4, 0.002, 64
# how long a rank that is not the leader waits past the timeout for the leader's verdict before making its own
_LEADER_GRACE = 5.0
_REASONS = {"failed": "failed before arriving", "went_on": "went on without entering it"}


class _DoneWaiter:
    """A blocking ``wait`` for one key on a thread of its own; :attr:`finished` is set when it returns or fails."""

    def __init__(self, store: Store, key: str, timeout: float) -> None:
        self.finished = threading.Event()
        self.error: Exception | None = None
        self._store, self._key, self._timeout = store, key, timedelta(seconds=max(1.0, timeout))
        threading.Thread(target=self._run, name="ddp_strategy-barrier-wait", daemon=True).start()

    def _run(self) -> None:
        try:
            self._store.wait([self._key], self._timeout)
        except Exception as err:  # handed to the waiting thread, which names it
            self.error = err
        finally:
            self.finished.set()


class MonitoredBarrier:
    """The monitored barriers of one rank: the wait for each barrier's outcome, and the error when it failed.

    Every method that talks to the store takes the calling thread's connection (the training thread's); the
    blocking wait uses one of its own.

    Args:
        rank: this process's global rank.
        world_size: the number of ranks.
        timeout: how long a barrier waits for the other ranks.
        poll_interval: how often (seconds) the leader looks for failed or passed ranks; a heartbeat older than 3
            intervals is stale.
        waiter_store: the blocking wait's connection, opened in advance (``None``: opened by ``connect`` when first
            needed).
        connect: opens a new connection to the run's namespace of the store.
        desync_error: the desync every rank agreed on, if any (a waiting barrier raises it at once).

    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        timeout: timedelta,
        poll_interval: float,
        waiter_store: Store | None,
        connect: Callable[[], Store],
        desync_error: Callable[[], CollectiveMismatchError | None],
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.poll_interval = poll_interval
        #: the barrier the training thread waits in right now, and since when (set and cleared by the wait itself)
        self.waiting_in: tuple[str, float] | None = None
        self._waiter_store = waiter_store
        self._connect = connect
        self._desync_error = desync_error

    def run(
        self, store: Store, seq: int, name: str, site: str, entered: float, passed: Callable[[Position], bool] | None
    ) -> None:
        """Arrive at barrier ``seq`` (this rank's position already published), wait for it, leave it.

        Raises:
            CollectiveMismatchError: the barrier failed (see ``ControlPlane.barrier``), or the store is gone.

        """
        try:
            arrival = arrive(store, seq, self.rank, self.world_size, name)
        except Exception as err:
            raise self.store_lost(name, site, err) from err
        outcome = arrival.outcome
        if outcome is None:
            self.waiting_in = (f"barrier {seq} '{name}'", entered)
            try:
                outcome = self.await_outcome(store, seq, name, site, entered, arrival.leader, passed)
            finally:
                self.waiting_in = None
        try:
            leave(store, seq, self.world_size)
        except Exception as err:  # the outcome is known; only the clean-up failed
            log.debug("ddp_strategy: rank %d could not clean up barrier %d: %s", self.rank, seq, err)
        if not outcome.ok:
            raise self.outcome_error(outcome, name, site, time.time() - entered)

    def await_outcome(
        self,
        store: Store,
        seq: int,
        name: str,
        site: str,
        entered: float,
        leader: bool,
        passed: Callable[[Position], bool] | None,
    ) -> Outcome:
        """Wait until barrier ``seq`` is decided (see :mod:`ddp_strategy.store_barrier`) and return how it ended.

        A few quick looks first (every rank arriving within milliseconds is the common case); then a blocking
        ``wait`` for ``done`` on a thread of its own, so that the store does no work while ranks wait and this thread
        stays responsive (Ctrl-C, an agreed desync). The leader (the first to arrive) scans the missing ranks once
        per scan interval and decides when one failed or went past, and at ``timeout``; another rank decides for
        itself only when the leader has not ``_LEADER_GRACE`` seconds after the timeout.
        """
        key = done_key(seq)
        try:
            for _ in range(_QUICK_POLLS if self.world_size <= _QUICK_WORLD else 1):
                value = get_if_set(store, key)
                if value is not None:
                    return Outcome.from_value(value)
                time.sleep(_QUICK_POLL)
        except Exception as err:
            raise self.store_lost(name, site, err) from err
        deadline = entered + self.timeout.total_seconds()
        waiter = _DoneWaiter(self._waiting_store(), key, deadline + _LEADER_GRACE + 60 - time.time())
        interval = scan_interval(self.poll_interval, self.world_size)
        next_scan = time.time() + interval
        try:
            while not waiter.finished.wait(min(0.5, interval)):
                desync = self._desync_error()
                if desync is not None:  # the ranks' collectives diverged: this barrier is never completed
                    abort(store, seq, Outcome("desync", by=self.rank))
                    raise desync
                now = time.time()
                mine = leader or now >= deadline + _LEADER_GRACE
                if mine and (now >= next_scan or now >= deadline):
                    next_scan = now + interval
                    self._scan(store, seq, deadline, passed)
        except KeyboardInterrupt:
            self._abort_quietly(store, seq, Outcome("interrupted", missing=(self.rank,), by=self.rank))
            raise
        except CollectiveMismatchError:
            raise
        except Exception as err:
            raise self.store_lost(name, site, err) from err
        if waiter.error is not None:
            raise self.store_lost(name, site, waiter.error) from waiter.error
        try:
            return Outcome.from_value(store.get(key))
        except Exception as err:
            raise self.store_lost(name, site, err) from err

    def _scan(self, store: Store, seq: int, deadline: float, passed: Callable[[Position], bool] | None) -> None:
        """The leader's look at the missing ranks: end the barrier when one failed, went past, or at the deadline."""
        here = arrived(store, seq)
        missing = [rank for rank in range(self.world_size) if rank not in here]
        if not missing:
            return  # the last rank is deciding right now
        positions = read_positions_of(store, missing)
        failed = [r for r, p in positions.items() if p is not None and p.kind == "failed"]
        went_on = passed is not None and any(
            p is not None and p.kind != "failed" and passed(p) for p in positions.values()
        )
        if not (failed or went_on or time.time() >= deadline):
            return
        reason = "failed" if failed else "went_on" if went_on else "missing"
        shown = (failed + [r for r in missing if r not in failed])[:SHOWN_POSITIONS]
        outcome = Outcome(reason, tuple(missing), {r: positions[r] for r in shown}, by=self.rank)
        abort(store, seq, outcome)

    def _abort_quietly(self, store: Store, seq: int, outcome: Outcome) -> None:
        try:
            abort(store, seq, outcome)
        except Exception as err:  # best effort: the interrupt being raised is what matters
            log.debug("ddp_strategy: rank %d could not abort barrier %d: %s", self.rank, seq, err)

    def _waiting_store(self) -> Store:
        """The connection a barrier's blocking wait uses (its own: a blocked client cannot serve other calls)."""
        if self._waiter_store is None:
            self._waiter_store = self._connect()
        return self._waiter_store

    def outcome_error(self, outcome: Outcome, name: str, site: str, waited: float) -> BaseException:
        """The error every rank raises for barrier ``name`` (at ``site``) that ended with ``outcome``."""
        desync = self._desync_error()
        if outcome.reason == "desync" and desync is not None:
            return desync
        if outcome.reason == "names":
            return CollectiveMismatchError(
                f"Ranks reached different barriers at the same point: {outcome.table}. Rank {self.rank} was at "
                f"'{name}' ({site}). Every rank must call the same barriers in the same order; one rank skipped or "
                "added a barrier (look for a barrier inside a rank-dependent branch).",
                name=name,
                missing_ranks=[],
                reason="names",
            )
        if outcome.reason == "interrupted":
            return CollectiveMismatchError(
                f"Rank {self.rank} left barrier '{name}' ({site}): rank(s) {format_ranks(outcome.missing)} "
                "stopped waiting in it (interrupted, e.g. Ctrl-C); this rank stops too.",
                name=name,
                missing_ranks=list(outcome.missing),
                reason="failed",
            )
        if outcome.reason == "desync":
            return CollectiveMismatchError(
                f"Rank {self.rank} left barrier '{name}' ({site}): rank {outcome.by} found that the ranks' collectives "
                "diverged; its error above names where.",
                name=name,
                missing_ranks=[],
                reason="desync",
            )
        return self._timeout_error(name, site, outcome, waited)

    def _timeout_error(self, name: str, site: str, outcome: Outcome, waited: float) -> CollectiveMismatchError:
        now = time.time()
        missing, positions, reason = sorted(outcome.missing), outcome.positions, outcome.reason
        failed = reason == "failed"
        what = _REASONS.get(reason, "never arrived")
        lines = [
            f"Rank {self.rank} waited {waited:.1f} s at barrier '{name}' ({site or 'unknown site'}), "
            f"but rank(s) {format_ranks(missing)} {what} (barrier_timeout={self.timeout.total_seconds():g} s). "
            "Where they were last seen:"
        ]
        stale_after = max(1.0, 3 * self.poll_interval)
        for rank in sorted(positions):
            position = positions[rank]
            if position is None:
                where = "no position published here (it never reached this point, or its process never started)"
            else:
                where = position.describe(now)
                if position.kind != "failed" and position.heartbeat and now - position.heartbeat > stale_after:
                    where += " -- no heartbeat since: the process has probably died or is frozen"
            lines.append(f"  rank {rank}: {where}")
        if len(missing) > len(positions):
            lines.append(f"  ({len(missing) - len(positions)} more rank(s) not shown)")
        if failed:
            lines.append("Look at the failed rank's own error above for the cause; this rank stops too.")
        elif reason == "went_on":
            lines.append(
                "Their positions show that they went past the point where they would have entered, so they never "
                "will: the ranks took different branches here. This rank stops instead of waiting for the timeout."
            )
        else:
            lines.append(
                "Every rank must call the same barriers in the same order. A barrier inside "
                "`if trainer.is_global_zero:` (or any rank-dependent branch) is the usual cause: move it out of "
                "the branch. If the other ranks are just slow (a long prepare_data or checkpoint write), raise "
                "SafeDDPStrategy(barrier_timeout=...)."
            )
        return CollectiveMismatchError("\n".join(lines), name=name, missing_ranks=missing, reason=reason)

    def store_lost(self, name: str, site: str, err: Exception) -> CollectiveMismatchError:
        """The error of barrier ``name`` when the store could not be reached (rank 0, its host, is gone)."""
        return CollectiveMismatchError(
            f"Rank {self.rank} could not reach the rendezvous store at barrier '{name}' ({site or 'unknown site'}): "
            f"{err}. The store is hosted by rank 0's process (by the node-0 agent under torchrun), so rank 0 or "
            "node 0 has most likely exited or died; look at its output for the first error.",
            name=name,
            missing_ranks=[0],
            reason="store",
        )
