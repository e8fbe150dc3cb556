"""A rank's heartbeat: what it publishes of itself in the rendezvous store, and the threads that keep it fresh.

:class:`Heartbeat` holds where this rank is (its :class:`~ddp_strategy.positions.Position`, step, epoch progress,
what its training thread waits in, the count and digest of the strategy's collectives) and publishes it as one key,
``pos/<rank>``. One daemon thread, ``ddp_strategy-heartbeat-rank<r>``, runs while the control plane lives. Every
heartbeat interval it re-publishes the position and looks whether another rank published a failure, so a rank
blocked in a data-plane collective still learns it; at every beat (each interval, or every :data:`FAST_BEAT`
seconds while a hook asks for it) it runs the beat hooks, e.g. the desync monitor's. One thread and one store
connection, not one for each task: each wake-up of a thread is paid in CPU (0.1-0.4 ms on a VM), and every
connection is a socket on rank 0's store. For the same reason a hook reads its keys with
:meth:`Heartbeat.read_with_failures`, which reads the failure counter in the same round trip: an interval's store
work is one ``set`` and one ``multi_get``. A hook that waits long (a desync inquiry) keeps the heartbeat fresh with
:meth:`Heartbeat.publish_if_due`.

While the training thread trains, it beats itself: :meth:`Heartbeat.note_step`, at the start of every training step,
runs a beat that is due right there (:meth:`Heartbeat.beat_if_due`), and the heartbeat thread, waking
:data:`TAKEOVER` of an interval later, finds it done and does the beat's reads. A Python background thread holds the
GIL while it runs, and on a busy machine the scheduler may take its core in mid-beat: the training thread would then
wait for the GIL for a whole time slice. A beat on the training thread costs that thread the same work and no such
wait. It waits for nothing either: its store calls are ``set`` calls (sent, no answer awaited); what must read the store
(a hook's reads, the failure check) runs at that wake-up of the heartbeat thread (:meth:`Heartbeat.at_next_wake`),
whose wait for rank 0's store (milliseconds when the store's host has no idle core) lets the GIL go. When the training
thread stops beating (it waits in a collective, a barrier, a long step, or evaluates), the heartbeat thread beats as
before. A beat hook whose work is costly but never waits runs it at the next training step, apart from the beat
(:meth:`Heartbeat.at_next_step`); one that needs the heartbeat thread at once asks with :meth:`Heartbeat.hand_over`.

A failing rank publishes its failure through it (:meth:`Heartbeat.note_failure`); rank 0, which hosts the store,
waits for its peers to read it (:meth:`Heartbeat.await_failure_seen`). Intervals grow beyond
:data:`RANKS_PER_INTERVAL` ranks (:func:`scaled_interval`), so that the store's load stays flat.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import MISSING, fields

from .exit_safety import end_at_exit
from .positions import Position
from .store import Store, get_if_set
from .store_barrier import POSITION_KEY, Outcome, abort, read_positions_of

__all__ = [
    "FAILURE_KEYS",
    "FAST_BEAT",
    "RANKS_PER_INTERVAL",
    "TAKEOVER",
    "Heartbeat",
    "failures_published",
    "read_position",
    "scaled_interval",
]

# the control plane's records keep the logger they had before the heartbeat became a module of its own
log = logging.getLogger("ddp_strategy.control")

#: Up to this many ranks, heartbeats come every ``heartbeat_interval``; beyond, the interval grows in proportion.
RANKS_PER_INTERVAL = 512
#: The beat interval while a desync inquiry may come (:attr:`Heartbeat.fast_beat`), scaled like the heartbeat.
FAST_BEAT = 0.2
#: While the training thread beats (:meth:`Heartbeat.beat_if_due`), the heartbeat thread takes a due beat over this
#: share of an interval late: a training step that starts within it beats first. A rank that stops training still
#: publishes within 1.25 intervals (staleness limits are 3).
TAKEOVER = 0.25
_FAILED_KEY = "failure/rank"  # the rank of the first published failure; peers' heartbeat threads look for it
_FAILURES_KEY = "failure/count"  # how many ranks published a failure
_SEEN_KEY = "failure/seen"  # how many peers have read the first failure (the failed store host waits for them)
#: The keys every rank's failure publication shares (deleted by rank 0 at a graceful close).
FAILURE_KEYS = (_FAILED_KEY, _FAILURES_KEY, _SEEN_KEY)
#: The fields of a :class:`Position` that have a default, with it: a training step's published JSON starts there.
_POSITION_FIELDS = {field.name: field.default for field in fields(Position) if field.default is not MISSING}


def scaled_interval(interval: float, world_size: int) -> float:
    """``interval`` for a background poll of every rank, grown beyond :data:`RANKS_PER_INTERVAL` ranks in proportion.

    Every rank polling once per interval costs the store ``world_size / interval`` operations a second; growing the
    interval with the world size keeps that flat (512 ranks: as given; 4096 ranks: 8 times as long).
    """
    return interval * max(1.0, world_size / RANKS_PER_INTERVAL)


def read_position(store: Store, rank: int) -> Position | None:
    """The last position ``rank`` published through ``store``, or ``None`` when it never published one."""
    value = get_if_set(store, POSITION_KEY.format(rank=rank))
    return None if value is None else Position.from_json(value)


def failures_published(store: Store) -> int:
    """How many ranks have published a failure (:meth:`Heartbeat.note_failure`) in this run; one counter read."""
    return int(store.add(_FAILURES_KEY, 0))


class _Wakeup:
    """What the heartbeat thread sleeps on between beats: :meth:`wait` ends early once :meth:`set` was called.

    ``threading.Event.wait`` runs a ``Condition`` in Python, with a new lock per wait, at every wake-up (once an
    interval, with the caches the training step left cold); here a wait is one ``acquire`` with a timeout of a lock
    that :meth:`set` releases. A set is taken by the wait it ends, or by the next wait when none is running; sets
    before that wait count once.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()  # held while no wake-up is pending

    def wait(self, timeout: float) -> bool:
        """Sleep at most ``timeout`` seconds; ``True`` when a :meth:`set` ended the sleep or came before it."""
        return self._lock.acquire(timeout=timeout)

    def set(self) -> None:
        """End the running or the next :meth:`wait` now."""
        with contextlib.suppress(RuntimeError):  # released already: a wake-up is pending
            self._lock.release()


class Heartbeat:
    """Where one rank is, as it publishes it, and the threads that re-publish it and run the beat hooks.

    The training thread sets :attr:`position` (and the other fields published with it); the threads start with
    :meth:`start` and end with :meth:`stop`.

    Args:
        rank: this process's global rank.
        world_size: the number of ranks.
        interval: the configured heartbeat interval in seconds (``0``: no threads), scaled beyond
            :data:`RANKS_PER_INTERVAL` ranks.
        store: the heartbeat thread's own connection to the run's namespace of the store.
        desync_agreed: whether the ranks agreed on a desync (going down: rank 0's store may be gone any moment).

    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        interval: float,
        store: Store,
        desync_agreed: Callable[[], bool],
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        #: seconds between two publications of this rank's position (``0``: no heartbeat thread): the configured
        #: interval, scaled up beyond :data:`RANKS_PER_INTERVAL` ranks; every staleness limit (a rank whose heartbeat
        #: is older than a few intervals counts as dead) is a multiple of it
        self.interval = scaled_interval(interval, world_size)
        #: beat every :data:`FAST_BEAT` seconds (scaled beyond RANKS_PER_INTERVAL ranks) instead of every heartbeat
        #: interval: set while a desync inquiry may come
        self.fast_beat = False
        self._fast_interval = scaled_interval(FAST_BEAT, world_size)
        # this rank's current position (see `position`), or a training step's note `(step, batch, since, seq)`
        self._current: Position | tuple[int, int | None, float, int] = Position(
            kind="started", name="started", since=time.time()
        )
        self._built: tuple[object, Position] | None = None  # (note, the position built from it)
        #: the optimizer step (``trainer.global_step``) of the last training batch this rank started
        self.step: int | None = None
        #: ``(epoch, batches started in it)`` of the last training batch this rank started (``None`` before)
        self.progress: tuple[int | None, int | None] = (None, None)
        #: ``(rank, position)`` of another rank's failure, once the publisher thread has read it. Kept so that this
        #: rank can still name it after the store is gone: when the failed rank is rank 0, which hosts the store,
        #: this rank's own error (a backend ``Connection closed by peer``) comes once rank 0 has exited.
        self.peer_failure: tuple[int, Position] | None = None
        self._waiting: tuple[str, float] = ("", 0.0)  # what the training thread waits in (see `set_waiting`)
        self._ledger: tuple[int, int] = (0, 0)  # (calls, digest) of the strategy's collectives (see `set_ledger`)
        self._store = store
        self._next_publish = math.inf  # time.monotonic() of the next publication (none without a heartbeat thread)
        self._desync_agreed = desync_agreed
        #: the sequence number of the control plane's next barrier (the control plane's one counter of its barriers,
        #: advanced by ``ControlPlane.barrier``), recorded in a training step's position: read by every step (no call)
        self.next_barrier = 0
        self._hooks: list[Callable[[Store], None]] = []
        self._failures_read = False  # whether a hook read the failure counter during this beat (read_with_failures)
        self._failures_seen = 0  # the failure count when this rank last read the first failure
        self._stop = threading.Event()
        self._wake = _Wakeup()  # wakes the heartbeat thread before its time: stop() or hand_over()
        self._thread: threading.Thread | None = None
        # one beat at a time, on either thread; the training thread never waits for it (see `beat_if_due`)
        self._beat_lock = threading.Lock()
        #: ``True`` during a beat on the training thread (:meth:`beat_if_due`): a hook then leaves work that reads the
        #: store to the heartbeat thread's next wake-up (:meth:`at_next_wake`)
        self.inline = False
        self._stepped_at = -1e9  # time.monotonic() of the training thread's last training-step note
        self._inline_off = False  # the training thread beats no more (the store failed it; the thread reports it)
        self._handed_over = False  # a hook asked the heartbeat thread to beat now (see `hand_over`)
        self._step_task: Callable[[], None] | None = None  # for the training thread's next step (see `at_next_step`)
        self._wake_task: Callable[[Store], None] | None = None  # for the heartbeat thread's next wake-up (at_next_wake)
        self._check_owed = False  # a beat on the training thread published without the failure check

    @property
    def position(self) -> Position:
        """This rank's current position; set by the control plane (barriers, collectives) and :meth:`note_step`.

        A training step's position is built when first read, not by :meth:`note_step`, which runs at every step:
        reading twice without a new step gives the same object (two threads reading the same note at once may each
        build one). The publisher writes a step's note out without building it, and the desync monitor compares
        :attr:`mark`: in a run without failures, nothing reads it.
        """
        current = self._current
        if not isinstance(current, tuple):
            return current
        built = self._built
        if built is not None and built[0] is current:
            return built[1]
        step, batch, since, seq = current
        position = Position(kind="training step", name=str(step), seq=seq, since=since, batch=batch)
        self._built = (current, position)
        return position

    @position.setter
    def position(self, position: Position) -> None:
        self._current = position

    @property
    def mark(self) -> object:
        """A new object whenever :attr:`position` changes (compare by identity); reading it builds nothing."""
        return self._current

    # ------------------------------------------------------------------ publishing
    def _published_json(self, when: float) -> str:
        """The current position with this rank's heartbeat ``when``, progress, wait and ledger, as the store holds it.

        A training step's note is written out as its :class:`Position` would be, without building one: this runs
        once a second, in a beat, where every object made is paid in cold caches.
        """
        current = self._current
        if isinstance(current, tuple):
            step, batch, since, seq = current
            data = dict(_POSITION_FIELDS, kind="training step", name=str(step), seq=seq, since=since, batch=batch)
        else:
            data = dict(current.__dict__)  # a dataclass of plain values: its fields, without asdict's deep copy
        data["epoch"], data["epoch_batch"] = self.progress
        data["waiting"], data["waiting_since"] = self._waiting
        data["calls"], data["digest"] = self._ledger
        data["heartbeat"] = when
        return json.dumps(data)

    def publish(self, store: Store) -> None:
        """Publish this rank's position with a fresh heartbeat through ``store`` (the calling thread's own)."""
        store.set(POSITION_KEY.format(rank=self.rank), self._published_json(time.time()))

    def publish_if_due(self, store: Store) -> None:
        """Publish (through ``store``, the calling thread's own) when a heartbeat is due: for a hook that waits long.

        The heartbeat thread runs the beat hooks between its publications; a hook that polls for seconds (a desync
        inquiry waiting for every rank's report) calls this in its loop, so that this rank's heartbeat stays fresh
        and no peer takes it for dead. Does nothing without heartbeats, or while the store may be gone.
        """
        if self._thread is None or time.monotonic() < self._next_publish or self._going_down():
            return
        self._next_publish = time.monotonic() + self.interval
        self.publish(store)

    def note_step(
        self, step: int, *, batch: int | None = None, epoch: int | None = None, epoch_batch: int | None = None
    ) -> None:
        """Record that this rank is in training step ``step``; cheap enough for every step (no I/O but the beat).

        Once an interval, when a beat is due, the training thread runs it here (:meth:`beat_if_due`).

        Args:
            step: the optimizer step (``trainer.global_step``), shown in messages.
            batch: how many training batches this rank has started in this run, this one included; lets another
                rank tell that this one went past a point of that batch (see ``passed`` in ``ControlPlane.barrier``).
            epoch: the training epoch of this batch.
            epoch_batch: how many batches of that epoch this rank has started, this one included.

        """
        self._current = (step, batch, time.time(), self.next_barrier)  # see `position`: built when read
        self.step = step
        if epoch is not None:
            self.progress = (epoch, epoch_batch)
        self._stepped_at = now = time.monotonic()
        if now >= self._next_publish:  # once an interval: the beat, here on the training thread
            self.beat_if_due()
        elif self._step_task is not None:  # work a beat left for a step of its own (see `at_next_step`)
            task, self._step_task = self._step_task, None
            try:
                task()
            except Exception as err:  # a diagnosis must never stop training
                log.warning("ddp_strategy: rank %d: a heartbeat task failed: %r", self.rank, err)

    def beat_if_due(self) -> None:
        """On the training thread: the beat that is due, unless the heartbeat thread is in one (no waiting).

        The same beat as the heartbeat thread's (publication, hooks) with :attr:`inline` set, so that a hook leaves
        work that reads the store to that thread (:meth:`at_next_wake`); the failure check waits for it too. Never
        raises: a store that fails here ends the training thread's beats, and the heartbeat thread meets the failure
        itself and reports it.
        """
        if self._thread is None or self._inline_off or not self._beat_lock.acquire(blocking=False):
            return
        try:
            if time.monotonic() < self._next_publish or self._going_down():  # beaten just before, or going down
                return
            self.inline = True
            self._inline_off = not self._beat_once(self._store)
        finally:
            self.inline = False
            self._beat_lock.release()
        if self._inline_off:
            self.hand_over()

    def at_next_step(self, task: Callable[[], None]) -> None:
        """Run ``task`` on the training thread at the start of its next training step that runs no beat, once.

        For a beat hook on the training thread (:attr:`inline`) whose work would make one step's pause too long next
        to the beat's: the desync audit's recorder dump (about 0.8 ms with cold caches) comes one step after the
        beat that found it due. Replaces a task not run yet; one the training thread does not reach (it stopped
        training) waits for its next training step. An exception from ``task`` is logged, not raised.
        """
        self._step_task = task

    def at_next_wake(self, task: Callable[[Store], None]) -> None:
        """Run ``task(store)`` on the heartbeat thread at its next wake-up (not sooner), once, through its ``store``.

        For a beat hook on the training thread (:attr:`inline`) whose work reads the store: the answer of rank 0's
        store comes within milliseconds when its host has no idle core, and the training thread must not wait for it.
        The heartbeat thread wakes :data:`TAKEOVER` of an interval after the beat was due (to take it over when no
        training step came), finds it done, and runs ``task`` then, the GIL let go while it waits for the store.
        Replaces a task not run yet; :meth:`stop` drops it. An exception from ``task`` is logged, not raised.
        """
        self._wake_task = task

    def hand_over(self) -> None:
        """Ask the heartbeat thread for a beat now.

        A hook in a beat on the training thread (:attr:`inline`) calls this instead of doing work that may wait; the
        heartbeat thread's beat, at once, finds it still to do.
        """
        self._handed_over = True
        self._wake.set()

    def set_waiting(self, what: str, since: float) -> None:
        """Record what the training thread waits in (``""``: nothing), published with every heartbeat."""
        self._waiting = (what, since)

    def set_ledger(self, calls: int, digest: int) -> None:
        """Record the count and digest of the strategy's collectives, published with every heartbeat."""
        self._ledger = (calls, digest)

    # ------------------------------------------------------------------ reading
    def read_positions(self, store: Store, ranks: Sequence[int] | None = None) -> dict[int, Position | None]:
        """The last published positions of ``ranks`` (every rank by default; ``None``: never published), batched."""
        return read_positions_of(store, list(range(self.world_size) if ranks is None else ranks))

    @staticmethod
    def read_position(store: Store, rank: int) -> Position | None:
        """The last position ``rank`` published, or ``None`` when it never published one."""
        return read_position(store, rank)

    @staticmethod
    def failures_published(store: Store) -> int:
        """How many ranks have published a failure (:meth:`note_failure`) in this run; one counter read."""
        return failures_published(store)

    def _rank0_failed(self) -> bool:
        return self.peer_failure is not None and self.peer_failure[0] == 0

    def read_with_failures(self, store: Store, keys: Sequence[str]) -> list[bytes]:
        """``store.multi_get(keys)`` with the failure counter in the same round trip: for a beat hook.

        It waits for the store's answer: a hook on the training thread (:attr:`inline`) reads through
        :meth:`at_next_wake` instead. Every key must exist (a ``multi_get`` waits for a missing one). When the counter
        shows a failure this rank has not read yet, the first failure is read (:attr:`peer_failure`) before this
        returns. A beat in which a hook called this needs no failure check of its own: an interval's store work is
        one ``set`` and this.

        Args:
            store: the calling thread's own connection (a hook's argument).
            keys: the keys the hook reads.

        Returns:
            The values of ``keys``, in order.

        """
        values = store.multi_get([_FAILURES_KEY, *keys])
        self._failures_read = True
        self._note_failures(store, int(values[0]))
        return list(values[1:])

    def _note_failures(self, store: Store, failures: int) -> None:
        """Read the first failure when ``failures`` (the counter) grew since the last read and none was kept yet.

        A rank publishes its failure's rank before it counts it (:meth:`note_failure`), so the first failure's rank
        is there whenever the count is above 0: the count needs reading once per new failure, not once per beat.
        """
        if self.peer_failure is None and failures > self._failures_seen:
            self._failures_seen = failures
            self._read_peer_failure(store)

    def note_failure(self, exception: BaseException, seq: int, store: Store) -> None:
        """Publish that this rank failed (before its barrier ``seq``), so ranks waiting for it stop at once.

        Best effort: when the store is unreachable the failure is only logged. Nothing is published after rank 0,
        which hosts the store, was seen failing: its store is gone or about to go, and touching it makes torch
        print a C++ stack trace.
        """
        text = f"{type(exception).__name__}: {exception}".splitlines()[0][:300]
        self.position = Position(kind="failed", name=text, seq=seq, since=time.time())
        if self._rank0_failed():
            return
        try:
            self.publish(store)
            # the rank first, then the count: a peer that reads a count above 0 finds the first failure's rank set
            store.compare_set(_FAILED_KEY, "", str(self.rank))  # the first failure is the one to name
            store.add(_FAILURES_KEY, 1)
            # ranks waiting in (or coming to) the next barrier of this rank, which it never enters, stop at once
            abort(store, seq, Outcome("failed", (self.rank,), {self.rank: self.position}, by=self.rank))
        except Exception as err:
            log.warning("ddp_strategy: rank %d could not publish its failure (%s)", self.rank, err)

    def await_failure_seen(self, store: Store, gone: Iterable[int]) -> None:
        """After :meth:`note_failure` on rank 0: wait until every peer has read the failure, at most a few seconds.

        Rank 0 hosts the rendezvous store (under Lightning's launchers and SLURM), so once it exits its peers can
        no longer read why. A peer that is blocked inside a collective (DDP's all-reduce) still reads the failure
        on its publisher thread, within one heartbeat interval; this waits for that, at most
        ``max(1 s, 3 heartbeat intervals)``, so that every rank can name rank 0's error rather than a closed
        socket. The ranks ``gone`` (found gone by the failure's diagnosis) are not waited for. Without heartbeats,
        or with one rank, it returns at once.
        """
        if self.world_size < 2 or self.interval <= 0:
            return
        expected = self.world_size - 1 - len(set(gone) - {self.rank})
        deadline = time.monotonic() + max(1.0, 3 * self.interval)
        try:
            while time.monotonic() < deadline:
                seen, failed = int(store.add(_SEEN_KEY, 0)), int(store.add(_FAILURES_KEY, 0))
                if seen + failed - 1 >= expected:  # a failed peer reads nothing; this rank's own failure counts once
                    return
                time.sleep(min(0.05, self.interval / 4))
        except Exception as err:  # best effort: the error being raised is what matters
            log.debug("ddp_strategy: waiting for peers to read rank %d's failure: %s", self.rank, err)

    # ------------------------------------------------------------------ the thread
    def start(self) -> None:
        """Start the heartbeat thread (with several ranks and a positive interval)."""
        if self.world_size > 1 and self.interval > 0:
            self._store.add(_FAILURES_KEY, 0)  # it exists from now on: the beats read it in their one multi_get
            self._next_publish = time.monotonic() + self.interval
            self._thread = threading.Thread(
                target=self._loop, name=f"ddp_strategy-heartbeat-rank{self.rank}", daemon=True
            )
            self._thread.start()
            end_at_exit(self._stop_at_exit)

    def add_beat(self, hook: Callable[[Store], None]) -> None:
        """Run ``hook(store)`` at every beat (each heartbeat interval, :data:`FAST_BEAT` s with :attr:`fast_beat`).

        The hooks run on the heartbeat thread, after its publication when one is due; ``store`` is that thread's
        connection. A hook reads its keys with :meth:`read_with_failures` (the heartbeat's failure check comes with
        them); one that may wait longer than an interval calls :meth:`publish_if_due` while it waits. When the
        hooks changed what this rank waits in (:meth:`set_waiting`), the position is published right after them. An
        exception from ``hook`` is logged, not raised.
        """
        self._hooks.append(hook)

    def stop(self, timeout: float | None = None) -> None:
        """Stop the heartbeat thread and wait for it (at most ``timeout``, default ``max(5 s, 2 intervals)``)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, 2 * self.interval) if timeout is None else timeout)
        self._thread = None
        self._next_publish = math.inf  # the training thread's steps look for no beat any more
        self._step_task = self._wake_task = None

    def _stop_at_exit(self) -> None:
        # a rank that exits without teardown (an error under the spawn launcher): no store call in flight while
        # the interpreter finalizes (see exit_safety)
        self.stop(timeout=1.0)

    def _beat(self, store: Store) -> None:
        for hook in list(self._hooks):
            try:
                hook(store)
            except Exception as err:  # a diagnosis must never stop the beats
                log.warning("ddp_strategy: rank %d: a heartbeat task failed: %r", self.rank, err)

    def _going_down(self) -> bool:
        """Whether the store may be gone any moment: the ranks agreed on a desync, or rank 0 failed."""
        return self._desync_agreed() or self._rank0_failed()

    def _pause(self) -> float:
        """Seconds until the heartbeat thread's next beat.

        The next publication (:data:`TAKEOVER` of an interval later while the training thread steps), or sooner at the
        fast beat's pace; ``0`` when a hook handed work over.
        """
        if self._handed_over:
            return 0.0
        now = time.monotonic()
        riding = now - self._stepped_at < 2 * self.interval  # the training thread trains: it beats first
        until = max(0.0, self._next_publish + (TAKEOVER * self.interval if riding else 0.0) - now)
        return min(until, self._fast_interval) if self.fast_beat and self._hooks else until

    def _loop(self) -> None:
        store = self._store
        while True:
            self._wake.wait(self._pause())
            if self._stop.is_set():
                return
            with self._beat_lock:
                if not self._after_inline_beat(store):
                    return
                if self._pause() > 0 and not self.fast_beat:  # the training thread beat meanwhile
                    continue
                self._handed_over = False
                if not self._beat_once(store):
                    return

    def _beat_once(self, store: Store) -> bool:
        """One beat through ``store``: publish when due, run the hooks, read the failure counter when no hook did.

        Returns:
            ``False`` when the heartbeat should end: rank 0 failed (its store is about to go, and a call to a gone
            store prints a C++ trace) or the store is gone.

        """
        if self._rank0_failed():
            return False
        pulse = time.monotonic() >= self._next_publish and not self._desync_agreed()
        if pulse:
            self._next_publish = time.monotonic() + self.interval
            if not self._store_call(self.publish, store):
                return False
        self._failures_read = False
        waiting = self._waiting
        if self._hooks:
            self._beat(store)
        if pulse and not self._failures_read:  # no hook read the failure counter in this beat: a read of its own
            if self.inline:
                self._check_owed = True  # at the heartbeat thread's next wake-up: no wait for the store here
            elif not self._store_call(self._check_failures, store):
                return False
        if self._rank0_failed():
            return False
        if self._waiting != waiting and not self._going_down():
            try:
                self.publish(store)  # the others see the new wait now, not at the next heartbeat
            except Exception as err:  # the next publication reports a gone store
                log.debug("ddp_strategy: rank %d: publishing after the beat: %s", self.rank, err)
        return True

    def _after_inline_beat(self, store: Store) -> bool:
        """On the heartbeat thread: what a beat on the training thread left it (:meth:`at_next_wake`, failure check).

        Returns:
            ``False`` when the heartbeat should end (see :meth:`_beat_once`).

        """
        task, self._wake_task = self._wake_task, None
        owed, self._check_owed = self._check_owed, False
        if task is None and not owed:
            return True
        if self._going_down():  # the store may be gone any moment (see `_beat_once`)
            return not self._rank0_failed()
        self._failures_read = False
        if task is not None:
            try:
                task(store)
            except Exception as err:  # a diagnosis must never stop the beats
                log.warning("ddp_strategy: rank %d: a heartbeat task failed: %r", self.rank, err)
        if owed and not self._failures_read and not self._store_call(self._check_failures, store):
            return False
        return not self._rank0_failed()

    def _check_failures(self, store: Store) -> None:
        self._note_failures(store, int(store.add(_FAILURES_KEY, 0)))

    def _store_call(self, call: Callable[[Store], None], store: Store) -> bool:
        """``call(store)``; ``False`` (the thread should end) when the store is gone."""
        try:
            call(store)
            return True
        except Exception as err:  # the store is gone: rank 0 exited or died
            if not self._stop.is_set() and not self.inline:  # on the training thread: the heartbeat thread says it
                log.warning(
                    "ddp_strategy: rank %d stopped publishing its heartbeat: the rendezvous store is "
                    "unreachable (%s). Rank 0, which hosts it, has probably exited.",
                    self.rank,
                    err,
                )
            return False

    def _read_peer_failure(self, store: Store) -> None:
        """Keep the first failure another rank published, and tell that rank it was seen."""
        failed = int(store.get(_FAILED_KEY))
        position = None if failed == self.rank else read_position(store, failed)
        if position is not None and position.kind == "failed":
            self.peer_failure = (failed, position)
            store.add(_SEEN_KEY, 1)
