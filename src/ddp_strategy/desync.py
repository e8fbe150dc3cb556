"""Collective desync detection: ranks that diverge in their collective calls get one named error, within seconds.

DDP is correct only when every rank makes the same collective calls in the same order. torch's Flight Recorder
(:func:`~ddp_strategy._compat.torch.collective_trace`) numbers every collective of every process group per rank
and keeps its op, tensor sizes and Python stack, for gloo as for NCCL. torch runs it by default (2000 entries); the
strategy keeps 8 (a dump costs in proportion to the entries), and :class:`DesyncMonitor`, at each rank's heartbeat
(on the heartbeat thread, or on the training thread while it trains: :mod:`ddp_strategy.heartbeat`), uses it in two
steps:

1. **Watch, cheaply.** Each beat looks whether the training thread moved on since the last beat (a new training
   step, barrier or strategy collective: two attribute reads); only when it did not does it read the recorder's
   per-group counters (no stacks) and the training thread's innermost frame. A rank whose training thread waits,
   unchanged, in a collective
   or a barrier for :data:`STUCK_AFTER` seconds is *stuck*; it publishes that with its position and counts itself
   in one store counter. When the counter reaches the world size every rank is stuck: unless all wait in the same
   collective (the verdict tells), no rank can ever go on. A rank merely slow (rank 0 writing a large checkpoint
   while the others wait in the next collective) is not stuck, so nothing happens: that stays the hang timeout's
   business.
2. **Inquire, once.** The rank opens an *inquiry* in the rendezvous store; every rank publishes a
   :class:`RankReport` (its last collectives with their op, shapes, dtypes and innermost user frame, what it
   waits in, its epoch and batch); the rank whose report completes the count reads them all (batched), computes
   the verdict with :func:`find_divergence` and publishes it once: every rank reaches the same
   :class:`~ddp_strategy.errors.CollectiveMismatchError` (or :class:`~ddp_strategy.errors.UnevenInputsError`).
   The first collective whose calls differ between ranks is named even when the backend paired the calls (gloo
   pairs calls by order), then where each rank waits now.

A rank whose training thread waits in a control-plane barrier raises the error there. A rank blocked inside a
backend collective cannot be interrupted from Python; the lowest such rank prints the error and exits
(``os._exit``), which closes its connections, so that the collectives of the others return with a backend error,
which the strategy's launcher replaces by the agreed error (see ``SafeDDPStrategy``).

The calls themselves and their digests are in :mod:`ddp_strategy.collective_record`, when the heartbeat audits the
recorded calls in :mod:`ddp_strategy.desync_audit`, the verdict computed from the reports in
:mod:`ddp_strategy.desync_verdict`, how the ranks go down together after it in :mod:`ddp_strategy.desync_exit`, and
the shape check before ``all_gather`` in :mod:`ddp_strategy.gather_shapes`; this module re-exports their public
names.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

from ._compat.torch import collective_status, collective_trace
from .collective_record import (
    AUDIT_INTERVAL,
    REPORT_CALLS,
    TRACE_ENTRIES,
    CallAudit,
    CallLedger,
    CallNotes,
    CollectiveCall,
    LogSites,
    calls_from_trace,
)
from .control import ControlPlane, Store
from .desync_audit import RecorderAudit, let_go_of_the_gil
from .desync_exit import (
    HOLDING_KEY,
    RANK0_STOPPING_KEY,
    VERDICT_WAIT,
    await_rank0,
    poll_pause,
    rank0_gone,
    rank0_stopping,
)
from .desync_verdict import (
    INCOMPLETE,
    NO_VERDICT,
    RankReport,
    collective_wait,
    find_divergence,
    stale_waits,
    verdict_from_json,
    verdict_to_json,
)
from .errors import CollectiveMismatchError
from .gather_shapes import check_gather_shapes
from .store import LastingKey
from .store_barrier import POSITION_KEY

__all__ = [
    "AUDIT_INTERVAL",
    "STUCK_AFTER",
    "TRACE_ENTRIES",
    "CallAudit",
    "CallLedger",
    "CallNotes",
    "CollectiveCall",
    "DesyncMonitor",
    "LogSites",
    "RankReport",
    "RecorderAudit",
    "calls_from_trace",
    "check_gather_shapes",
    "collective_wait",
    "find_divergence",
    "stale_waits",
]

log = logging.getLogger(__name__)

#: Seconds a rank must wait, unchanged, in one collective or barrier before it counts as stuck.
STUCK_AFTER = 2.0
_INQUIRY_KEY = "desync/inquiry"  # the number of the newest inquiry (opened with compare_set: one opener wins)
_STUCK_KEY = "desync/stuck"  # how many ranks are stuck right now (each adds 1 when it gets stuck, -1 when it runs)
_REPORT_KEY = "desync/report/{inquiry}/{rank}"
_REPORTED_KEY = "desync/reported/{inquiry}"  # how many ranks reported; the one that makes it W decides
_VERDICT_KEY = "desync/verdict/{inquiry}"  # the decision, written once (compare_set), read by every rank
_READ_KEY = "desync/read/{inquiry}"  # how many ranks have read the verdict; the last deletes it
_REPORTS_PER_READ = 16  # reports of about 150 KB: one batched read of 16 is a few MB
_REPORT_WAIT = 6.0  # seconds an inquiry waits for every rank's report
_BREAK_AFTER = 1.0  # seconds after the verdict before a blocked rank 0 exits
#: Seconds a blocked rank other than 0 waits once rank 0 said it stops (or is gone): rank 0's exit makes the backend
#: return the others' collectives with an error, which they then raise as the agreed error through the launcher.
_AFTER_RANK0 = 2.0
#: Seconds after the verdict when a blocked rank other than 0 exits whatever rank 0 did: rank 0 says it stops at the
#: latest about _BREAK_AFTER + VERDICT_WAIT s after it (it waits for the others to hold the verdict first).
_BREAK_LATEST = _BREAK_AFTER + VERDICT_WAIT + _AFTER_RANK0
_EXIT_CODE = 1


_TORCH_DIR = f"{os.sep}torch{os.sep}"


def _training_thread_frame() -> FrameType | None:
    """The main thread's innermost Python frame (``None`` once that thread is gone)."""
    return sys._current_frames().get(threading.main_thread().ident or -1)


def _training_thread_in_torch() -> bool:
    """Whether the main thread's innermost Python frame is torch's own code (where it blocks in a collective)."""
    frame = _training_thread_frame()
    return frame is not None and _TORCH_DIR in frame.f_code.co_filename


def _frame_mark(frame: FrameType | None) -> tuple[int, CodeType, int] | None:
    """Where ``frame`` is (its identity, code and last instruction), without keeping the frame alive."""
    return None if frame is None else (id(frame), frame.f_code, frame.f_lasti)


def _open(store: Store, seen: int) -> int:
    """Open inquiry ``seen + 1`` unless a rank has opened a newer one (compare-and-set: one opener for many)."""
    return int(store.compare_set(_INQUIRY_KEY, str(seen), str(seen + 1)))


def _decide(store: Store, inquiry: int, world_size: int) -> None:
    """Read every rank's report of ``inquiry`` (batched), write the verdict once, delete the reports."""
    keys = [_REPORT_KEY.format(inquiry=inquiry, rank=r) for r in range(world_size)]
    reports: dict[int, RankReport] = {}
    for start in range(0, world_size, _REPORTS_PER_READ):
        values = store.multi_get(keys[start : start + _REPORTS_PER_READ])
        reports.update({start + i: RankReport.from_json(value) for i, value in enumerate(values)})
    store.compare_set(_VERDICT_KEY.format(inquiry=inquiry), "", verdict_to_json(find_divergence(reports)))
    for key in [*keys, _REPORTED_KEY.format(inquiry=inquiry)]:
        store.delete_key(key)


class DesyncMonitor:
    """Watches one rank's collectives at its heartbeat's beats and takes part in inquiries; see the module docs.

    A beat on the training thread (``control.heartbeat.inline``) reads nothing from the store: its reads, and the
    inquiries they may open or answer (which wait for every rank), run on the heartbeat thread (:meth:`_look`).

    Args:
        control: this rank's control plane (its heartbeat thread runs :meth:`beat`).
        notes: what made the strategy's own collectives.
        progress: ``(epoch, batches fetched in it)`` while training, else ``None`` (read by the heartbeat thread);
            without it, the epoch and batches started that the strategy noted with each training step.
        ledger: the count and digest of the strategy's own collectives, compared with the next rank's each beat.
        stuck_after: seconds of an unchanged wait before this rank counts as stuck.
        audit_interval: the longest time between two audits of the recorded collectives (:class:`RecorderAudit`).
        recorder_entries: the entries torch's Flight Recorder keeps in this process
            (:func:`~ddp_strategy._compat.torch.recorder_size`; by default the audit's own size, as when the strategy
            made the process's first group). More than the audit's ends its dumps during training from the start.

    """

    def __init__(
        self,
        control: ControlPlane,
        notes: CallNotes,
        *,
        progress: Callable[[], tuple[int, int] | None] | None = None,
        ledger: CallLedger | None = None,
        stuck_after: float = STUCK_AFTER,
        audit_interval: float = AUDIT_INTERVAL,
        recorder_entries: int = TRACE_ENTRIES,
    ) -> None:
        self.control = control
        self.notes = notes
        self.progress = progress
        self.ledger = ledger if ledger is not None else CallLedger()
        self._ledger_inquired = False
        self.stuck_after = stuck_after
        #: the audit of the recorded collectives (calls the backend pairs silently)
        self.recorder = RecorderAudit(control.rank, control.world_size, interval=audit_interval)
        self._next_look = 0.0  # the next look at the next rank's ledger and audit (once per heartbeat interval)
        self._audit_inquired: set[tuple[str, int]] = set()
        self._wait: tuple[str, float] = ("", 0.0)
        # (position, ledger) at the last beat: the training thread moved on when either changed (None: no beat yet)
        self._mark: tuple[object, tuple[int, int]] | None = None
        self._skipped_at = 0.0  # when the last beat skipped the counters (the training thread had moved on)
        self._peer_position = LastingKey(POSITION_KEY.format(rank=(control.rank + 1) % control.world_size))
        self._answered = 0  # the last inquiry this rank answered
        self._counted_stuck = False  # whether this rank counts itself in the store's count of stuck ranks
        self._inquired: set[str] = set()  # the stuck states this rank opened an inquiry for
        self._verdict_at: float | None = None
        # where the training thread was at the last beat after a verdict while a collective was pending
        self._blocked_at: tuple[int, CodeType, int] | None = None
        self._rank0_stopped_at: float | None = None  # when this rank first saw rank 0 stop, after a verdict
        self._shown = False  # this rank printed the agreed error already
        self._lock = threading.Lock()
        control.forget_at_close(self.recorder.key)
        control.forget_at_close(_INQUIRY_KEY, _STUCK_KEY, HOLDING_KEY, RANK0_STOPPING_KEY, shared=True)
        for counter in (_INQUIRY_KEY, _STUCK_KEY):  # both exist from now on: a beat reads them in one round trip
            control.store.add(counter, 0)
        # the first dump with stacks is the slowest: here, before training, on the training thread. A recorder the
        # strategy did not size (a group made before the strategy's) keeps torch's 2000 unless the environment says
        # otherwise: known here, before its first dump during training could hold them all
        self.recorder.note_size(max(len(collective_trace()), recorder_entries))
        control.heartbeat.add_beat(self.beat)

    # ------------------------------------------------------------------ watching
    def _current_wait(self) -> tuple[str, float]:
        now = time.time()
        barrier = self.control.in_barrier
        if barrier is not None:
            return barrier
        pending = [(group, enq) for group, (enq, done) in sorted(collective_status().items()) if enq > done]
        # a pending collective counts only while the training thread is inside torch's code (a collective's wait,
        # backward, DDP's forward): an asynchronous one stays pending while the thread runs the user's code
        what = f"collective {pending[0][0]}#{pending[0][1]}" if pending and _training_thread_in_torch() else ""
        if what and what == self._wait[0]:
            return self._wait
        return (what, now) if what else ("", 0.0)

    def _watched_wait(self) -> tuple[str, float]:
        """At a beat: :meth:`_current_wait`, unless the training thread moved on since the last beat (cheap).

        A new training step, barrier or strategy collective since the last beat means that it waits in nothing for
        long yet: the recorder's counters are not read. A wait seen at the next beat then counts from the skipped
        beat (it may have begun before it, where reading the counters would have seen it).
        """
        mark, last = (self.control.heartbeat.mark, self.ledger.state), self._mark
        moved = last is not None and (mark[0] is not last[0] or mark[1] != last[1])  # the first beat reads them
        self._mark = mark
        skipped_at, self._skipped_at = self._skipped_at, 0.0
        if moved and self.control.in_barrier is None:
            self._skipped_at = time.time()
            return ("", 0.0)
        what, since = self._current_wait()
        backdated = what.startswith("collective ") and 0 < skipped_at < since  # a barrier knows its own start
        return (what, skipped_at) if backdated else (what, since)

    def beat(self, store: Store) -> None:
        """One heartbeat: update this rank's wait and ledger, publish new audited calls; then :meth:`_look`.

        The look reads the store (answering an inquiry waits for every rank): in a beat on the training thread
        (``heartbeat.inline``), whose store calls are ``set`` calls that await no answer, it runs at the heartbeat
        thread's next wake-up, a fraction of an interval later (``Heartbeat.at_next_wake``); on the heartbeat thread,
        right away.
        """
        control = self.control
        heartbeat = control.heartbeat
        self._wait = self._watched_wait()
        what, since = self._wait
        waited = time.time() - since
        stuck = bool(what) and waited >= self.stuck_after
        heartbeat.set_waiting(what if stuck else "", since if stuck else 0.0)
        # answer inquiries quickly while one may come; once every rank answered one for this very wait without
        # finding a divergence (a long checkpoint write, a slow loader), none is reopened for it: beat at the normal
        # pace again (after a verdict, fast: the ranks leave in order, rank 0 first, see `_break_if_blocked`)
        heartbeat.fast_beat = (
            bool(what)
            and waited >= self.stuck_after / 2
            and (what not in self._inquired or control.desync_error is not None)
        )
        if control.desync_error is not None:
            self._break_if_blocked(store)
            return
        heartbeat.set_ledger(*self.ledger.state)
        look = time.monotonic() >= self._next_look  # a fast beat watches for inquiries only
        if look:
            self._next_look = time.monotonic() + heartbeat.interval
        mine = self._publish_audit(store) if look and self.recorder.due() else None
        look_now = functools.partial(self._look, stuck=what if stuck else "", look=look, mine=mine)
        if heartbeat.inline:
            heartbeat.at_next_wake(look_now)
        else:
            look_now(store)

    def _look(self, store: Store, *, stuck: str, look: bool, mine: dict[str, list[Any]] | None) -> None:
        """The beat's reads, on the heartbeat thread: answer or open an inquiry, compare with the next rank.

        Args:
            store: the heartbeat thread's connection.
            stuck: what this rank was stuck in at the beat (``""``: not stuck).
            look: whether the beat was one of the interval's (not a fast one): compare the ledger and the audit.
            mine: this rank's audit publication, when the beat published one (compared with the next rank's).

        """
        control = self.control
        if bool(stuck) != self._counted_stuck:  # every rank counts itself in while stuck: "all stuck" is one counter
            store.add(_STUCK_KEY, 1 if stuck else -1)
            self._counted_stuck = bool(stuck)
        # the next rank's position: absent before it first published (a `check` until then), deleted only once
        # every rank's heartbeat has stopped (ControlPlane.close)
        peer = look and self._peer_position.is_set(store)
        audit = mine is not None and self.recorder.peer_published(store)  # the next rank's audited calls with them
        keys = [_INQUIRY_KEY, _STUCK_KEY] + [self._peer_position.key] * peer + [self.recorder.peer_key] * audit
        values = control.heartbeat.read_with_failures(store, keys)  # one round trip, the failure counter with them
        inquiry, stuck_ranks = int(values[0]), int(values[1])
        if inquiry > self._answered:
            self._answer(store, inquiry)
            return
        if stuck and stuck not in self._inquired and stuck_ranks >= control.world_size:
            self._inquired.add(stuck)  # every rank waits: whether they wait for each other, the reports tell
            self._answer(store, _open(store, inquiry))
            return
        if not look:
            return
        if not self._ledger_inquired and peer and self._ledger_differs(json.loads(values[2])):
            self._ledger_inquired = True  # once: the verdict names it, or the calls are too old to be named
            self._answer(store, _open(store, inquiry))
            return
        if mine is None or not audit:
            return
        # the audit's decoding and comparison in a hold of the GIL apart from the read's and the ledger's: after the
        # heartbeat thread slept an interval, its caches are cold and all of it at once once took over 1 ms
        let_go_of_the_gil()
        difference = self.recorder.compare_with_peer(mine, values[-1])
        if difference is not None and difference not in self._audit_inquired:
            self._audit_inquired.add(difference)  # once per call: the verdict names it
            self._answer(store, _open(store, inquiry))

    # ------------------------------------------------------------------ auditing
    def _dump_in_step(self) -> None:
        """On the training thread, at a step's start after a beat there: the audit's dump that beat found due.

        Torch's dump only: its unpickling and its parsing come at the next two steps (:meth:`_continue_in_step`), one
        piece a step.
        """
        self.recorder.dump_if_due(background=False)
        self._continue_at_next_step()

    def _publish_audit(self, store: Store) -> dict[str, list[Any]] | None:
        """At a beat that looks, with an audit due: the audit's publication of new calls (``None``: none new).

        On the training thread the dump found due runs at the next step, apart from this beat (:meth:`_dump_in_step`);
        this publishes what earlier dumps added. On the heartbeat thread the dump comes first, here.
        """
        inline = self.control.heartbeat.inline
        if inline and self.recorder.dump_due():
            self.control.heartbeat.at_next_step(self._dump_in_step)
        return self.recorder.publish(store, background=not inline)

    def _continue_at_next_step(self) -> None:
        if self.recorder.fetched:
            self.control.heartbeat.at_next_step(self._continue_in_step)

    def _continue_in_step(self) -> None:
        """At a training step's start: the next piece of its audit dump (``RecorderAudit.continue_fetched``)."""
        self.recorder.continue_fetched()
        self._continue_at_next_step()

    def update_audit(self) -> dict[str, list[Any]]:
        """Add the recorder's new calls to the audit (one dump with stacks) and return its publication."""
        return self.recorder.update()

    def audit_now(self) -> None:
        """As a training epoch starts: dump the recorder now; unpickle and parse at the next steps (``dump_now``)."""
        self.recorder.dump_now()
        self._continue_at_next_step()

    def _ledger_differs(self, peer: dict[str, Any]) -> bool:
        """Whether the next rank's strategy collectives differ from this rank's at the count it reached.

        Args:
            peer: the next rank's published :class:`~ddp_strategy.positions.Position` as JSON data (its ``calls``
                and ``digest`` are read).

        """
        calls, digest = int(peer.get("calls") or 0), int(peer.get("digest") or 0)
        if calls == 0 or calls > self.ledger.count:  # on the heartbeat thread: nothing settled but up to `calls`
            return False
        mine = self.ledger.digest_at(calls)
        return mine is not None and mine != digest

    # ------------------------------------------------------------------ inquiring
    def report(self) -> RankReport:
        """This rank's report: its newest calls (with stacks: costly), its wait, its progress."""
        newest = self.recorder.report_calls(self.notes, REPORT_CALLS)
        what, since = self._current_wait()
        epoch, epoch_batch = self.control.heartbeat.progress
        if self.progress is not None:
            now = self.progress()
            epoch, epoch_batch = now if now is not None else (None, None)
        step = self.control.heartbeat.step
        barrier_site = self.control.heartbeat.position.site if what.startswith("barrier ") else ""
        return RankReport(
            rank=self.control.rank,
            calls=tuple(newest),
            waiting=what,
            waiting_since=since,
            epoch=epoch,
            epoch_batch=epoch_batch,
            barrier_site=barrier_site,
            step=step,
            ledger=tuple(self.ledger.texts),
        )

    def _answer(self, store: Store, inquiry: int) -> CollectiveMismatchError | None:
        """Report for the newest inquiry and return its verdict, the same on every rank.

        Each rank publishes its report and counts itself in; the rank that completes the count reads every report
        (batched reads) and writes the verdict once, which every rank reads (one key, polled at a pace that keeps
        the store's total load flat as ranks are added). Two ranks may open inquiries at once; every rank follows the
        newest one (it reports again). When a rank publishes a failure, or reports do not come within
        ``_REPORT_WAIT`` seconds, the first rank to see it decides "incomplete" for every rank.
        """
        with self._lock:
            if inquiry <= self._answered:
                return self.control.desync_error
            world, rank = self.control.world_size, self.control.rank
            report = self.report()
            mine = report.to_json()
            deadline = time.monotonic() + _REPORT_WAIT
            own_failure = int(self.control.heartbeat.position.kind == "failed")
            while True:
                inquiry = max(inquiry, int(store.add(_INQUIRY_KEY, 0)))
                if inquiry > self._answered:
                    store.set(_REPORT_KEY.format(inquiry=inquiry, rank=rank), mine)
                    self._answered = inquiry
                    if int(store.add(_REPORTED_KEY.format(inquiry=inquiry), 1)) == world:
                        _decide(store, inquiry, world)  # the last to report decides for every rank
                key = _VERDICT_KEY.format(inquiry=inquiry)
                if store.check([key]):
                    break
                if time.monotonic() > deadline or self.control.heartbeat.failures_published(store) > own_failure:
                    store.compare_set(key, "", INCOMPLETE)  # a rank that failed or went silent never reports
                    break
                self.control.heartbeat.publish_if_due(store)  # this rank's heartbeat stays fresh while it waits
                time.sleep(poll_pause(world))
            text = store.get(key).decode()
            error = verdict_from_json(text)
            if text == NO_VERDICT and report.waiting:
                self._inquired.add(report.waiting)  # every rank reported: while this wait lasts, none is to be found
            read = _READ_KEY.format(inquiry=inquiry)
            if int(store.add(read, 1)) == world:  # the last rank to read the verdict deletes it
                store.delete_key(key)
                store.delete_key(read)
            if error is None:
                log.info(
                    "ddp_strategy: rank %d: desync inquiry %d found no divergence or was incomplete", rank, inquiry
                )
                return None
            if self.control.desync_error is None:
                self.control.desync_error = error
                self._verdict_at = time.monotonic()
                store.append(HOLDING_KEY, f"{rank}\n")  # rank 0 hosts the store: it waits for every rank's
                if self._current_wait()[0].startswith("collective "):
                    # blocked inside the backend: it may be killed (a launcher stopping the job when another rank
                    # exits) before it can raise, so it shows the error now
                    self._show(error)
            return error

    def _show(self, error: CollectiveMismatchError) -> None:
        if not self._shown:
            self._shown = True
            rank = self.control.rank
            text = "\n".join(f"[rank{rank}]: {line}" for line in str(error).splitlines())
            sys.stderr.write(
                f"[rank{rank}]: ddp_strategy.errors.{type(error).__name__}: {text[len(f'[rank{rank}]: ') :]}\n"
            )
            sys.stderr.flush()

    def inquire(self) -> CollectiveMismatchError | None:
        """Open an inquiry from the training thread (after a backend error) and return the verdict, if any."""
        if self.control.desync_error is not None:
            return self.control.desync_error
        store = self.control.store  # the training thread's own connection: a new one would retry a gone host
        try:
            seen = int(store.add(_INQUIRY_KEY, 0))
            return self._answer(store, seen if seen > self._answered else _open(store, seen))
        except Exception as err:  # the store is gone (rank 0 exited): nothing to agree on
            log.debug("ddp_strategy: rank %d could not open a desync inquiry: %s", self.control.rank, err)
            return self.control.desync_error

    # ------------------------------------------------------------------ acting
    def _break_if_blocked(self, store: Store) -> None:
        """After the verdict: a rank still blocked in a backend collective prints the error and exits.

        Rank 0 goes first, one second after the verdict: its exit closes its connections, so the others'
        collectives return with an error, and they raise the agreed error instead (through the strategy's
        launcher). Rank 0 first, because under Lightning's subprocess launcher it is the parent of the node's other
        ranks, and kills itself at once when one of them exits with an error. Another rank still blocked exits
        ``_AFTER_RANK0`` s after it saw rank 0 stop (its collective did not return), at the latest ``_BREAK_LATEST`` s
        after the verdict: the same few seconds at any world size.

        Blocked means: a collective is pending and the training thread is in torch's code, in the same frame at the
        same instruction as at the last beat. A collective that returned with the backend's error stays pending in
        the recorder; the thread that raises it, or tears down through torch's code (moving the module), is
        somewhere else from one beat to the next, and reaches the launcher.
        """
        error = self.control.desync_error
        if error is None or self._verdict_at is None:
            return
        what, _ = self._current_wait()
        mark = _frame_mark(_training_thread_frame()) if what.startswith("collective ") else None
        blocked, self._blocked_at = mark is not None and mark == self._blocked_at, mark
        if not blocked:
            return
        if not self._may_exit(store, self._verdict_at):
            return
        self._show(error)
        sys.stderr.write(
            f"[rank{self.control.rank}]: this rank's training thread is blocked inside a collective, which no "
            f"Python error can interrupt; the process exits with code {_EXIT_CODE} so that the other ranks' "
            "collectives return.\n"
        )
        sys.stderr.flush()
        sys.stdout.flush()
        if self.control.rank == 0:
            self.rank0_stopping(store)
        os._exit(_EXIT_CODE)

    def _may_exit(self, store: Store, verdict_at: float) -> bool:
        """Whether this rank, blocked since the verdict, exits now (see :meth:`_break_if_blocked`): one store look."""
        now = time.monotonic()
        if self.control.rank == 0:
            return now - verdict_at >= _BREAK_AFTER
        if self._rank0_stopped_at is None and rank0_gone(store):
            self._rank0_stopped_at = now
        if self._rank0_stopped_at is not None and now - self._rank0_stopped_at >= _AFTER_RANK0:
            return True
        return now - verdict_at >= _BREAK_LATEST

    def rank0_stopping(self, store: Store | None = None, *, await_verdicts: bool = True) -> None:
        """On rank 0, before it exits with the agreed error: let the others take the verdict, then say it stops.

        See :func:`~ddp_strategy.desync_exit.rank0_stopping`.
        """
        rank0_stopping(self.control, store, await_verdicts=await_verdicts)

    def await_rank0(self, timeout: float = 3.0) -> None:
        """On another rank, before it exits with the agreed error: wait (at most ``timeout``) until rank 0 showed it."""
        await_rank0(self.control, timeout)
