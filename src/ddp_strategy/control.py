"""The control plane: how the strategy's ranks talk to each other, apart from DDP's gradients.

DDP's gradient all-reduce runs on the default process group (the *data plane*: gloo on CPU, NCCL on GPU).
Everything the strategy itself says between ranks (handshakes, fingerprints, named barriers) goes through
the *control plane* built here:

* a dedicated gloo process group, so checks work the same whatever the data plane is, and
* the rendezvous store (the ``TCPStore`` that ``init_process_group`` already created), used for monitored
  barriers and for each rank's published :class:`~ddp_strategy.positions.Position`.

A monitored barrier never hangs: each rank records its arrival and waits for the barrier's decision at most
``timeout`` (the protocol, O(1) store operations per rank: :mod:`ddp_strategy.store_barrier`). When some never
arrive, every rank that did raises :class:`~ddp_strategy.errors.CollectiveMismatchError` naming the barrier, the
missing ranks, and where each missing rank last was.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, TypeVar, cast, overload

import torch.distributed as dist

from ._compat.torch import default_store, new_lazy_gloo_group, new_store_connection
from .errors import CollectiveMismatchError, DDPStrategyError
from .object_collectives import KeepAlive, all_gather_objects, broadcast_object, gather_objects
from .positions import Position, call_site, format_ranks
from .store import Store
from .store_barrier import (
    POSITION_KEY,
    PUBLISHED_KEY,
    SHOWN_POSITIONS,
    Outcome,
    abort,
    arrive,
    done_key,
    leave,
    read_positions_of,
    scan_interval,
)

__all__ = [
    "FAST_BEAT",
    "RANKS_PER_INTERVAL",
    "ControlPlane",
    "RankFailure",
    "Store",
    "also_failed",
    "failures",
    "first_failure",
    "from_rank",
    "scaled_interval",
    "to_timedelta",
]

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

_POSITION_KEY = POSITION_KEY
#: Up to this many ranks, heartbeats come every ``heartbeat_interval``; beyond, the interval grows in proportion.
RANKS_PER_INTERVAL = 512
#: The beat interval while a desync inquiry may come (:attr:`ControlPlane.fast_beat`), scaled like the heartbeat.
FAST_BEAT = 0.2
_FAILED_KEY = "failure/rank"  # the rank of the first published failure; peers' heartbeat threads look for it
_FAILURES_KEY = "failure/count"  # how many ranks published a failure
_SEEN_KEY = "failure/seen"  # how many peers have read the first failure (the failed store host waits for them)
_UNNAMED = "<unnamed>"
# a barrier's first looks at `done` before it blocks: the common case, every rank arriving within a few ms; beyond
# _QUICK_WORLD ranks the arrivals spread wider than that, and each look is W operations on the store: one look
_QUICK_POLLS, _QUICK_POLL, _QUICK_WORLD = 4, 0.002, 64
# how long a rank that is not the leader waits past the timeout for the leader's verdict before making its own
_LEADER_GRACE = 5.0
_REASONS = {"failed": "failed before arriving", "went_on": "went on without entering it"}


def scaled_interval(interval: float, world_size: int) -> float:
    """``interval`` for a background poll of every rank, grown beyond :data:`RANKS_PER_INTERVAL` ranks in proportion.

    Every rank polling once per interval costs the store ``world_size / interval`` operations a second; growing the
    interval with the world size keeps that flat (512 ranks: as given; 4096 ranks: 8 times as long).
    """
    return interval * max(1.0, world_size / RANKS_PER_INTERVAL)


def to_timedelta(value: float | timedelta, *, name: str) -> timedelta:
    """Convert seconds or a ``timedelta`` to a positive ``timedelta``.

    Raises:
        ValueError: ``value`` is not positive, or not a number or ``timedelta``.

    """
    if isinstance(value, timedelta):
        delta = value
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        delta = timedelta(seconds=float(value))
    else:
        raise ValueError(f"`{name}` must be a number of seconds or a datetime.timedelta, got {value!r}.")
    if delta.total_seconds() <= 0:
        raise ValueError(f"`{name}` must be positive, got {value!r}.")
    return delta


@dataclass(frozen=True)
class RankFailure:
    """What one rank's local step of :meth:`ControlPlane.agree` raised, as every rank receives it.

    Exceptions themselves do not travel between ranks (many do not unpickle: keyword-only constructor arguments,
    unpicklable attributes); their class name and text do. On the rank that raised it, :attr:`exception` is the
    exception itself, for chaining or re-raising; it is ``None`` on the other ranks and is never pickled.

    Attributes:
        rank: the global rank whose local step raised.
        type_name: the exception's class name, e.g. ``"OSError"``.
        message: the text to show: an error of this package as is (it names its own cause), any other exception as
            ``"TypeName: text"``.
        exception: the exception itself on the rank that raised it, else ``None``.

    """

    rank: int
    type_name: str
    message: str
    exception: BaseException | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, rank: int, exception: BaseException) -> RankFailure:
        """Describe ``exception``, raised by the local step of ``rank``."""
        text = str(exception) if isinstance(exception, DDPStrategyError) else f"{type(exception).__name__}: {exception}"
        return cls(rank=rank, type_name=type(exception).__name__, message=text, exception=exception)

    def __reduce__(self) -> tuple[type[RankFailure], tuple[int, str, str]]:
        return (RankFailure, (self.rank, self.type_name, self.message))  # without the local exception

    def __str__(self) -> str:
        return self.message


def failures(values: Sequence[object]) -> list[RankFailure]:
    """The :class:`RankFailure` entries among the values :meth:`ControlPlane.agree` gathered, lowest rank first."""
    return [value for value in values if isinstance(value, RankFailure)]


def also_failed(failed: Sequence[RankFailure]) -> str:
    """A sentence naming every failing rank when more than one failed (for messages that show the first), else ``""``.

    Example:
        >>> also_failed([RankFailure(0, "OSError", "a"), RankFailure(2, "OSError", "b")])
        ' (rank(s) 0, 2 failed; the first failure is shown)'

    """
    if len(failed) < 2:
        return ""
    return f" (rank(s) {format_ranks([f.rank for f in failed])} failed; the first failure is shown)"


def first_failure(
    make_error: Callable[[list[RankFailure]], BaseException],
) -> Callable[[Sequence[T | RankFailure]], list[T]]:
    """A decision for :meth:`ControlPlane.agree`: when any rank failed, every rank raises the same error.

    Args:
        make_error: builds the error from every failure, lowest rank first (``failed[0]`` is the one to report;
            :func:`also_failed` names the others). It runs on every rank with the same failures; it may phrase the
            message relative to the calling rank, or return a failing rank's own :attr:`RankFailure.exception` to
            re-raise it there.

    Returns:
        The decision: the values of every rank (none failed), else raises ``make_error(failures)``.

    """

    def decide(values: Sequence[T | RankFailure]) -> list[T]:
        failed = failures(values)
        if failed:
            raise make_error(failed)
        return [value for value in values if not isinstance(value, RankFailure)]

    return decide


def from_rank(
    src: int = 0, make_error: Callable[[list[RankFailure]], BaseException] | None = None
) -> Callable[[Sequence[T | RankFailure]], T]:
    """A decision for :meth:`ControlPlane.agree`: every rank takes rank ``src``'s value (a checked broadcast).

    Meant for small values; send a large payload with :meth:`ControlPlane.broadcast_object`.

    Args:
        src: the rank whose value every rank takes.
        make_error: the error every rank raises when some rank's local step failed (as for :func:`first_failure`);
            by default a :class:`~ddp_strategy.errors.DDPStrategyError` naming the first failing rank.

    Returns:
        The decision.

    """

    def default_error(failed: list[RankFailure]) -> BaseException:
        first = failed[0]
        return DDPStrategyError(f"Rank {first.rank} failed: {first.message}{also_failed(failed)}")

    every = first_failure(make_error if make_error is not None else default_error)

    def decide(values: Sequence[T | RankFailure]) -> T:
        return every(values)[src]

    return decide


def _chain_last(err: BaseException, first: BaseException) -> None:
    """Make ``first`` the context of the innermost exception of ``err``'s chain, so tracebacks show both."""
    seen = {id(err)}
    tail = err
    while (inner := tail.__cause__ or tail.__context__) is not None and id(inner) not in seen:
        seen.add(id(inner))
        tail = inner
    if first is not tail and id(first) not in seen:
        tail.__context__ = first


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


class ControlPlane:
    """Coordination between the ranks of one strategy run.

    Create it with :meth:`create` after the default process group exists, and :meth:`close` it at teardown.
    All ranks must call :meth:`barrier` and :meth:`all_gather_object` in the same order, as with any
    collective; the difference is that a rank that does not is named in an error instead of causing a hang.

    Args:
        rank: this process's global rank.
        world_size: the number of ranks.
        store: the rendezvous store, already namespaced to this run.
        group: the gloo process group for small object collectives, or ``None`` when ``world_size == 1``.
        timeout: how long a barrier waits for the other ranks.
        heartbeat_interval: how often (seconds) a background thread re-publishes this rank's position, up to
            :data:`RANKS_PER_INTERVAL` ranks; beyond, in proportion to the world size (4096 ranks: 8 times as long).
        heartbeat_store: a second connection to the store for the heartbeat thread (defaults to ``store``).
        store_factory: opens a new connection to the namespaced store, for other background threads (see
            :meth:`connect`); without it :meth:`connect` returns ``store``.

    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        store: Store,
        group: Any,
        timeout: timedelta,
        heartbeat_interval: float = 1.0,
        heartbeat_store: Store | None = None,
        store_factory: Callable[[], Store] | None = None,
        keep: KeepAlive | None = None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self._store = store
        self._group = group
        self._seq = 0
        self._position = Position(kind="started", name="started", since=time.time())
        self._stop = threading.Event()
        self._heartbeat_store = heartbeat_store if heartbeat_store is not None else store
        self._store_factory = store_factory
        # beyond RANKS_PER_INTERVAL ranks the interval (and every staleness limit derived from it) grows in
        # proportion, so that the store sees the same number of heartbeats per second at any world size
        self._heartbeat_interval = scaled_interval(heartbeat_interval, world_size)
        # How often a waiting barrier looks for failed peers; a heartbeat older than 3 intervals is stale.
        self._poll_interval = self._heartbeat_interval if heartbeat_interval > 0 else 1.0
        self._heartbeat: threading.Thread | None = None
        # a barrier's blocking wait, on a connection of its own: opened now, so that no wait (an error's included)
        # pays for a new connection (a TCP connect, and a name lookup that can take seconds on some hosts)
        self._waiter_store: Store | None = store_factory() if store_factory is not None and world_size > 1 else None
        # keys deleted at a graceful close: this rank's own, and (by rank 0) those every rank shares
        self._own_keys: set[str] = {_POSITION_KEY.format(rank=rank)}
        self._shared_keys: set[str] = {PUBLISHED_KEY, _FAILED_KEY, _FAILURES_KEY, _SEEN_KEY}
        # tensors of recent collectives on the gloo group, freed on this thread (see object_collectives)
        self._keep = keep if keep is not None else KeepAlive()
        #: ``(exception, diagnosis)`` of this rank's failure, kept by :func:`~ddp_strategy.peers.diagnose_failed_peers`
        #: so that the strategy and the HangWatchdog share one diagnosis (one wait, one message).
        #: ``(exception, diagnosis)`` memo of :func:`ddp_strategy.peers.diagnose_failed_peers` (its ``PeerDiagnosis``)
        self.failure_diagnosis: tuple[BaseException, Any] | None = None
        #: ``(rank, position)`` of a peer's failure, read by the heartbeat thread as soon as it is published
        self._peer_failure: tuple[int, Position] | None = None
        #: the barrier the training thread waits in right now, and since when (set and cleared by the wait itself)
        self._in_barrier: tuple[str, float] | None = None
        self._step: int | None = None  # the optimizer step of the last training batch this rank started
        self._progress: tuple[int | None, int | None] = (None, None)  # (epoch, batches started in it)
        self._waiting: tuple[str, float] = ("", 0.0)  # what the training thread waits in (see `set_waiting`)
        self._ledger: tuple[int, int] = (0, 0)  # (calls, digest) of the strategy's collectives (see `set_ledger`)
        self._beat_hooks: list[Callable[[Store], None]] = []
        #: beat every :data:`FAST_BEAT` seconds (scaled beyond RANKS_PER_INTERVAL ranks) instead of every heartbeat
        #: interval: set while a desync inquiry may come
        self.fast_beat = False
        self._fast_interval = scaled_interval(FAST_BEAT, world_size)
        #: the desync every rank agreed on (see :mod:`ddp_strategy.desync`); a waiting barrier raises it at once
        self.desync_error: CollectiveMismatchError | None = None
        self._publish(self._position)
        store.append(PUBLISHED_KEY, f"{rank}\n")  # scans read the positions of these ranks only
        self._beats: threading.Thread | None = None  # runs the beat hooks (see add_beat), started by the first
        if world_size > 1 and heartbeat_interval > 0:
            self._heartbeat = threading.Thread(
                target=self._heartbeat_loop, name=f"ddp_strategy-pulse-rank{rank}", daemon=True
            )
            self._heartbeat.start()

    @classmethod
    def create(cls, *, timeout: timedelta, heartbeat_interval: float = 1.0) -> ControlPlane:
        """Build the control plane on top of the initialised default process group.

        Creates a new gloo group (a collective call: every rank must call this), agrees on a fresh namespace in
        the rendezvous store so that two runs in one process never see each other's keys, and starts the
        heartbeat thread.

        Raises:
            RuntimeError: the default process group is not initialised.

        """
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "ddp_strategy's control plane needs an initialised default process group; "
                "`ControlPlane.create` must run after `init_process_group` (the strategy's setup_environment)."
            )
        rank, world_size = dist.get_rank(), dist.get_world_size()
        group = new_lazy_gloo_group(timeout)  # no full mesh: pairs connect on first use
        if not isinstance(group, dist.ProcessGroup):  # every rank is a member of this group
            raise RuntimeError(f"ddp_strategy: creating the gloo control group returned {group!r}")
        keep = KeepAlive()
        token = broadcast_object(uuid.uuid4().hex, src=0, rank=rank, group=group, keep=keep)
        base = default_store()
        prefix = f"ddp_strategy/{token}/"
        store = cast(Store, dist.PrefixStore(prefix, base))  # type: ignore[attr-defined]
        heartbeat_store: Store | None = None

        def connect() -> Store:
            return cast(Store, dist.PrefixStore(prefix, new_store_connection(base)))  # type: ignore[attr-defined]

        if world_size > 1:  # a second connection, so the heartbeat never waits behind a blocking wait()
            heartbeat_store = connect()
        return cls(
            rank=rank,
            world_size=world_size,
            store=store,
            group=group,
            timeout=timeout,
            heartbeat_interval=heartbeat_interval,
            heartbeat_store=heartbeat_store,
            store_factory=connect,
            keep=keep,
        )

    @classmethod
    def create_after_barrier(cls, *, timeout: timedelta, name: str, site: str) -> ControlPlane:
        """:meth:`create` (without a heartbeat), once every rank has reached a monitored barrier ``name``.

        For a collective call outside a run, e.g. ``trainer.save_checkpoint`` after ``fit``: creating the gloo group
        waits for every rank, so a rank that never calls would leave the others inside torch's group creation.
        The barrier names it after ``timeout`` instead. Every rank counts its own calls in the rendezvous store,
        so the k-th call of every rank meets in the same namespace.
        """
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ddp_strategy: `create_after_barrier` needs an initialised default process group.")
        base = default_store()
        rank, world_size = dist.get_rank(), dist.get_world_size()
        call = base.add(f"ddp_strategy/outside-run/calls/{rank}", 1)
        prefix = f"ddp_strategy/outside-run/{call}/"

        def connect() -> Store:  # the barrier's blocking wait needs a connection of its own
            return cast(Store, dist.PrefixStore(prefix, new_store_connection(base)))  # type: ignore[attr-defined]

        gate = cls(
            rank=rank,
            world_size=world_size,
            store=cast(Store, dist.PrefixStore(prefix, base)),  # type: ignore[attr-defined]
            group=None,
            timeout=timeout,
            heartbeat_interval=0,
            store_factory=connect,
        )
        gate.barrier(name, site=site)
        return cls.create(timeout=timeout, heartbeat_interval=0)

    # ------------------------------------------------------------------ positions
    @property
    def group(self) -> Any:
        """The gloo process group of this control plane (``None`` once closed)."""
        return self._group

    @property
    def store(self) -> Store:
        """The training thread's connection to this run's namespace of the rendezvous store.

        Other threads must use their own (see :meth:`connect`).
        """
        return self._store

    @property
    def position(self) -> Position:
        """This rank's current position."""
        return self._position

    def note_step(
        self, step: int, *, batch: int | None = None, epoch: int | None = None, epoch_batch: int | None = None
    ) -> None:
        """Record that this rank is in training step ``step``; cheap enough for every step (no I/O).

        Args:
            step: the optimizer step (``trainer.global_step``), shown in messages.
            batch: how many training batches this rank has started in this run, this one included; lets another
                rank tell that this one went past a point of that batch (see ``passed`` in :meth:`barrier`).
            epoch: the training epoch of this batch.
            epoch_batch: how many batches of that epoch this rank has started, this one included.

        """
        self._position = Position(kind="training step", name=str(step), seq=self._seq, since=time.time(), batch=batch)
        self._step = step
        if epoch is not None:
            self._progress = (epoch, epoch_batch)

    @property
    def progress(self) -> tuple[int | None, int | None]:
        """``(epoch, batches started in it)`` of the last training batch this rank started (``None`` before)."""
        return self._progress

    @property
    def step(self) -> int | None:
        """The optimizer step (``trainer.global_step``) of the last training batch this rank started."""
        return self._step

    @property
    def in_barrier(self) -> tuple[str, float] | None:
        """``("barrier <seq> '<name>'", since)`` while the training thread waits in a barrier of this plane."""
        return self._in_barrier

    def set_waiting(self, what: str, since: float) -> None:
        """Record what the training thread waits in (``""``: nothing), published with every heartbeat."""
        self._waiting = (what, since)

    def set_ledger(self, calls: int, digest: int) -> None:
        """Record the count and digest of the strategy's collectives, published with every heartbeat."""
        self._ledger = (calls, digest)

    def add_beat(self, hook: Callable[[Store], None]) -> None:
        """Run ``hook(store)`` at every beat (each heartbeat interval, :data:`FAST_BEAT` s with :attr:`fast_beat`).

        The hooks run on a thread of their own (``ddp_strategy-heartbeat-rank<r>``, started with the first hook),
        apart from the thread that publishes the heartbeat: a slow hook never delays the heartbeat. ``store`` is the
        beat thread's own connection. When the hooks changed what this rank waits in (:meth:`set_waiting`), the
        position is published right after them. An exception from ``hook`` is logged, not raised.
        """
        self._beat_hooks.append(hook)
        if self._beats is None and self._heartbeat is not None:
            self._beats = threading.Thread(
                target=self._beat_loop, name=f"ddp_strategy-heartbeat-rank{self.rank}", daemon=True
            )
            self._beats.start()

    def _published(self, position: Position, when: float) -> Position:
        epoch, epoch_batch = self._progress
        waiting, since = self._waiting
        calls, digest = self._ledger
        return replace(
            position,
            heartbeat=when,
            epoch=epoch,
            epoch_batch=epoch_batch,
            waiting=waiting,
            waiting_since=since,
            calls=calls,
            digest=digest,
        )

    def publish_heartbeat(self, store: Store) -> None:
        """Publish this rank's position with a fresh heartbeat through ``store`` (a background thread's own)."""
        store.set(_POSITION_KEY.format(rank=self.rank), self._published(self._position, time.time()).to_json())

    def _publish(self, position: Position) -> None:
        self._store.set(_POSITION_KEY.format(rank=self.rank), self._published(position, time.time()).to_json())

    def _beat(self, store: Store) -> None:
        for hook in list(self._beat_hooks):
            try:
                hook(store)
            except Exception as err:  # a diagnosis must never stop the beats
                log.warning("ddp_strategy: rank %d: a heartbeat task failed: %r", self.rank, err)

    def _going_down(self) -> bool:
        """Whether the store may be gone any moment: the ranks agreed on a desync, or rank 0 failed."""
        return self.desync_error is not None or (self._peer_failure is not None and self._peer_failure[0] == 0)

    def _beat_loop(self) -> None:
        try:
            store = self.connect()
        except Exception as err:  # the store is gone before the first beat
            log.debug("ddp_strategy: rank %d: no connection for the beat hooks: %s", self.rank, err)
            return
        while not self._stop.wait(self._fast_interval if self.fast_beat else self._heartbeat_interval):
            if self._peer_failure is not None and self._peer_failure[0] == 0:
                return  # rank 0 failed: its store is about to go, and a call to a gone store prints a C++ trace
            waiting = self._waiting
            self._beat(store)
            if self._waiting != waiting and not self._going_down():
                try:
                    self.publish_heartbeat(store)  # the others see the new wait now, not at the next heartbeat
                except Exception as err:  # the publisher thread reports a gone store
                    log.debug("ddp_strategy: rank %d: publishing after the beat: %s", self.rank, err)

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self._heartbeat_interval):
            if self.desync_error is not None:
                continue  # the ranks agreed on a desync and are going down: rank 0's store may be gone any moment
            try:
                self.publish_heartbeat(self._heartbeat_store)
                if self._peer_failure is None and self._heartbeat_store.check([_FAILED_KEY]):
                    self._read_peer_failure(self._heartbeat_store)
                if self._peer_failure is not None and self._peer_failure[0] == 0:
                    return  # rank 0 failed: its store is about to go, and a call to a gone store prints a C++ trace
            except Exception as err:  # the store is gone: rank 0 exited or died
                if not self._stop.is_set():
                    log.warning(
                        "ddp_strategy: rank %d stopped publishing its heartbeat: the rendezvous store is "
                        "unreachable (%s). Rank 0, which hosts it, has probably exited.",
                        self.rank,
                        err,
                    )
                return

    def _read_peer_failure(self, store: Store) -> None:
        """Keep the first failure another rank published, and tell that rank it was seen."""
        failed = int(store.get(_FAILED_KEY))
        key = _POSITION_KEY.format(rank=failed)
        if failed == self.rank or not store.check([key]):
            return
        position = Position.from_json(store.get(key))
        if position.kind == "failed":
            self._peer_failure = (failed, position)
            store.add(_SEEN_KEY, 1)

    @property
    def peer_failure(self) -> tuple[int, Position] | None:
        """``(rank, position)`` of another rank's failure, once this rank's heartbeat thread has read it.

        Kept here so that this rank can still name it after the store is gone: when the failed rank is rank 0,
        which hosts the store, this rank's own error (a backend ``Connection closed by peer``) comes once rank 0
        has exited.
        """
        return self._peer_failure

    @property
    def heartbeat_interval(self) -> float:
        """Seconds between two publications of this rank's position (``0``: no heartbeat thread).

        The configured interval, scaled up beyond :data:`RANKS_PER_INTERVAL` ranks; every staleness limit (a rank
        whose heartbeat is older than a few intervals counts as dead) is a multiple of it.
        """
        return self._heartbeat_interval

    def connect(self) -> Store:
        """A new connection to this run's store namespace, for a background thread.

        A store client is not safe to share between threads (a blocking ``wait`` holds it), so a thread other
        than the training thread uses a connection of its own, as the heartbeat does. Without a ``store_factory``
        (a single-process fake store in tests) this returns the control plane's own store.
        """
        return self._store_factory() if self._store_factory is not None else self._store

    def read_positions(self, store: Store | None = None) -> dict[int, Position | None]:
        """Every rank's last published position (``None`` for a rank that never published one).

        Args:
            store: the connection to read through; a background thread passes its own (see :meth:`connect`).

        """
        return self.read_positions_of(range(self.world_size), store)

    def read_positions_of(self, ranks: Sequence[int], store: Store | None = None) -> dict[int, Position | None]:
        """The last published positions of ``ranks`` (``None``: never published), in batched reads.

        Args:
            ranks: the ranks.
            store: the connection to read through; a background thread passes its own (see :meth:`connect`).

        """
        return read_positions_of(self._store if store is None else store, list(ranks))

    def forget_at_close(self, *keys: str, shared: bool = False) -> None:
        """Delete ``keys`` of this run's namespace when the control plane closes gracefully.

        Args:
            keys: the keys.
            shared: keys every rank uses, deleted by rank 0 once every rank has closed; else keys of this rank,
                deleted by it.

        """
        (self._shared_keys if shared else self._own_keys).update(keys)

    def failures_published(self, store: Store | None = None) -> int:
        """How many ranks have published a failure (:meth:`note_failure`) in this run; one counter read."""
        return int((self._store if store is None else store).add(_FAILURES_KEY, 0))

    def read_position(self, rank: int, store: Store | None = None) -> Position | None:
        """The last position ``rank`` published, or ``None`` when it never published one.

        Args:
            rank: the rank.
            store: the connection to read through; a background thread passes its own (see :meth:`connect`).

        """
        store = self._store if store is None else store
        key = _POSITION_KEY.format(rank=rank)
        if not store.check([key]):
            return None
        return Position.from_json(store.get(key))

    # ------------------------------------------------------------------ collectives
    def barrier(
        self, name: str | None = None, *, site: str | None = None, passed: Callable[[Position], bool] | None = None
    ) -> None:
        """Wait until every rank reaches this barrier, at most ``timeout``.

        Args:
            name: a name for the barrier; it appears in errors, and ranks that reach barriers of different
                names at the same point raise an error instead of silently pairing them up.
            site: the call site to report; found from the stack when not given.
            passed: for a barrier that only some ranks may enter (one they enter when a local test fires): tells,
                from a missing rank's published position, that it went past this point without entering, so it
                never will. Such a rank ends the wait at once (``reason="went_on"``) instead of after the timeout.

        Raises:
            CollectiveMismatchError: some ranks did not arrive within the timeout, or arrived at a barrier with
                a different name.

        """
        name = name or _UNNAMED
        site = call_site(skip=2) if site is None else site
        seq = self._seq
        self._seq += 1
        entered = time.time()
        self._position = Position(kind="barrier", name=name, site=site, seq=seq, since=entered)
        if self.world_size == 1:
            return
        try:
            self._publish(self._position)
            arrival = arrive(self._store, seq, self.rank, self.world_size, name)
        except Exception as err:
            raise self._store_lost(name, site, err) from err
        outcome = arrival.outcome
        if outcome is None:
            self._in_barrier = (f"barrier {seq} '{name}'", entered)
            try:
                outcome = self._await_outcome(seq, name, site, entered, arrival.leader, passed)
            finally:
                self._in_barrier = None
        try:
            leave(self._store, seq, self.world_size)
        except Exception as err:  # the outcome is known; only the clean-up failed
            log.debug("ddp_strategy: rank %d could not clean up barrier %d: %s", self.rank, seq, err)
        if not outcome.ok:
            raise self._outcome_error(outcome, name, site, time.time() - entered)

    def all_gather_object(
        self, obj: T, name: str, *, site: str | None = None, passed: Callable[[Position], bool] | None = None
    ) -> list[T]:
        """Gather one picklable object from every rank, on every rank, after a monitored barrier.

        The barrier first makes sure every rank is here (or names the ones that are not); the gather itself
        then runs on the gloo control group. ``passed``: see :meth:`barrier`.
        """
        site = call_site(skip=2) if site is None else site
        self.barrier(name, site=site, passed=passed)
        if self.world_size == 1:
            return [obj]
        self._position = Position(kind="collective", name=name, site=site, seq=self._seq, since=time.time())
        return all_gather_objects(obj, group=self._group, world_size=self.world_size, keep=self._keep)

    def gather_object(self, obj: T, name: str, *, dst: int = 0, site: str | None = None) -> list[T] | None:
        """Gather one picklable object from every rank onto ``dst`` (others get ``None``), after a barrier."""
        site = call_site(skip=2) if site is None else site
        self.barrier(name, site=site)
        if self.world_size == 1:
            return [obj]
        self._position = Position(kind="collective", name=name, site=site, seq=self._seq, since=time.time())
        return gather_objects(
            obj, dst=dst, rank=self.rank, group=self._group, world_size=self.world_size, keep=self._keep
        )

    def broadcast_object(self, obj: T, name: str, *, src: int = 0, site: str | None = None) -> T:
        """Send ``obj`` from ``src`` to every rank (the value passed elsewhere is ignored), after a barrier."""
        site = call_site(skip=2) if site is None else site
        self.barrier(name, site=site)
        if self.world_size == 1:
            return obj
        self._position = Position(kind="collective", name=name, site=site, seq=self._seq, since=time.time())
        return broadcast_object(obj, src=src, rank=self.rank, group=self._group, keep=self._keep)  # type: ignore[no-any-return]

    @overload
    def agree(
        self,
        name: str,
        local: Callable[[], T],
        decide: Callable[[Sequence[T | RankFailure]], R],
        *,
        site: str | None = None,
        passed: Callable[[Position], bool] | None = None,
    ) -> R: ...

    @overload
    def agree(
        self,
        name: str,
        local: T,
        decide: Callable[[Sequence[T | RankFailure]], R],
        *,
        site: str | None = None,
        passed: Callable[[Position], bool] | None = None,
    ) -> R: ...

    def agree(
        self,
        name: str,
        local: T | Callable[[], T],
        decide: Callable[[Sequence[T | RankFailure]], R],
        *,
        site: str | None = None,
        passed: Callable[[Position], bool] | None = None,
    ) -> R:
        """Make every rank take the same decision on one small value per rank, or raise the same error.

        The model is PyTorch DCP's ``_DistWrapper.all_reduce``: each rank computes its value, a failure included
        (so a rank that fails locally still takes part and nobody waits for it), the values are gathered on every
        rank (behind a monitored barrier, which names a rank that never comes), and ``decide`` turns them into the
        result on every rank. As every rank runs ``decide`` on the same values, every rank returns the same result
        or raises the same error. On a rank whose own step failed, that error is chained to its exception.

        Args:
            name: the name of the agreement, for barriers and errors; every rank must use the same.
            local: this rank's value (small and picklable), or a function without arguments computing it: an
                ``Exception`` it raises becomes this rank's value, as a :class:`RankFailure` (``KeyboardInterrupt``
                and ``SystemExit`` propagate at once). To agree on a value that is itself callable, pass a
                function returning it.
            decide: computes the result from the values, indexed by rank, or raises. It must depend only on the
                values (it may phrase a message relative to :attr:`rank`); :func:`first_failure` and
                :func:`from_rank` are the common decisions.
            site: the call site to report; found from the stack when not given.
            passed: for an agreement that only the ranks whose local test fired enter: see :meth:`barrier`.

        Returns:
            What ``decide`` returned, the same on every rank.

        Raises:
            CollectiveMismatchError: some rank did not reach the agreement in time, or reached another one.
            Exception: whatever ``decide`` raised, on every rank.

        """
        site = call_site(skip=2) if site is None else site
        mine: T | RankFailure
        if callable(local):
            try:
                mine = local()
            except Exception as err:  # a value like any other: the other ranks learn it instead of waiting
                mine = RankFailure.of(self.rank, err)
        else:
            mine = local
        own = mine.exception if isinstance(mine, RankFailure) else None
        try:
            values = self.all_gather_object(mine, name, site=site, passed=passed)
        except BaseException as err:
            if own is not None:  # shown with the barrier's error: this rank had failed too
                _chain_last(err, own)
            raise
        values[self.rank] = mine  # this rank's own entry keeps its exception (only its text travelled)
        try:
            return decide(values)
        except BaseException as err:
            if own is None or err is own or err.__cause__ is not None:
                raise
            raise err from own

    def _await_outcome(
        self, seq: int, name: str, site: str, entered: float, leader: bool, passed: Callable[[Position], bool] | None
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
                if self._store.check([key]):
                    return Outcome.from_value(self._store.get(key))
                time.sleep(_QUICK_POLL)
        except Exception as err:
            raise self._store_lost(name, site, err) from err
        deadline = entered + self.timeout.total_seconds()
        waiter = _DoneWaiter(self._waiting_store(), key, deadline + _LEADER_GRACE + 60 - time.time())
        interval = scan_interval(self._poll_interval, self.world_size)
        next_scan = time.time() + interval
        try:
            while not waiter.finished.wait(min(0.5, interval)):
                if self.desync_error is not None:  # the ranks' collectives diverged: this barrier is never completed
                    abort(self._store, seq, Outcome("desync", by=self.rank))
                    raise self.desync_error
                now = time.time()
                mine = leader or now >= deadline + _LEADER_GRACE
                if mine and (now >= next_scan or now >= deadline):
                    next_scan = now + interval
                    self._scan(seq, deadline, passed)
        except KeyboardInterrupt:
            self._abort_quietly(seq, Outcome("interrupted", missing=(self.rank,), by=self.rank))
            raise
        except CollectiveMismatchError:
            raise
        except Exception as err:
            raise self._store_lost(name, site, err) from err
        if waiter.error is not None:
            raise self._store_lost(name, site, waiter.error) from waiter.error
        try:
            return Outcome.from_value(self._store.get(key))
        except Exception as err:
            raise self._store_lost(name, site, err) from err

    def _scan(self, seq: int, deadline: float, passed: Callable[[Position], bool] | None) -> None:
        """The leader's look at the missing ranks: end the barrier when one failed, went past, or at the deadline."""
        from .store_barrier import arrived

        here = arrived(self._store, seq)
        missing = [rank for rank in range(self.world_size) if rank not in here]
        if not missing:
            return  # the last rank is deciding right now
        positions = read_positions_of(self._store, missing)
        failed = [r for r, p in positions.items() if p is not None and p.kind == "failed"]
        went_on = passed is not None and any(
            p is not None and p.kind != "failed" and passed(p) for p in positions.values()
        )
        if not (failed or went_on or time.time() >= deadline):
            return
        reason = "failed" if failed else "went_on" if went_on else "missing"
        shown = (failed + [r for r in missing if r not in failed])[:SHOWN_POSITIONS]
        outcome = Outcome(reason, tuple(missing), {r: positions[r] for r in shown}, by=self.rank)
        abort(self._store, seq, outcome)

    def _abort_quietly(self, seq: int, outcome: Outcome) -> None:
        try:
            abort(self._store, seq, outcome)
        except Exception as err:  # best effort: the interrupt being raised is what matters
            log.debug("ddp_strategy: rank %d could not abort barrier %d: %s", self.rank, seq, err)

    def _waiting_store(self) -> Store:
        """The connection a barrier's blocking wait uses (its own: a blocked client cannot serve other calls)."""
        if self._waiter_store is None:
            self._waiter_store = self.connect()
        return self._waiter_store

    def _outcome_error(self, outcome: Outcome, name: str, site: str, waited: float) -> BaseException:
        if outcome.reason == "desync" and self.desync_error is not None:
            return self.desync_error
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
        stale_after = max(1.0, 3 * self._poll_interval)
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

    def note_failure(self, exception: BaseException) -> None:
        """Publish that this rank failed, so ranks waiting for it stop at once and name the error.

        Best effort: when the store is unreachable the failure is only logged. Nothing is published after rank 0,
        which hosts the store, was seen failing: its store is gone or about to go, and touching it makes torch
        print a C++ stack trace.
        """
        text = f"{type(exception).__name__}: {exception}".splitlines()[0][:300]
        self._position = Position(kind="failed", name=text, seq=self._seq, since=time.time())
        if self._peer_failure is not None and self._peer_failure[0] == 0:
            return
        try:
            self._publish(self._position)
            self._store.add(_FAILURES_KEY, 1)
            self._store.compare_set(_FAILED_KEY, "", str(self.rank))  # the first failure is the one to name
            # ranks waiting in (or coming to) the next barrier of this rank, which it never enters, stop at once
            abort(self._store, self._seq, Outcome("failed", (self.rank,), {self.rank: self._position}, by=self.rank))
        except Exception as err:
            log.warning("ddp_strategy: rank %d could not publish its failure (%s)", self.rank, err)

    def await_failure_seen(self) -> None:
        """After :meth:`note_failure` on rank 0: wait until every peer has read the failure, at most a few seconds.

        Rank 0 hosts the rendezvous store (under Lightning's launchers and SLURM), so once it exits its peers can
        no longer read why. A peer that is blocked inside a collective (DDP's all-reduce) still reads the failure
        on its heartbeat thread, within one heartbeat interval; this waits for that, at most
        ``max(1 s, 3 heartbeat intervals)``, so that every rank can name rank 0's error rather than a closed
        socket. Ranks the failure's diagnosis found gone are not waited for. Without heartbeats, or with one rank,
        it returns at once.
        """
        if self.world_size < 2 or self._heartbeat_interval <= 0:
            return
        diagnosis = self.failure_diagnosis[1] if self.failure_diagnosis is not None else None
        gone = set(getattr(diagnosis, "gone", ()))  # they will never read it
        expected = self.world_size - 1 - len(gone - {self.rank})
        deadline = time.monotonic() + max(1.0, 3 * self._heartbeat_interval)
        try:
            while time.monotonic() < deadline:
                seen, failed = int(self._store.add(_SEEN_KEY, 0)), int(self._store.add(_FAILURES_KEY, 0))
                if seen + failed - 1 >= expected:  # a failed peer reads nothing; this rank's own failure counts once
                    return
                time.sleep(min(0.05, self._heartbeat_interval / 4))
        except Exception as err:  # best effort: the error being raised is what matters
            log.debug("ddp_strategy: waiting for peers to read rank %d's failure: %s", self.rank, err)

    def _delete_keys(self, keys: set[str]) -> None:
        """Delete ``keys`` (best effort: the store's size, not the run's outcome, depends on it)."""
        try:
            for key in sorted(keys):
                self._store.delete_key(key)
        except Exception as err:
            log.debug("ddp_strategy: rank %d could not delete its control-plane keys: %s", self.rank, err)

    def _store_lost(self, name: str, site: str, err: Exception) -> CollectiveMismatchError:
        return CollectiveMismatchError(
            f"Rank {self.rank} could not reach the rendezvous store at barrier '{name}' ({site or 'unknown site'}): "
            f"{err}. The store is hosted by rank 0's process (by the node-0 agent under torchrun), so rank 0 or "
            "node 0 has most likely exited or died; look at its output for the first error.",
            name=name,
            missing_ranks=[0],
            reason="store",
        )

    # ------------------------------------------------------------------ teardown
    def close(self, *, graceful: bool = True) -> None:
        """Stop the heartbeat and destroy the gloo group.

        Args:
            graceful: end with a monitored barrier ``"teardown"`` (the heartbeat still on, so a rank that never
                comes is named) and then a barrier on the gloo group, so that no rank still needs the store when
                rank 0 goes on. Every rank must then call ``close``. Pass ``False`` after a failure, when other
                ranks may never arrive.

        Raises:
            CollectiveMismatchError: with ``graceful``, a rank did not come to the closing barrier (after
                ``timeout``, or at once when the ranks' collectives diverged); the group is destroyed anyway.

        """
        closing = graceful and self.world_size > 1 and self._group is not None and dist.is_initialized()
        try:
            if closing:  # monitored, with the heartbeat still on: a rank that never comes is named, not waited for
                self.barrier("teardown", site=call_site(skip=2))
        except BaseException:
            closing = False
            raise
        finally:
            self._stop.set()
            for thread in (self._heartbeat, self._beats):
                if thread is not None:
                    thread.join(timeout=max(5.0, 2 * self._heartbeat_interval))
            self._heartbeat = self._beats = None
            if self._group is not None and dist.is_initialized():
                if closing:  # every rank is here: none needs the store once rank 0 goes on
                    self._delete_keys(self._own_keys)
                    dist.barrier(group=self._group)
                    if self.rank == 0:
                        self._delete_keys(self._shared_keys)
                dist.destroy_process_group(self._group)
            self._group = None
            self._keep.clear()
