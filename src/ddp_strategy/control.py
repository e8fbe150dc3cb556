"""The control plane: how the strategy's ranks talk to each other, apart from DDP's gradients.

DDP's gradient all-reduce runs on the default process group (the *data plane*: gloo on CPU, NCCL on GPU).
Everything the strategy itself says between ranks (handshakes, fingerprints, named barriers) goes through
the *control plane* built here:

* a dedicated gloo process group, so checks work the same whatever the data plane is, and
* the rendezvous store (the ``TCPStore`` that ``init_process_group`` already created), used for monitored
  barriers and for each rank's published :class:`~ddp_strategy.positions.Position`.

A monitored barrier never hangs: each rank records its arrival and waits for the barrier's decision at most
``timeout`` (the protocol, O(1) store operations per rank: :mod:`ddp_strategy.store_barrier`; one rank's wait:
:mod:`ddp_strategy.barrier_wait`). When some never arrive, every rank that did raises
:class:`~ddp_strategy.errors.CollectiveMismatchError` naming the barrier, the missing ranks, and where each missing
rank last was (published by each rank's heartbeat: :mod:`ddp_strategy.heartbeat`). :meth:`ControlPlane.agree` makes
every rank take the same decision on one value per rank (its values and decisions: :mod:`ddp_strategy.agreement`).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar, cast

import torch.distributed as dist

from ._compat.torch import default_store, new_control_gloo_group, new_store_connection
from .agreement import RankFailure, also_failed, failures, first_failure, from_rank
from .barrier_wait import MonitoredBarrier
from .control_agreement import ControlAgreement
from .errors import CollectiveMismatchError
from .heartbeat import (
    FAILURE_KEYS,
    FAST_BEAT,
    RANKS_PER_INTERVAL,
    Heartbeat,
    scaled_interval,
)
from .object_collectives import KeepAlive, all_gather_objects, broadcast_object, gather_objects
from .positions import Position, call_site
from .store import Store
from .store_barrier import POSITION_KEY, PUBLISHED_KEY

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

_UNNAMED = "<unnamed>"


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


def _namespace(prefix: str, base: Any) -> tuple[Store, Callable[[], Store]]:
    """The namespace ``prefix`` of the store ``base`` (the training thread's), and how to open a new connection."""

    def connect() -> Store:
        return cast(Store, dist.PrefixStore(prefix, new_store_connection(base)))  # type: ignore[attr-defined]

    return cast(Store, dist.PrefixStore(prefix, base)), connect  # type: ignore[attr-defined]


class ControlPlane(ControlAgreement):
    """Coordination between the ranks of one strategy run.

    Create it with :meth:`create` after the default process group exists, and :meth:`close` it at teardown.
    All ranks must call :meth:`barrier` and :meth:`all_gather_object` in the same order, as with any
    collective; the difference is that a rank that does not is named in an error instead of causing a hang.

    Where this rank is, as it publishes it, and what it reads of the other ranks' positions: :attr:`heartbeat`.
    The agreement primitive, :meth:`agree`, comes from :class:`~ddp_strategy.control_agreement.ControlAgreement`.

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
        self._store_factory = store_factory
        #: the desync every rank agreed on (see :mod:`ddp_strategy.desync`); a waiting barrier raises it at once
        self.desync_error: CollectiveMismatchError | None = None
        #: this rank's :class:`Heartbeat`: its published position, and the threads that publish it and run beat hooks
        self.heartbeat = Heartbeat(
            rank=rank,
            world_size=world_size,
            interval=heartbeat_interval,
            store=heartbeat_store if heartbeat_store is not None else store,
            desync_agreed=lambda: self.desync_error is not None,
        )
        # a barrier's blocking wait, on a connection of its own: opened now, so that no wait (an error's included)
        # pays for a new connection (a TCP connect, and a name lookup that can take seconds on some hosts)
        self._barrier = MonitoredBarrier(
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            # how often a waiting barrier looks for failed peers; a heartbeat older than 3 intervals is stale
            poll_interval=self.heartbeat.interval if heartbeat_interval > 0 else 1.0,
            waiter_store=store_factory() if store_factory is not None and world_size > 1 else None,
            connect=self.connect,
            desync_error=lambda: self.desync_error,
        )
        # keys deleted at a graceful close: this rank's own, and (by rank 0) those every rank shares
        self._own_keys: set[str] = {POSITION_KEY.format(rank=rank)}
        self._shared_keys: set[str] = {PUBLISHED_KEY, *FAILURE_KEYS}
        # tensors of recent collectives on the gloo group, freed on this thread (see object_collectives)
        self._keep = keep if keep is not None else KeepAlive()
        #: ``(exception, diagnosis)`` of this rank's failure, kept by :func:`~ddp_strategy.peers.diagnose_failed_peers`
        #: (its ``PeerDiagnosis``) so that the strategy and the HangWatchdog share one diagnosis (one wait, one message)
        self.failure_diagnosis: tuple[BaseException, Any] | None = None
        self.heartbeat.publish(store)
        store.append(PUBLISHED_KEY, f"{rank}\n")  # scans read the positions of these ranks only
        self.heartbeat.start()

    @classmethod
    def create(cls, *, timeout: timedelta, heartbeat_interval: float = 1.0) -> ControlPlane:
        """Build the control plane on top of the initialised default process group.

        Creates a new gloo group (a collective call: every rank must call this; see
        :func:`~ddp_strategy._compat.torch.new_control_gloo_group`), agrees on a fresh namespace in the rendezvous
        store so that two runs in one process never see each other's keys, and starts the heartbeat thread.

        Raises:
            RuntimeError: the default process group is not initialised.

        """
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "ddp_strategy's control plane needs an initialised default process group; "
                "`ControlPlane.create` must run after `init_process_group` (the strategy's setup_environment)."
            )
        rank, world_size = dist.get_rank(), dist.get_world_size()
        group = new_control_gloo_group(timeout)  # the default gloo group's device, or a lazy one (no full mesh)
        if not isinstance(group, dist.ProcessGroup):  # every rank is a member of this group
            raise RuntimeError(f"ddp_strategy: creating the gloo control group returned {group!r}")
        keep = KeepAlive()
        token = broadcast_object(uuid.uuid4().hex, src=0, rank=rank, group=group, keep=keep)
        store, connect = _namespace(f"ddp_strategy/{token}/", default_store())
        # a second connection, so the heartbeat never waits behind a blocking wait()
        heartbeat_store = connect() if world_size > 1 else None
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

    # ------------------------------------------------------------------ state
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
    def in_barrier(self) -> tuple[str, float] | None:
        """``("barrier <seq> '<name>'", since)`` while the training thread waits in a barrier of this plane."""
        return self._barrier.waiting_in

    def connect(self) -> Store:
        """A new connection to this run's store namespace, for a background thread.

        A store client is not safe to share between threads (a blocking ``wait`` holds it), so a thread other
        than the training thread uses a connection of its own, as the heartbeat does. Without a ``store_factory``
        (a single-process fake store in tests) this returns the control plane's own store.
        """
        return self._store_factory() if self._store_factory is not None else self._store

    def forget_at_close(self, *keys: str, shared: bool = False) -> None:
        """Delete ``keys`` of this run's namespace when the control plane closes gracefully.

        Args:
            keys: the keys.
            shared: keys every rank uses, deleted by rank 0 once every rank has closed; else keys of this rank,
                deleted by it.

        """
        (self._shared_keys if shared else self._own_keys).update(keys)

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
        seq = self.heartbeat.next_barrier  # this barrier's number; a training step from now on records the next
        self.heartbeat.next_barrier = seq + 1
        entered = time.time()
        self.heartbeat.position = Position(kind="barrier", name=name, site=site, seq=seq, since=entered)
        if self.world_size == 1:
            return
        try:
            self.heartbeat.publish(self._store)
        except Exception as err:
            raise self._barrier.store_lost(name, site, err) from err
        self._barrier.run(self._store, seq, name, site, entered, passed)

    def _collective(self, name: str, site: str) -> None:
        """The position of a collective on the gloo group, after its barrier."""
        beat = self.heartbeat
        beat.position = Position(kind="collective", name=name, site=site, seq=beat.next_barrier, since=time.time())

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
        self._collective(name, site)
        return all_gather_objects(obj, group=self._group, world_size=self.world_size, keep=self._keep)

    def gather_object(self, obj: T, name: str, *, dst: int = 0, site: str | None = None) -> list[T] | None:
        """Gather one picklable object from every rank onto ``dst`` (others get ``None``), after a barrier."""
        site = call_site(skip=2) if site is None else site
        self.barrier(name, site=site)
        if self.world_size == 1:
            return [obj]
        self._collective(name, site)
        return gather_objects(
            obj, dst=dst, rank=self.rank, group=self._group, world_size=self.world_size, keep=self._keep
        )

    def broadcast_object(self, obj: T, name: str, *, src: int = 0, site: str | None = None) -> T:
        """Send ``obj`` from ``src`` to every rank (the value passed elsewhere is ignored), after a barrier."""
        site = call_site(skip=2) if site is None else site
        self.barrier(name, site=site)
        if self.world_size == 1:
            return obj
        self._collective(name, site)
        return broadcast_object(obj, src=src, rank=self.rank, group=self._group, keep=self._keep)  # type: ignore[no-any-return]

    # ------------------------------------------------------------------ failures
    def note_failure(self, exception: BaseException) -> None:
        """Publish that this rank failed, so ranks waiting for it stop at once and name the error (best effort).

        See :meth:`Heartbeat.note_failure`.
        """
        self.heartbeat.note_failure(exception, self.heartbeat.next_barrier, self._store)

    def await_failure_seen(self) -> None:
        """After :meth:`note_failure` on rank 0: wait until every peer has read the failure, at most a few seconds.

        Ranks that the failure's diagnosis (:attr:`failure_diagnosis`) found gone are not waited for; see
        :meth:`Heartbeat.await_failure_seen`.
        """
        diagnosis = self.failure_diagnosis[1] if self.failure_diagnosis is not None else None
        self.heartbeat.await_failure_seen(self._store, gone=getattr(diagnosis, "gone", ()))  # they never read it

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
            self.heartbeat.stop()
            if self._group is not None and dist.is_initialized():
                if closing:
                    # every rank's heartbeat has stopped: no beat reads a peer's key any more (a read of a deleted
                    # key would wait for the store's timeout)
                    dist.barrier(group=self._group)
                    self._delete_keys(self._own_keys)
                    dist.barrier(group=self._group)  # every rank is done: none needs the store once rank 0 goes on
                    if self.rank == 0:
                        self._delete_keys(self._shared_keys)
                dist.destroy_process_group(self._group)
            self._group = None
            self._keep.clear()

    def _delete_keys(self, keys: set[str]) -> None:
        """Delete ``keys`` (best effort: the store's size, not the run's outcome, depends on it)."""
        try:
            for key in sorted(keys):
                self._store.delete_key(key)
        except Exception as err:
            log.debug("ddp_strategy: rank %d could not delete its control-plane keys: %s", self.rank, err)


def create_after_barrier(*, timeout: timedelta, name: str, site: str) -> ControlPlane:
    """:meth:`ControlPlane.create` (without a heartbeat), once every rank has reached a monitored barrier ``name``.

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
    # the barrier's blocking wait needs a connection of its own
    store, connect = _namespace(f"ddp_strategy/outside-run/{call}/", base)
    gate = ControlPlane(
        rank=rank,
        world_size=world_size,
        store=store,
        group=None,
        timeout=timeout,
        heartbeat_interval=0,
        store_factory=connect,
    )
    gate.barrier(name, site=site)
    return ControlPlane.create(timeout=timeout, heartbeat_interval=0)
