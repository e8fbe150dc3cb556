"""Preemption: a signal that reaches any subset of ranks stops every rank at one agreed boundary.

Schedulers stop jobs with SIGTERM (SLURM's ``scancel``, Kubernetes, spot instances; SLURM can send SIGUSR1 first
with ``--signal``). The signal reaches every rank, or some of them, at different moments, while they are inside
different collectives. Any collective started from a signal handler (Lightning's own SIGTERM handler broadcasts)
meets an unrelated collective of another rank and the job deadlocks.

Here the handler only records the signal. The ranks agree on a *boundary* to stop at: an optimizer step's end in
training, a batch's end in validation (inside ``fit`` too), test and prediction. Every rank passes the same
sequence of boundaries, each named by a :data:`Position` (a tuple, compared in order; see :func:`train_position`,
:func:`validation_position`, :func:`evaluation_position`). The agreement uses the control plane's rendezvous store
and never a collective:

1. at its next boundary, a rank that received a signal publishes it (one key);
2. every rank learns of it from its :class:`NoticeWatch`, a thread blocked in one store ``wait`` for that key (no
   polling: the store wakes it within milliseconds), and *acknowledges* for the rank, from the watch thread: it
   appends the last boundary the rank passed to one key and counts itself in; the rank whose ack completes the
   count reads the acks once and writes their maximum ``M`` to one key (the signalled rank acks at the boundary
   where it publishes);
3. every rank stops at the first boundary after ``M``. A rank reaching a boundary after its own ack before ``M`` is
   known blocks there, in one store ``wait``, until it is: the acks come from the watch threads, whatever the
   training threads do, so this wait lasts milliseconds and cannot deadlock against a collective.

Why no rank has passed the first boundary after ``M`` when ``M`` is known: each rank acked at a boundary ``a <= M``
and has passed at most the next one (it blocks there), which is at most the first boundary after ``M``. This
needs no collective between the boundaries (validation, test and prediction have none); it needs every rank to
pass the same sequence of boundaries, which DDP needs too.

Each rank does O(1) store operations per agreement, whatever the world size, and none per boundary before a signal.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta

from .errors import DDPStrategyError
from .exit_safety import end_at_exit
from .store import Store

__all__ = [
    "DEFAULT_PREEMPTION_SIGNALS",
    "WATCH_RENEWAL",
    "NoticeWatch",
    "Position",
    "Preempted",
    "PreemptionAgreement",
    "evaluation_position",
    "exit_code",
    "parse_signals",
    "stop_message",
    "train_position",
    "validation_position",
]

log = logging.getLogger(__name__)

#: The signals handled by default: what schedulers send to stop a job.
DEFAULT_PREEMPTION_SIGNALS: tuple[str, ...] = ("SIGTERM",)

_SIGNAL_KEY = "preempt/signal"
_ACKS_KEY = "preempt/acks"  # every rank appends the boundary it acknowledged at
_ACK_COUNT_KEY = "preempt/ack-count"  # how many ranks acknowledged; the one that makes it W decides the stop
_STOP_KEY = "preempt/stop-after"  # the largest acknowledged boundary: every rank stops at the first one after it
_CLOSED = "closed"  # the signal key's value once a run ended without a notice: wakes every rank's watch
#: the keys of the agreement (deleted with the control plane's namespace at its close)
KEYS = (_SIGNAL_KEY, _ACKS_KEY, _ACK_COUNT_KEY, _STOP_KEY)

#: A boundary where ranks may stop, compared in order: ``(global step, phase, dataloader index, batch index)``.
Position = tuple[int, int, int, int]

_TRAIN, _SANITY, _VALIDATION, _EVALUATION = 0, 1, 2, 3


def train_position(step: int) -> Position:
    """The end of the optimizer step that made ``global_step`` ``step`` (also the start of a ``fit`` at ``step``)."""
    return (step, _TRAIN, 0, 0)


def validation_position(step: int, dataloader_idx: int, batch_idx: int, *, sanity: bool) -> Position:
    """The end of a validation batch inside ``fit`` at ``global_step`` ``step`` (in the sanity check: ``sanity``).

    It comes after :func:`train_position` ``(step)`` and before ``(step + 1)``; the sanity check before validation.
    """
    return (step, _SANITY if sanity else _VALIDATION, dataloader_idx, batch_idx)


def evaluation_position(dataloader_idx: int, batch_idx: int) -> Position:
    """The end of a batch of ``validate``, ``test`` or ``predict`` (``batch_idx`` -1: the start of the loop)."""
    return (0, _EVALUATION, dataloader_idx, batch_idx)


def _encode(position: Position) -> str:
    return ",".join(str(v) for v in position)


def _decode(text: str) -> Position:
    a, b, c, d = (int(v) for v in text.split(","))
    return (a, b, c, d)


def parse_signals(signals: Iterable[str | int] | None) -> tuple[signal.Signals, ...]:
    """The signals named by ``signals`` (names such as ``"SIGTERM"`` or ``"USR1"``, or numbers).

    Raises:
        ValueError: a name or number is not a signal that a handler can be installed for.

    """
    if signals is None:
        return ()
    if isinstance(signals, (str, int)):
        signals = [signals]
    found: list[signal.Signals] = []
    for value in signals:
        try:
            if isinstance(value, str):
                name = value.upper() if value.upper().startswith("SIG") else f"SIG{value.upper()}"
                sig = signal.Signals[name]
            else:
                sig = signal.Signals(int(value))
        except (KeyError, ValueError):
            raise ValueError(
                f"`preemption_signals` holds {value!r}, which is not a signal; use names such as 'SIGTERM' or "
                "'SIGUSR1'."
            ) from None
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(f"`preemption_signals` holds {sig.name}, which cannot be handled; use SIGTERM or SIGUSR1.")
        if sig not in found:
            found.append(sig)
    return tuple(found)


def exit_code(signum: int) -> int:
    """The exit code of a process that stopped because of ``signum``: ``128 + signum`` (143 for SIGTERM).

    It is what a shell, SLURM and Kubernetes report for a process ended by that signal, so schedulers and
    ``torchrun`` treat the stop as a preemption or failure to retry, never as a finished job.
    """
    return 128 + int(signum)


class Preempted(SystemExit):
    """Raised on every rank after a preemption stop, once the checkpoint is written; the process exits with it.

    A :class:`SystemExit` (like Lightning's ``SIGTERMException``): scripts that do not catch it exit with
    :attr:`code` (``128 + signal``, see :func:`exit_code`) without a traceback.

    Attributes:
        signal_name: the signal that caused the stop, e.g. ``"SIGTERM"``.
        step: in ``fit``, the training position of the checkpoint (its ``global_step``); else ``None``.
        path: the checkpoint written, or ``None`` (none could be, or the stage saves none: see the message).
        message: the line printed on every rank.

    """

    def __init__(
        self, message: str, *, signal_name: str, code: int, step: int | None = None, path: str | None = None
    ) -> None:
        super().__init__(code)
        self.message = message
        self.signal_name = signal_name
        self.step = step
        self.path = path

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class _Notice:
    """Who received which signal, where (the value of the signal key)."""

    rank: int
    signal_name: str
    where: str  # the boundary it was published at, for messages: "step 5", "test batch 12"
    time: float  # when the signal was received (time.time() on that rank)

    def to_json(self) -> str:
        return json.dumps({"rank": self.rank, "signal": self.signal_name, "where": self.where, "time": self.time})

    @classmethod
    def from_json(cls, raw: bytes) -> _Notice:
        data = json.loads(raw)
        return cls(int(data["rank"]), str(data["signal"]), str(data["where"]), float(data["time"]))


#: Seconds between two renewals of a :class:`NoticeWatch`'s wait: a week (each renewal makes torch log two warnings).
WATCH_RENEWAL = 7 * 24 * 3600.0


class NoticeWatch:
    """A thread blocked in one store ``wait`` for the signal key; :attr:`notice` is set when a rank publishes one.

    No polling: the store wakes the wait when the key is set, so the rank learns of a signal on another rank within
    milliseconds, whatever its training thread is doing. The wait is renewed every ``renew`` seconds (one store
    operation), by default once a week (:data:`WATCH_RENEWAL`): torch's store client logs two warnings at each wait
    that times out (``[c10d] waitForInput: ... timed out``), which every minute on every rank flooded a long run's
    logs. The thread ends when the key is set (a notice, or :meth:`close_for_all` at the end of a run, which rank 0
    calls at a stage's end and every rank after an exception), at process exit (:meth:`end_at_exit` sets it), when
    the store fails (its host is gone), or after :meth:`close` at its next renewal.

    Args:
        store: a connection of its own (a blocking ``wait`` holds it), to the run's store namespace.
        rank: this rank (the thread's name).
        renew: seconds between two renewals of the wait.
        waker: another connection to the same namespace, used at process exit only (:meth:`end_at_exit`).

    """

    def __init__(self, store: Store, *, rank: int, renew: float = WATCH_RENEWAL, waker: Store | None = None) -> None:
        #: The notice a rank published, once the watch saw it.
        self.notice: _Notice | None = None
        self._store = store
        self._waker = waker
        self._renew = timedelta(seconds=renew)
        self._closed = False
        self._on_notice: Callable[[_Notice, Store], None] | None = None
        self.thread = threading.Thread(target=self._run, name=f"ddp_strategy-preemption-watch-rank{rank}", daemon=True)

    def start(self, on_notice: Callable[[_Notice, Store], None] | None = None) -> None:
        """Start the thread; it calls ``on_notice(notice, its store connection)`` when it sees a notice."""
        self._on_notice = on_notice
        self.thread.start()
        end_at_exit(self.end_at_exit)

    def _run(self) -> None:
        while not self._closed:
            try:
                self._store.wait([_SIGNAL_KEY], self._renew)
            except Exception as err:
                if "imeout" in str(err):  # renew the wait
                    continue
                log.debug("ddp_strategy: the preemption watch ends: %s", err)
                return
            value = self._store.get(_SIGNAL_KEY)
            if value.decode() == _CLOSED:
                return
            self.notice = _Notice.from_json(value)
            if self._on_notice is not None:
                try:
                    self._on_notice(self.notice, self._store)
                except Exception as err:  # this rank's next boundary then fails after its timeout, naming the wait
                    log.warning("ddp_strategy: rank could not acknowledge the preemption notice: %r", err)
            return

    def close(self) -> None:
        """End the thread at its next renewal (or when the key is set); nothing is published."""
        self._closed = True

    def end_at_exit(self) -> None:
        """At process exit: wake the wait through ``waker`` (another connection) and join the thread (at most 2 s).

        A wait still blocked while the interpreter finalizes can abort the process (:mod:`ddp_strategy.exit_safety`).
        This ends every rank's watch, which is what a rank's exit means for the run.
        """
        self._closed = True
        if not self.thread.is_alive():
            return
        if self._waker is not None:
            try:
                self.close_for_all(self._waker)
            except Exception as err:  # the store's host is gone: the wait has its error already
                log.debug("ddp_strategy: could not wake the preemption watch at exit: %r", err)
        self.thread.join(timeout=2.0)

    @staticmethod
    def close_for_all(store: Store) -> None:
        """Wake every rank's watch, which then ends: at the end of a run, by one rank, once all are past their steps.

        A notice published before stays (``compare_set`` sets a missing key only).
        """
        store.compare_set(_SIGNAL_KEY, "", _CLOSED)


class PreemptionAgreement:
    """One rank's side of the agreement on a boundary to stop at (see the module docstring).

    Args:
        rank: this rank.
        world_size: the number of ranks.
        start: the position the rank starts from (the boundary it last passed).
        watch: the thread that learns of a published notice and acknowledges for this rank; needed with several
            ranks (it is what lets a rank wait for the agreement without a deadlock).
        timeout: seconds a rank waits at a boundary for the other ranks' acknowledgements before it fails.

    Raises:
        ValueError: several ranks and no ``watch``.

    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        start: Position,
        watch: NoticeWatch | None = None,
        timeout: float = 300.0,
    ) -> None:
        if world_size > 1 and watch is None:
            raise ValueError(f"a preemption agreement of {world_size} ranks needs a NoticeWatch per rank")
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.watch = watch
        #: The signal this rank received (set by the signal handler), when, and the boundary it published it at.
        self.received: signal.Signals | None = None
        self.received_at: float | None = None
        self.received_where: str | None = None
        #: The first notice this rank learned of (its own or another rank's).
        self.notice: _Notice | None = None
        #: The largest acknowledged boundary, once agreed: every rank stops at the first boundary after it.
        self.stop_after: Position | None = None
        # between the training thread (position) and the watch thread (the ack)
        self._lock = threading.Lock()
        self._position = start
        self._acked_at: Position | None = None
        self._position_source: Callable[[], Position] | None = None
        self._on_request: Callable[[], None] | None = None
        if watch is not None:
            watch.start(self._ack_for_watch)

    # ------------------------------------------------------------------ boundaries not passed through at_boundary
    def follow(self, source: Callable[[], Position] | None) -> None:
        """Let the watch read this rank's position from ``source`` too, for boundaries passed without at_boundary.

        Before any signal a rank may pass boundaries without :meth:`at_boundary`, which has nothing to do then (see
        :meth:`when_requested`), as long as ``source()`` returns at least the last boundary it passed and at most the
        next one (in ``fit``'s training: :func:`train_position` of ``global_step``). The watch acknowledges at the
        larger of ``source()`` and the last position passed to :meth:`at_boundary`. ``None``: those positions alone.
        """
        self._position_source = source

    def when_requested(self, fn: Callable[[], None] | None) -> None:
        """Call ``fn()`` once this rank received a signal or learned of one (at once if it already did).

        ``fn`` runs in the signal handler or the watch thread: it must only set attributes (it takes no lock). The
        watch calls it before it reads this rank's position, so a rank that then passes a boundary passes it
        through :meth:`at_boundary`.
        """
        self._on_request = fn
        if fn is not None and self.requested:
            fn()

    def _requested(self) -> None:
        fn = self._on_request
        if fn is not None:
            fn()

    # ------------------------------------------------------------------ signal handler side
    def request(self, signum: int) -> None:
        """Record a signal; called by the signal handler, so it only sets attributes (no I/O, no collective)."""
        if self.received is None:
            self.received = signal.Signals(signum)
            self.received_at = time.time()
            self._requested()

    @property
    def requested(self) -> bool:
        """Whether this rank received a signal or learned that another rank did."""
        return self.received is not None or self.notice is not None

    # ------------------------------------------------------------------ training thread side
    def at_boundary(self, store: Store, position: Position, where: str) -> bool:
        """Pass a boundary; ``True`` when every rank stops here.

        Before any signal this takes a lock and reads two attributes: no store operation.

        Args:
            store: the run's store namespace (the training thread's connection).
            position: this boundary; not smaller than the last one passed (one passed again: nothing new). A rank
                may pass the boundaries of ``fit``'s training without this method before any signal (:meth:`follow`).
            where: the boundary in words, for messages (``"step 5"``, ``"test batch 12"``).

        Raises:
            DDPStrategyError: the other ranks did not acknowledge within ``timeout`` seconds.

        """
        with self._lock:
            self._position = position
            acked_at = self._acked_at
            if self.received is not None and self.received_where is None:
                self.received_where = where
            if acked_at is None and self.received is not None:  # publish this rank's own signal, and ack here
                self.notice = _Notice(self.rank, self.received.name, where, self.received_at or time.time())
                store.set(_SIGNAL_KEY, self.notice.to_json())  # another rank's earlier value may be replaced: fine
                self._ack(store, position)
                acked_at = position
        stop_after = self.stop_after
        if stop_after is None:
            if acked_at is None or acked_at == position:
                return False
            stop_after = self._await_stop(store)  # past the boundary of its ack: no further before the agreement
        return position > stop_after

    def at_step_boundary(self, store: Store, step: int) -> bool:
        """:meth:`at_boundary` at the end of the optimizer step that made ``global_step`` ``step``."""
        return self.at_boundary(store, train_position(step), f"step {step}")

    def _ack(self, store: Store, position: Position) -> None:
        """Acknowledge at ``position`` (under the lock); the last rank to do so writes the largest acknowledged."""
        store.append(_ACKS_KEY, _encode(position) + "\n")
        if int(store.add(_ACK_COUNT_KEY, 1)) == self.world_size:
            acks = [_decode(v) for v in store.get(_ACKS_KEY).decode().split()]
            store.compare_set(_STOP_KEY, "", _encode(max(acks)))
        self._acked_at = position

    def _ack_for_watch(self, notice: _Notice, store: Store) -> None:
        """Run by the watch thread when it sees a notice: acknowledge at the last boundary the rank passed."""
        with self._lock:
            if self.notice is None:
                self.notice = notice
            self._requested()  # before the position is read: from now on every boundary goes through at_boundary
            if self._acked_at is None:
                source = self._position_source
                self._ack(store, self._position if source is None else max(self._position, source()))

    def _await_stop(self, store: Store) -> Position:
        try:
            store.wait([_STOP_KEY], timedelta(seconds=self.timeout))
        except Exception as err:
            if "imeout" not in str(err):
                raise
            acked = int(store.add(_ACK_COUNT_KEY, 0))
            raise DDPStrategyError(
                f"Rank {self.rank} waited {self.timeout:.0f} s for the ranks to agree where to stop after "
                f"{self.describe_cause()}: {acked} of {self.world_size} rank(s) acknowledged it. The others' "
                "preemption watch did not run (a rank stuck or gone?); see the other ranks' output."
            ) from err
        self.stop_after = _decode(store.get(_STOP_KEY).decode())
        return self.stop_after

    def learn(self, store: Store) -> None:
        """Read which rank announced which signal, when this rank has not learned it yet (for messages)."""
        if self.notice is None and store.check([_SIGNAL_KEY]):
            value = store.get(_SIGNAL_KEY)
            if value.decode() != _CLOSED:
                self.notice = _Notice.from_json(value)

    def describe_cause(self) -> str:
        """``"SIGTERM on rank 1 (at step 5)"``, or what is known of it."""
        notice = self.notice
        if notice is None:
            return f"{self.received.name} on rank {self.rank}" if self.received is not None else "a signal"
        return f"{notice.signal_name} on rank {notice.rank} (at {notice.where})"

    def exit_code(self) -> int:
        """The exit code for the signal that caused the stop (this rank's own, else the announcing rank's)."""
        return exit_code(signal.Signals[self.signal_name()])

    def signal_name(self) -> str:
        """The name of the signal that caused the stop."""
        if self.received is not None:
            return self.received.name
        return self.notice.signal_name if self.notice is not None else "SIGTERM"


def stop_message(agreement: PreemptionAgreement, *, stopped: str, outcome: str, world_size: int) -> str:
    """The line every rank prints when it stops.

    Args:
        agreement: this rank's agreement (who received what, when).
        stopped: where every rank stopped, e.g. ``"after step 7"``, ``"after test batch 12"``.
        outcome: what was saved and what to do, e.g. ``'saved PATH; resume with trainer.fit(..., ckpt_path="last")'``.
        world_size: the number of ranks.

    """
    if agreement.received is not None:
        at = f" at {agreement.received_where}" if agreement.received_where is not None else ""
        own = f"rank {agreement.rank} received {agreement.received.name}{at}"
    else:
        own = f"rank {agreement.rank} stops for {agreement.describe_cause()}"
    since = agreement.received_at if agreement.received_at is not None else None
    if since is None and agreement.notice is not None:
        since = agreement.notice.time
    after = f" ({time.time() - since:.1f} s after the signal)" if since is not None else ""
    return (
        f"ddp_strategy: preempted: {own}; all {world_size} rank(s) stopped {stopped}{after} and {outcome}. "
        f"Exiting with code {agreement.exit_code()} ({agreement.signal_name()})."
    )
