"""``RecorderAudit``: when one rank audits its recorded collectives, within a budget of CPU and of GIL time.

The audit of calls the backend pairs silently (:class:`~ddp_strategy.collective_record.CallAudit`) needs the
Flight Recorder's entries with their stacks, and a dump of the recorder is one C++ call that holds the GIL for its
whole length, about 5 us per entry kept (15 us with cold caches) whatever is new in it. So:

* the recorder keeps few entries (:data:`~ddp_strategy.collective_record.TRACE_ENTRIES`), which bounds each dump's
  hold of the GIL (the training thread waits that long for it at most);
* the heartbeat thread dumps when half of the entries kept will be calls it has not seen, at the rate of calls
  since its last dump (read from the recorder's cheap counters then), and at the latest
  :data:`~ddp_strategy.collective_record.AUDIT_INTERVAL` after it, so that every call is audited while calls are
  few;
* and never sooner after a dump than that dump's CPU time divided by :data:`AUDIT_CPU_SHARE`: with many calls a
  second the audit samples them (each dump audits the newest entries) instead of taking more of the CPU;
* a recorder that keeps more entries than that (its size is taken when the process's first group is made: a group
  made before the strategy's keeps torch's 2000, whose dump holds the GIL 20-30 ms) ends the dumps during
  training as soon as a dump shows it (:meth:`RecorderAudit.note_size`, with a warning on rank 0); the dumps at
  stage ends and for a report stay;
* while the training thread trains it runs the beats (:meth:`~ddp_strategy.heartbeat.Heartbeat.note_step`), and a
  dump due at a beat comes at the training step after it, alone
  (:meth:`~ddp_strategy.heartbeat.Heartbeat.at_next_step`), its unpickling at the step after that and its parsing
  at the next (:meth:`RecorderAudit.continue_fetched`); the next beat publishes it. No step takes two of a beat,
  torch's dump, the unpickling and the parsing.

The calls each dump adds are kept (the newest :data:`~ddp_strategy.collective_record.REPORT_CALLS` per group) for
the reports of an inquiry.
"""

from __future__ import annotations

import json
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ._compat.torch import (
    collective_dump,
    collective_dump_pickled,
    collective_dump_unpickled,
    collective_status,
    collective_trace,
)
from .collective_record import (
    AUDIT_INTERVAL,
    TRACE_ENTRIES,
    CallAudit,
    CallNotes,
    CollectiveCall,
    calls_from_trace,
    first_published_difference,
)
from .store import LastingKey, Store

__all__ = ["AUDIT_CPU_SHARE", "OVERSIZED_RING", "RecorderAudit", "let_go_of_the_gil"]

#: The share of one CPU the audit's dumps may take on average (1e-4: 100 us per second).
AUDIT_CPU_SHARE = 1e-4
_AUDIT_KEY = "desync/audit/{rank}"
_PARSED_AT_ONCE = 4  # entries parsed between two short sleeps (the GIL let go): 0.1-0.4 ms of a loaded CPU
_YIELD = 1e-4  # seconds of such a sleep: a training thread waiting for the GIL takes it meanwhile
#: Rank 0's warning when a dump shows the recorder keeping more entries than the audit's (RecorderAudit.note_size)
OVERSIZED_RING = (
    "ddp_strategy: torch's Flight Recorder keeps {entries} collectives in this process, more than the {most} "
    "desync detection sizes it to: the process group was made before SafeDDPStrategy could size it "
    "(`init_process_group` called before the Trainer, or an earlier fit with another strategy), or "
    "TORCH_FR_BUFFER_SIZE is set. A dump of that many holds the GIL for milliseconds (torch's default size, 2000: "
    "20-30 ms), so the audit of recorded collectives no longer runs during training, only at stage "
    "ends and when ranks stop; the comparison of the strategy's own collectives goes on. For the audit during "
    "training, let SafeDDPStrategy make the process group (do not call `init_process_group` yourself before "
    "`Trainer.fit`) or set TORCH_FR_BUFFER_SIZE={most} in the launch environment."
)


def let_go_of_the_gil() -> None:
    """A short sleep: a training thread waiting for the GIL takes it meanwhile.

    A plain function, not a ``partial``: ``bench/step_pauses.py``'s profile function sees its ``sleep`` call.
    """
    time.sleep(_YIELD)


class RecorderAudit:
    """One rank's audit of its recorded collectives against the next rank's; see the module docs.

    Args:
        rank: this rank.
        world_size: the number of ranks.
        interval: the longest time between two audits while the recorder has new calls.
        entries: the entries the recorder keeps.
        cpu_share: the share of one CPU the dumps may take on average.

    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        *,
        interval: float = AUDIT_INTERVAL,
        entries: int = TRACE_ENTRIES,
        cpu_share: float = AUDIT_CPU_SHARE,
    ) -> None:
        self.rank, self.world_size = rank, world_size
        self.interval = interval
        self.entries = entries
        self.cpu_share = cpu_share
        #: the digests (and calls) of the recorded collectives audited so far
        self.calls = CallAudit()
        #: the store key this rank publishes its digests under
        self.key = _AUDIT_KEY.format(rank=rank)
        #: the next rank's key, which this rank compares with
        self.peer_key = _AUDIT_KEY.format(rank=(rank + 1) % world_size)
        self._peer = LastingKey(self.peer_key)
        self._status: dict[str, tuple[int, int]] = {}  # the recorder's counters at the last dump
        self._unpublished = False  # a dump added calls since this rank last published its digests
        self._pickled: bytes | None = None  # a training-thread dump, not unpickled yet
        self._fetched: list[dict[str, Any]] | None = None  # a training-thread dump's entries, not parsed yet
        self._budgeted = False  # whether their work counts in the budget (a dump of dump_if_due's, not dump_now's)
        self._scheduled_at: tuple[float, float] | None = None  # (when, CPU) of such a dump, scheduled at unpickling
        self._next = time.monotonic() + interval  # the heartbeat's next dump
        #: the entries of the first dump that held more than ``entries`` (no dumps during training since), else None
        self.oversized: int | None = None
        self._counted = (time.monotonic(), 0)  # (when, calls recorded by then) at the heartbeat's last dump
        self._lock = threading.Lock()

    def due(self) -> bool:
        """Whether the heartbeat should audit now: a dump is due, or one made elsewhere is not yet published."""
        return self._unpublished or self.dump_due()

    def dump_due(self) -> bool:
        """Whether the next dump is due (:meth:`dump_if_due` would dump now)."""
        return self.oversized is None and time.monotonic() >= self._next

    def note_size(self, entries: int) -> None:
        """The recorder keeps ``entries`` (a dump held them, or its known size): over :attr:`entries`, dumps end.

        Only the dumps during training end, once; the dumps at stage ends and when ranks stop go on.

        Torch's recorder takes its size from the environment when the process's first group is made. When that was
        not the strategy's group (``init_process_group`` called before the Trainer, an earlier fit with another
        strategy) or ``TORCH_FR_BUFFER_SIZE`` is set, it keeps more, torch's 2000 by default, and one dump of them
        holds the GIL for 20-30 ms (``bench/results/recorder_dump_cost-2000-*``): a pause of the training thread
        every few seconds. Rank 0 warns (:data:`OVERSIZED_RING`); the ledger of the strategy's own collectives, the
        dumps at stage ends and the reports of an inquiry go on.
        """
        if entries <= self.entries or self.oversized is not None:
            return
        self.oversized = entries
        if self.rank == 0:
            warnings.warn(OVERSIZED_RING.format(entries=entries, most=self.entries), UserWarning, stacklevel=2)

    def _dump(self, *, background: bool = True) -> int:
        """Add the recorder's new calls (one dump with stacks, unless its counters did not move); the calls made.

        On a ``background`` thread the recorder's counters are read first (a third of a dump's cost), and the GIL is
        let go (a short sleep) before torch's dump, between the dump and its unpickling, after both and between
        chunks of the parsing, so that a training thread waiting for it never waits longer than the longest of these
        parts. The training thread itself does not sleep (it would only wait longer) and dumps at once, the counters
        with the entries: while it trains, its collectives move them. Any dump supersedes a training-thread dump not
        parsed yet (it holds the newest).
        """
        let_go = let_go_of_the_gil if background else None
        with self._lock:
            self._drop_fetched()
            recorded: list[dict[str, Any]] = []
            if let_go:
                status = collective_status()
                if status != self._status:
                    let_go()
                    recorded = collective_trace(let_go)  # the GIL let go between the dump and its unpickling too
            else:
                recorded, status = collective_dump()
            self.note_size(len(recorded))
            if status != self._status:
                self._status = status
                if let_go:
                    let_go()
                self._add(recorded, let_go)
            return _calls(status)

    def _fetch(self) -> bool:
        """On the training thread: torch's dump alone; :meth:`continue_fetched` does the rest at the next steps.

        ``False`` at once, without a dump, when the heartbeat thread is dumping. Supersedes a dump not parsed yet.
        """
        if not self._lock.acquire(blocking=False):
            return False
        try:
            self._drop_fetched()
            self._pickled = collective_dump_pickled()
            return True
        finally:
            self._lock.release()

    def _drop_fetched(self) -> None:
        """Forget a training-thread dump not parsed yet (the lock held): a newer dump supersedes it."""
        self._pickled = self._fetched = self._scheduled_at = None
        self._budgeted = False

    def _add(self, recorded: list[dict[str, Any]], let_go: Callable[[], None] | None) -> None:
        """Parse the entries newer than those audited and add their calls (the lock held)."""
        newest = self.calls.newest
        entries = [
            e for e in recorded if int(e.get("collective_seq_id") or 0) > newest.get(str(e.get("pg_id", "?")), 0)
        ]
        chunk = _PARSED_AT_ONCE if let_go else max(1, len(entries))  # one parse: its stacks looked up once
        for start in range(0, len(entries), chunk):
            if start and let_go:
                let_go()
            # no notes: what a call was must come from its own stack, the same on every rank at any time
            self.calls.add(calls_from_trace(entries[start : start + chunk]))
        self._unpublished = True

    @property
    def fetched(self) -> bool:
        """Whether a training-thread dump waits for :meth:`continue_fetched`."""
        return self._pickled is not None or self._fetched is not None

    def continue_fetched(self) -> None:
        """On the training thread, at each step after its dump (:meth:`dump_now`, ``dump_if_due(background=False)``).

        The next piece of that dump's work: its unpickling (:meth:`_unpickle_fetched`), then its parsing
        (:meth:`_parse_fetched`), one a step: with cold caches torch's dump takes about 0.5 ms of a step, the
        unpickling 0.2 and the parsing 0.6 (``bench/results/step_pauses-dump-unpickle-*``). Nothing when the heartbeat
        thread is dumping (its dump supersedes this one).
        """
        if not self._lock.acquire(blocking=False):
            return
        try:
            if self._pickled is not None:
                self._unpickle_fetched(self._pickled)
            elif self._fetched is not None:
                self._parse_fetched(self._fetched)
        finally:
            self._lock.release()

    def _unpickle_fetched(self, pickled: bytes) -> None:
        """Unpickle a training-thread dump (the lock held); after a budgeted one, schedule the next dump.

        The recorder's counters come with the entries: the next dump's time is set here (:meth:`dump_if_due`), the
        unpickling's CPU counted with the dump's.
        """
        start = time.thread_time()
        self._pickled = None
        recorded, status = collective_dump_unpickled(pickled)
        self.note_size(len(recorded))
        if status != self._status:
            self._status, self._fetched = status, recorded
        if self._scheduled_at is not None:
            (when, took), self._scheduled_at = self._scheduled_at, None
            self._schedule(when, _calls(status), took + time.thread_time() - start)

    def _parse_fetched(self, fetched: list[dict[str, Any]]) -> None:
        """Parse a training-thread dump's entries (the lock held).

        Their CPU counts in the budget after a budgeted dump (not after :meth:`dump_now`'s).
        """
        start = time.thread_time()
        self._fetched = None
        self._add(fetched, None)
        if self._budgeted:
            self._next += (time.thread_time() - start) / self.cpu_share

    def update(self) -> dict[str, list[Any]]:
        """Add the recorder's new calls now and return this rank's publication (published at the next beat).

        Called by the training thread at a stage's end.
        """
        self._dump(background=False)
        with self._lock:
            return self.calls.publication()

    def dump_now(self) -> None:
        """Add the recorder's new calls now, whatever the budget, unless the heartbeat thread is dumping them.

        Called by the training thread as each training epoch starts (the previous epoch's last calls: its end hooks,
        its validation): once per epoch, without the pauses that let a training thread take the GIL (it is that
        thread). Torch's dump only: the unpickling and the parsing come at its next steps (:meth:`continue_fetched`),
        published at the next beat after them. None once the recorder showed more entries than the audit's
        (:meth:`note_size`).
        """
        if self.oversized is None:
            self._fetch()

    def dump_if_due(self, *, background: bool = True) -> None:
        """The audit's dump when one is due; then the next one's time.

        After a dump the next one comes when half of the entries kept will be new at the rate of calls since the
        last, at the latest ``interval`` later, and no sooner than the dump's CPU time allows (``cpu_share``).

        Args:
            background: on the heartbeat thread (see :meth:`_dump`); ``False``: on the training thread, which does
                not wait for a dump the heartbeat thread is in (it skips this one) and leaves the unpickling and the
                parsing to its next steps (:meth:`continue_fetched`); the next dump's time comes with the unpickling
                (the recorder's counters are in it), no dump due meanwhile. Published at the next beat after the
                parsing.

        """
        now = time.monotonic()
        if now < self._next or self.oversized is not None:
            return
        start = time.thread_time()
        if background:
            self._schedule(now, self._dump(), time.thread_time() - start)
        elif self._fetch():
            self._budgeted, self._scheduled_at = True, (now, time.thread_time() - start)
            self._next = now + self.interval  # until the unpickling schedules the next dump

    def _schedule(self, when: float, calls: int, took: float) -> None:
        """Set the next dump's time after one at ``when`` that found ``calls`` recorded and took ``took`` s of CPU."""
        then, counted = self._counted
        rate = (calls - counted) / max(when - then, 1e-3)
        gap = min(self.interval, self.entries / 2 / rate) if rate > 0 else self.interval
        self._counted = (when, calls)
        self._next = when + max(gap, took / self.cpu_share)

    def publish(self, store: Store, *, background: bool = True) -> dict[str, list[Any]] | None:
        """At a beat: audit when due (:meth:`dump_if_due`); after new calls, publish this rank's digests; them.

        ``background``: the beat runs on the heartbeat thread. ``False``: on the training thread, which does not dump
        here: the beat leaves the dump to a training step of its own (:meth:`dump_if_due` there), whose calls the
        next beat publishes, so that no step takes a beat and a dump (about 0.3 and 0.8 ms on a loaded 2-core VM).
        The publication is a ``set``: no answer of the store awaited. ``None`` when no new calls were audited.
        """
        if background:
            self.dump_if_due()
        with self._lock:
            if not self._unpublished:
                return None
            self._unpublished = False
            mine = self.calls.publication()
        store.set(self.key, json.dumps(mine))
        return mine

    def peer_published(self, store: Store) -> bool:
        """Whether the next rank has published its digests (a ``check`` until it has; then none: the key stays)."""
        return self._peer.is_set(store)

    @staticmethod
    def compare_with_peer(mine: dict[str, list[Any]], peer: bytes) -> tuple[str, int] | None:
        """The first call whose digest differs between ``mine`` (what :meth:`publish` returned) and ``peer``.

        ``peer``: the value of :attr:`peer_key`, read after this rank published ``mine`` (on the heartbeat thread,
        with the beat's other reads). Of two ranks that audited the same calls, the one that publishes second finds
        a difference.
        """
        return first_published_difference([mine, json.loads(peer)])

    def report_calls(self, notes: CallNotes, most: int) -> list[CollectiveCall]:
        """This rank's newest calls for a report (with stacks: costly): the recorder's, after those audited before.

        Per group at most ``most``, oldest first; ``what`` from ``notes`` where they name a call.
        """
        recorded = calls_from_trace(collective_trace(), notes)
        fresh = {(c.group, c.seq) for c in recorded}
        with self._lock:
            audited = {group: list(kept) for group, kept in self.calls.calls.items()}
        calls: list[CollectiveCall] = []
        for group in sorted({c.group for c in recorded} | set(audited)):
            older = [c for c in audited.get(group, ()) if (c.group, c.seq) not in fresh]
            noted = [_with_note(c, notes) for c in older]
            calls.extend(sorted(noted + [c for c in recorded if c.group == group], key=lambda c: c.seq)[-most:])
        return calls


def _calls(status: dict[str, tuple[int, int]]) -> int:
    """The collectives recorded in all, from the recorder's counters."""
    return sum(enqueued for enqueued, _ in status.values())


def _with_note(call: CollectiveCall, notes: CallNotes) -> CollectiveCall:
    """``call`` (audited without notes) with what ``notes`` say made it, where they name it."""
    what = notes.lookup(round(call.created * 1e9))
    return replace(call, what=what) if what else call
