"""Preemption: a signal that reaches any subset of ranks stops every rank at one agreed step, with a checkpoint.

Schedulers stop jobs with SIGTERM (SLURM's ``scancel``, Kubernetes, spot instances; SLURM can send SIGUSR1 first
with ``--signal``). The signal reaches every rank, or some of them, at different moments, while they are inside
different collectives. Any collective started from a signal handler (Lightning's own SIGTERM handler broadcasts)
meets an unrelated collective of another rank and the job deadlocks.

Here the handler only records the signal. At each optimizer-step boundary (a training batch end at which
``global_step`` moved) the training thread runs :meth:`PreemptionAgreement.at_step_boundary`, which uses the
control plane's rendezvous store and never a collective:

1. a rank that received a signal publishes it; every rank learns of it from a :class:`NoticeWatch`, a thread
   blocked in one store ``wait`` for that key (no polling: the store wakes it when the key is set, so every rank
   learns within milliseconds); without a watch, a rank looks for the key at most once per ``poll_interval``
   seconds (one store lookup);
2. every rank that knows of the signal appends an *ack* holding its step to one key and counts itself in; the rank
   whose ack completes the count reads the acks once and writes the stop step, ``max(acks) + 1``, to one key;
3. from its ack on, every rank looks for that key at every step boundary (one lookup), and stops there. With
   watches, every rank acks within about a step of the first, so this lasts a step or two.

Each rank does O(1) store operations per agreement, whatever the world size, and none per step before a signal.

Why every rank reaches that step and none has passed it: completing an optimizer step needs every rank's gradients
of that step (DDP's all-reduce), so when the last rank acks at step ``a`` (and writes the stop step before its step
``a`` ends), no rank can be past step ``a + 1``, and each rank reads the stop step at a step boundary no later than
``a + 1 <= max(acks) + 1``. This holds
for every optimizer step that synchronizes gradients (automatic optimization, gradient accumulation included);
manual optimization that steps without any collective gives no such bound (the stop is then named, not silent).
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta

from .errors import DDPStrategyError
from .exit_safety import end_at_exit
from .store import Store

__all__ = [
    "DEFAULT_PREEMPTION_SIGNALS",
    "NoticeWatch",
    "Preempted",
    "PreemptionAgreement",
    "exit_code",
    "parse_signals",
    "stop_message",
]

log = logging.getLogger(__name__)

#: The signals handled by default: what schedulers send to stop a job.
DEFAULT_PREEMPTION_SIGNALS: tuple[str, ...] = ("SIGTERM",)

_SIGNAL_KEY = "preempt/signal"
_ACKS_KEY = "preempt/acks"  # every rank appends the step it acknowledged at
_ACK_COUNT_KEY = "preempt/ack-count"  # how many ranks acknowledged; the one that makes it W decides the stop step
_STOP_KEY = "preempt/stop-step"  # the agreed stop step, written once
_CLOSED = "closed"  # the signal key's value once a run ended without a notice: wakes every rank's watch
#: the keys of the agreement (deleted with the control plane's namespace at its close)
KEYS = (_SIGNAL_KEY, _ACKS_KEY, _ACK_COUNT_KEY, _STOP_KEY)


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
        step: the optimizer step every rank stopped after (``trainer.global_step`` of the checkpoint).
        path: the checkpoint written at that step, or ``None`` when none could be.
        message: the line printed on every rank.

    """

    def __init__(self, message: str, *, signal_name: str, code: int, step: int, path: str | None) -> None:
        super().__init__(code)
        self.message = message
        self.signal_name = signal_name
        self.step = step
        self.path = path

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class _Notice:
    """Who received which signal, at which step (the value of the signal key)."""

    rank: int
    signal_name: str
    step: int
    time: float  # when the signal was received (time.time() on that rank)

    def to_json(self) -> str:
        return json.dumps({"rank": self.rank, "signal": self.signal_name, "step": self.step, "time": self.time})

    @classmethod
    def from_json(cls, raw: bytes) -> _Notice:
        data = json.loads(raw)
        return cls(int(data["rank"]), str(data["signal"]), int(data["step"]), float(data["time"]))


class NoticeWatch:
    """A thread blocked in one store ``wait`` for the signal key; :attr:`notice` is set when a rank publishes one.

    No polling: the store wakes the wait when the key is set, so the training thread learns of a signal on another
    rank by reading an attribute. The wait is renewed every ``renew`` seconds (one store operation). The thread
    ends when the key is set (a notice, or :meth:`close_for_all` at the end of a run), after :meth:`close` at its
    next renewal, or when the store fails (its host is gone).

    Args:
        store: a connection of its own (a blocking ``wait`` holds it), to the run's store namespace.
        rank: this rank (the thread's name).
        renew: seconds between two renewals of the wait.
        waker: another connection to the same namespace, used at process exit only (:meth:`end_at_exit`).

    """

    def __init__(self, store: Store, *, rank: int, renew: float = 60.0, waker: Store | None = None) -> None:
        #: The notice a rank published, once the watch saw it.
        self.notice: _Notice | None = None
        self._store = store
        self._waker = waker
        self._renew = timedelta(seconds=renew)
        self._closed = False
        self.thread = threading.Thread(target=self._run, name=f"ddp_strategy-preemption-watch-rank{rank}", daemon=True)
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
            if value.decode() != _CLOSED:
                self.notice = _Notice.from_json(value)
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
    """One rank's side of the agreement on a stop step (see the module docstring).

    Args:
        rank: this rank.
        world_size: the number of ranks.
        poll_interval: without ``watch``: seconds between two lookups of the signal key by a rank that received
            no signal.
        watch: the thread that learns of a published notice (then the training thread reads no store for it).

    """

    def __init__(
        self, *, rank: int, world_size: int, poll_interval: float = 1.0, watch: NoticeWatch | None = None
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.poll_interval = poll_interval
        self.watch = watch
        #: The signal this rank received (set by the signal handler), and when.
        self.received: signal.Signals | None = None
        self.received_at: float | None = None
        self.received_at_step: int | None = None
        #: The first notice this rank learned of (its own or another rank's).
        self.notice: _Notice | None = None
        #: The step every rank stops after, once agreed.
        self.stop_step: int | None = None
        self._announced = False
        self._acked = False
        self._next_poll = 0.0

    # ------------------------------------------------------------------ signal handler side
    def request(self, signum: int) -> None:
        """Record a signal; called by the signal handler, so it only sets attributes (no I/O, no collective)."""
        if self.received is None:
            self.received = signal.Signals(signum)
            self.received_at = time.time()

    @property
    def requested(self) -> bool:
        """Whether this rank received a signal or learned that another rank did."""
        return self.received is not None or self.notice is not None

    # ------------------------------------------------------------------ training thread side
    def at_step_boundary(self, store: Store, step: int) -> bool:
        """Advance the agreement at an optimizer-step boundary; ``True`` when every rank stops here (after ``step``).

        Raises:
            DDPStrategyError: this rank is already past the agreed stop step (its optimizer steps do not
                synchronize with the other ranks, e.g. manual optimization without a collective).

        """
        if self.stop_step is not None:
            return self._reached(step)
        if not self._acked:
            if self.received is not None and not self._announced:
                self.received_at_step = step
                notice = _Notice(self.rank, self.received.name, step, self.received_at or time.time())
                store.set(_SIGNAL_KEY, notice.to_json())  # the first publisher's value may be overwritten: fine
                self.notice = notice
                self._announced = True
            elif self.notice is None and self.watch is not None:
                if self.watch.notice is None:
                    return False
                self.notice = self.watch.notice
            elif self.notice is None:
                now = time.monotonic()
                if now < self._next_poll:
                    return False
                self._next_poll = now + self.poll_interval
                if not store.check([_SIGNAL_KEY]):
                    return False
                self.notice = _Notice.from_json(store.get(_SIGNAL_KEY))
            store.append(_ACKS_KEY, f"{step}\n")
            if int(store.add(_ACK_COUNT_KEY, 1)) == self.world_size:  # the last to acknowledge decides for all
                steps = [int(v) for v in store.get(_ACKS_KEY).decode().split()]
                store.compare_set(_STOP_KEY, "", str(max(steps) + 1))
            self._acked = True
        if not store.check([_STOP_KEY]):  # one key per step boundary until agreed, whatever the world size
            return False
        self.stop_step = int(store.get(_STOP_KEY))
        return self._reached(step)

    def learn(self, store: Store) -> None:
        """Read which rank announced which signal, when this rank has not learned it yet (for messages)."""
        if self.notice is None and store.check([_SIGNAL_KEY]):
            self.notice = _Notice.from_json(store.get(_SIGNAL_KEY))

    def _reached(self, step: int) -> bool:
        assert self.stop_step is not None
        if step > self.stop_step:
            raise DDPStrategyError(
                f"Rank {self.rank} is at step {step}, past the step {self.stop_step} the ranks agreed to stop after "
                f"because of {self.describe_cause()}: its optimizer steps do not wait for the other ranks (manual "
                "optimization without a collective?), so no common stop step exists and no checkpoint was written. "
                "Synchronize the ranks at every optimizer step, or pass SafeDDPStrategy(preemption_signals=None)."
            )
        return step == self.stop_step

    def describe_cause(self) -> str:
        """``"SIGTERM on rank 1 (at step 5)"``, or what is known of it."""
        notice = self.notice
        if notice is None:
            return f"{self.received.name} on rank {self.rank}" if self.received is not None else "a signal"
        return f"{notice.signal_name} on rank {notice.rank} (at step {notice.step})"

    def exit_code(self) -> int:
        """The exit code for the signal that caused the stop (this rank's own, else the announcing rank's)."""
        if self.received is not None:
            return exit_code(self.received)
        name = self.notice.signal_name if self.notice is not None else "SIGTERM"
        return exit_code(signal.Signals[name])

    def signal_name(self) -> str:
        """The name of the signal that caused the stop."""
        if self.received is not None:
            return self.received.name
        return self.notice.signal_name if self.notice is not None else "SIGTERM"


def stop_message(agreement: PreemptionAgreement, *, step: int, path: str | None, resume: str, world_size: int) -> str:
    """The line every rank prints when it stops (``resume``: the ``ckpt_path`` to pass, e.g. ``'"last"'``)."""
    if agreement.received is not None:
        at = f" at step {agreement.received_at_step}" if agreement.received_at_step is not None else ""
        own = f"rank {agreement.rank} received {agreement.received.name}{at}"
    else:
        own = f"rank {agreement.rank} stops for {agreement.describe_cause()}"
    saved = (
        f"saved {path}; resume with trainer.fit(..., ckpt_path={resume})"
        if path is not None
        else "no checkpoint was written"
    )
    since = agreement.received_at if agreement.received_at is not None else None
    if since is None and agreement.notice is not None:
        since = agreement.notice.time
    after = f" ({time.time() - since:.1f} s after the signal)" if since is not None else ""
    return (
        f"ddp_strategy: preempted: {own}; all {world_size} rank(s) stopped after step {step}{after} and {saved}. "
        f"Exiting with code {agreement.exit_code()} ({agreement.signal_name()})."
    )
