"""One failed-peer diagnosis per failure: which peers failed first or are gone, shared by strategy and watchdog."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist

from ddp_strategy import SafeDDPStrategy
from ddp_strategy.callbacks import HangWatchdog
from ddp_strategy.control import ControlPlane
from ddp_strategy.errors import CollectiveMismatchError
from ddp_strategy.peers import PeerDiagnosis, diagnose_failed_peers
from tests.test_control import DeadStore

pytestmark = pytest.mark.serial  # waits bounded in fractions of a second: run alone (make test)

WAIT = 1.0  # max(1 s, 3 heartbeat intervals) with the 0.05 s heartbeat used here


class CountingStore:
    """An in-memory store that counts the reads of published positions (``pos/<rank>`` keys)."""

    def __init__(self) -> None:
        self.inner = dist.HashStore()
        self.position_reads = 0

    def _count(self, keys: list[str]) -> None:
        self.position_reads += sum(key.startswith("pos/") for key in keys)

    def check(self, keys: list[str]) -> bool:
        self._count(keys)
        return self.inner.check(keys)

    def get(self, key: str) -> bytes:
        self._count([key])
        return self.inner.get(key)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.fixture
def planes() -> Iterator[list[ControlPlane]]:
    made: list[ControlPlane] = []
    yield made
    for plane in made:
        plane.close()


def plane(made: list[ControlPlane], store: Any, rank: int, world_size: int, heartbeat: float = 0.05) -> ControlPlane:
    """A simulated rank; ``heartbeat=0`` publishes its position once and never again (a rank that died)."""
    control = ControlPlane(
        rank=rank,
        world_size=world_size,
        store=store,
        group=None,
        timeout=timedelta(seconds=5),
        heartbeat_interval=heartbeat,
    )
    made.append(control)
    return control


def closed_by_peer() -> RuntimeError:
    return RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1")


def errors_logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "ddp_strategy.peers" and r.levelno == logging.ERROR]


def test_a_peer_that_published_a_failure_is_named_at_once(planes, caplog):
    store = dist.HashStore()
    rank0, _, rank2 = (plane(planes, store, r, 3) for r in range(3))
    rank2.note_failure(ValueError("bad batch"))
    started = time.monotonic()
    diagnosis = diagnose_failed_peers(rank0, closed_by_peer())
    assert time.monotonic() - started < WAIT / 2  # no wait for heartbeats
    assert isinstance(diagnosis, PeerDiagnosis)
    assert diagnosis.failed == (2,) and diagnosis.gone == () and diagnosis.store_error is None
    assert diagnosis.message.startswith("ddp_strategy: rank 0 stops after RuntimeError: [../third_party/gloo")
    assert "The first failure was on another rank: rank 2 failed with ValueError: bad batch (" in diagnosis.message
    assert str(diagnosis) == diagnosis.message
    assert errors_logged(caplog) == [diagnosis.message]


def test_peers_that_failed_with_the_same_error_are_not_called_the_first_failure(planes, caplog):
    """Every rank hit the same error by itself (a data guard every batch fails): said so, on no rank "the first
    failure was on another rank" (issue 29, point 3); a peer with another error is still named as the first."""
    store = dist.HashStore()
    rank0, rank1, rank2 = (plane(planes, store, r, 3) for r in range(3))
    rank0.heartbeat.note_step(2, batch=3, epoch=0, epoch_batch=3)
    for peer in (rank1, rank2):
        peer.note_failure(ValueError("labels out of range"))
    diagnosis = diagnose_failed_peers(rank0, ValueError("labels out of range"))
    assert isinstance(diagnosis, PeerDiagnosis) and diagnosis.failed == (1, 2)
    assert diagnosis.message == (
        "ddp_strategy: rank 0 stops after ValueError: labels out of range. Every rank failed with this same error "
        "(this rank at step 2): each rank hit it by itself, so it is no consequence of another rank's failure; the "
        "cause is in this error."
    )
    some = PeerDiagnosis(0, "ValueError: x", failed=(2,), positions={2: rank2.heartbeat.position}, world_size=3)
    assert "The first failure was on another rank: rank 2 failed with ValueError: labels" in some.message  # differs
    alike = PeerDiagnosis(
        0, "ValueError: labels out of range", failed=(2,), positions={2: rank2.heartbeat.position}, world_size=3
    )
    assert alike.message.endswith(
        "Rank(s) 2 failed with this same error too: each rank hit it by itself, so it is no consequence of another "
        "rank's failure; the cause is in this error."
    )


def test_peers_whose_heartbeat_stops_are_named_gone_after_the_wait(planes, caplog):
    store = dist.HashStore()
    rank0 = plane(planes, store, 0, 4)
    plane(planes, store, 1, 4, heartbeat=0)  # published its position once, then died
    plane(planes, store, 2, 4)  # alive: its heartbeat moves; rank 3 never published a position
    started = time.monotonic()
    diagnosis = diagnose_failed_peers(rank0, closed_by_peer())
    waited = time.monotonic() - started
    assert WAIT <= waited < WAIT + 1.0
    assert diagnosis is not None and diagnosis.gone == (1, 3) and diagnosis.failed == ()
    message = diagnosis.message
    assert "ddp_strategy: rank 0 stops after RuntimeError: " in message
    assert "Rank(s) 1, 3 stopped sending heartbeats: killed (SIGKILL, out-of-memory killer)" in message
    assert "or exited early. Last seen:\n  rank 1: started (entered " in message
    assert "\n  rank 3: never published a position" in message
    assert "rank 2" not in message
    assert errors_logged(caplog) == [message]
    # While it waited, this rank's own failure was published, so peers waiting for it stop at once.
    position = rank0.heartbeat.read_position(rank0.store, 0)
    assert position is not None and position.kind == "failed" and "Connection closed by peer" in position.name


def test_many_gone_peers_are_counted_after_eight(planes):
    store = dist.HashStore()
    rank0 = plane(planes, store, 0, 12, heartbeat=0)  # no heartbeats to wait for: only silent ranks are gone
    diagnosis = diagnose_failed_peers(rank0, closed_by_peer())
    assert diagnosis is not None and diagnosis.gone == tuple(range(1, 12))
    assert "Rank(s) 1-11 stopped sending heartbeats" in diagnosis.message
    assert diagnosis.message.count("never published a position") == 8
    assert diagnosis.message.endswith("\n  ... and 3 more")


def test_unreachable_store_names_rank0_as_gone(planes, caplog):
    store = DeadStore()
    rank1 = plane(planes, store, 1, 2, heartbeat=0)
    store.alive = False
    diagnosis = diagnose_failed_peers(rank1, closed_by_peer())
    assert diagnosis is not None and diagnosis.store_error == "Connection reset by peer"
    assert diagnosis.message.startswith("ddp_strategy: rank 1 stops after RuntimeError: ")
    assert "the rendezvous store is unreachable (Connection reset by peer): rank 0 (or, under " in diagnosis.message
    assert "torchrun, node 0's agent), which hosts it, has most likely died or exited" in diagnosis.message
    assert errors_logged(caplog) == [diagnosis.message]


def test_nothing_to_say_when_peers_are_alive_or_the_error_names_them(planes, caplog):
    store = CountingStore()
    rank0, _ = (plane(planes, store, r, 2) for r in range(2))
    assert diagnose_failed_peers(rank0, closed_by_peer()) is None  # rank 1's heartbeat moves
    reads = store.position_reads
    ours = CollectiveMismatchError("rank 1 never arrived", name="b", missing_ranks=[1])
    assert diagnose_failed_peers(rank0, ours) is None
    assert store.position_reads == reads  # our own errors already name the ranks: no reads, no wait
    solo = plane(planes, dist.HashStore(), 0, 1)
    assert diagnose_failed_peers(solo, closed_by_peer()) is None
    assert errors_logged(caplog) == []


@pytest.mark.parametrize("first", ["watchdog", "strategy"])
def test_strategy_and_watchdog_share_one_diagnosis(planes, caplog, tmp_path, first):
    """Lightning calls the callbacks' on_exception, then the strategy's: whichever asks first waits, and only once."""
    store = CountingStore()
    rank0 = plane(planes, store, 0, 2)
    plane(planes, store, 1, 2, heartbeat=0)  # gone
    strategy = SafeDDPStrategy()
    strategy._lifecycle.control = rank0
    trainer = SimpleNamespace(
        strategy=strategy, global_rank=0, world_size=2, default_root_dir=str(tmp_path), global_step=3
    )
    dog = HangWatchdog(60)
    dog.setup(trainer, None, "fit")  # type: ignore[arg-type]
    error = closed_by_peer()
    calls = {
        "watchdog": lambda: dog.on_exception(trainer, None, error),  # type: ignore[arg-type]
        "strategy": lambda: strategy.on_exception(error),
    }
    second = "strategy" if first == "watchdog" else "watchdog"
    started = time.monotonic()
    calls[first]()
    assert time.monotonic() - started >= WAIT
    reads = store.position_reads
    started = time.monotonic()
    calls[second]()
    assert time.monotonic() - started < WAIT / 2
    assert store.position_reads == reads  # the second asker read nothing
    dog.teardown(trainer, None, "fit")  # type: ignore[arg-type]
    messages = errors_logged(caplog)
    assert len(messages) == 1 and "Rank(s) 1 stopped sending heartbeats" in messages[0]
    assert rank0.failure_diagnosis is not None and rank0.failure_diagnosis[0] is error
    assert rank0.failure_diagnosis[1] is not None and rank0.failure_diagnosis[1].gone == (1,)
    # A new failure (another exception) gets its own diagnosis.
    assert diagnose_failed_peers(rank0, closed_by_peer()) is not None
    assert len(errors_logged(caplog)) == 2


class GoneStore:
    """A store whose host has exited: every call fails like a lost TCP connection, and is counted."""

    def __init__(self) -> None:
        self.calls = 0

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        raise RuntimeError("Connection reset by peer")

    set = get = multi_get = check = wait = delete_key = add = append = compare_set = _call


def test_a_blocked_peer_names_rank0s_error_after_rank0_and_its_store_are_gone(planes, caplog):
    """Rank 0 (the store's host) fails at a barrier that rank 1 never reaches; rank 1 is blocked in DDP's all-reduce
    and gets only "Connection closed by peer" once rank 0 exits. Its heartbeat thread read rank 0's failure first,
    and rank 0 waited for that before exiting, so rank 1 names rank 0's error without the store (issue 20)."""
    store = dist.HashStore()
    rank0, rank1 = plane(planes, store, 0, 2), plane(planes, store, 1, 2)
    error = CollectiveMismatchError(
        "Rank 0 waited 5.0 s at barrier 'only_rank0' (train.py:55 in training_step), but rank(s) 1 never arrived",
        name="only_rank0",
        missing_ranks=[1],
    )
    rank0.note_failure(error)
    started = time.monotonic()
    rank0.await_failure_seen()
    assert time.monotonic() - started < WAIT / 2  # read within a few 0.05 s heartbeats, well before the bound
    assert rank1.heartbeat.peer_failure is not None and rank1.heartbeat.peer_failure[0] == 0
    gone = GoneStore()
    rank1._store = gone  # type: ignore[assignment]  # rank 0 has exited
    own = closed_by_peer()
    rank1.note_failure(own)  # nothing is published to a store whose host failed (torch would print a C++ trace)
    diagnosis = diagnose_failed_peers(rank1, own)
    assert gone.calls == 0
    assert diagnosis is not None and diagnosis.failed == (0,) and diagnosis.store_error is None
    expected = "rank 0 failed with CollectiveMismatchError: Rank 0 waited 5.0 s at barrier 'only_rank0' (train.py:55"
    assert "The first failure was on another rank: " + expected in diagnosis.message
    assert errors_logged(caplog) == [diagnosis.message]


def test_rank0_waits_for_peers_to_read_its_failure_at_most_the_bound(planes):
    store = dist.HashStore()
    rank0 = plane(planes, store, 0, 3)
    plane(planes, store, 1, 3)
    plane(planes, store, 2, 3, heartbeat=0)  # gone: never reads it
    rank0.note_failure(ValueError("only on rank 0"))
    started = time.monotonic()
    rank0.await_failure_seen()
    assert WAIT <= time.monotonic() - started < WAIT + 0.5
    # once the diagnosis has found rank 2 gone, it is not waited for
    rank0.failure_diagnosis = (ValueError(), PeerDiagnosis(0, "ValueError: only on rank 0", gone=(2,)))
    started = time.monotonic()
    rank0.await_failure_seen()
    assert time.monotonic() - started < WAIT / 2
