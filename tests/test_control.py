"""Monitored barrier logic, with several ranks simulated by threads sharing one in-memory store."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from ddp_strategy.control import ControlPlane, to_timedelta
from ddp_strategy.errors import CollectiveMismatchError


def make_planes(world_size: int, timeout: float = 1.0, heartbeat: float = 0.1) -> list[ControlPlane]:
    store = dist.HashStore()
    return [
        ControlPlane(
            rank=r,
            world_size=world_size,
            store=store,
            group=None,
            timeout=timedelta(seconds=timeout),
            heartbeat_interval=heartbeat,
        )
        for r in range(world_size)
    ]


def run_ranks(planes: list[ControlPlane], fn) -> dict[int, BaseException | None]:
    outcome: dict[int, BaseException | None] = {}

    def target(plane: ControlPlane) -> None:
        try:
            fn(plane)
            outcome[plane.rank] = None
        except BaseException as err:
            outcome[plane.rank] = err

    threads = [threading.Thread(target=target, args=(p,)) for p in planes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
        assert not t.is_alive(), "a simulated rank hung"
    for p in planes:
        p.close()
    return outcome


def test_barrier_passes_when_every_rank_arrives_repeatedly():
    planes = make_planes(3)
    outcome = run_ranks(planes, lambda p: [p.barrier(f"b{i}") for i in range(5)])
    assert outcome == {0: None, 1: None, 2: None}
    assert all(p.position.kind == "barrier" and p.position.name == "b4" for p in planes)


def test_barrier_reached_by_rank0_only_names_missing_rank_and_its_position():
    planes = make_planes(2, timeout=1.0)

    def fn(plane: ControlPlane) -> None:
        if plane.rank == 0:
            plane.barrier("only_rank0", site="train.py:10 in main")
        else:
            plane.note_step(7)
            time.sleep(1.6)

    start = time.monotonic()
    outcome = run_ranks(planes, fn)
    assert time.monotonic() - start < 5
    err = outcome[0]
    assert isinstance(err, CollectiveMismatchError)
    assert err.name == "only_rank0" and err.missing_ranks == (1,)
    text = str(err)
    assert "barrier 'only_rank0'" in text and "train.py:10 in main" in text
    assert "rank 1: training step 7" in text
    assert outcome[1] is None


def test_barrier_names_must_match():
    planes = make_planes(2)
    outcome = run_ranks(planes, lambda p: p.barrier("save" if p.rank == 0 else "load"))
    for rank in (0, 1):
        err = outcome[rank]
        assert isinstance(err, CollectiveMismatchError)
        assert "'save' on rank(s) 0" in str(err) and "'load' on rank(s) 1" in str(err)


def test_unnamed_barrier_pairs_with_named_one():
    planes = make_planes(2)
    outcome = run_ranks(planes, lambda p: p.barrier("x" if p.rank == 0 else None))
    assert outcome == {0: None, 1: None}


def test_published_failure_stops_waiting_ranks_early():
    planes = make_planes(3, timeout=30.0)

    def fn(plane: ControlPlane) -> None:
        if plane.rank == 2:
            plane.note_failure(ValueError("disk on fire"))
        else:
            plane.barrier("handshake")

    start = time.monotonic()
    outcome = run_ranks(planes, fn)
    assert time.monotonic() - start < 5, "waiting ranks did not stop early"
    for rank in (0, 1):
        err = outcome[rank]
        assert isinstance(err, CollectiveMismatchError)
        assert err.missing_ranks == (2,)
        assert "failed with ValueError: disk on fire" in str(err)


def test_stale_heartbeat_is_called_out():
    planes = make_planes(2, timeout=1.5, heartbeat=0.05)
    planes[1].close()  # rank 1 stops publishing: it looks dead

    outcome = run_ranks(planes[:1], lambda p: p.barrier("wait_for_dead"))
    text = str(outcome[0])
    assert "rank 1: started" in text and "no heartbeat since" in text


def test_live_rank_is_not_called_dead():
    planes = make_planes(2, timeout=1.5, heartbeat=0.05)

    def fn(plane: ControlPlane) -> None:
        if plane.rank == 0:
            plane.barrier("wait_for_live")
        else:
            time.sleep(2.0)

    outcome = run_ranks(planes, fn)
    assert "rank 1: started" in str(outcome[0]) and "no heartbeat since" not in str(outcome[0])


def test_single_rank_barrier_is_immediate():
    (plane,) = make_planes(1)
    plane.barrier("solo")
    assert plane.all_gather_object({"a": 1}, "solo") == [{"a": 1}]
    plane.close()


@pytest.mark.parametrize("value", [0, -1, "10", None, True, timedelta(0)])
def test_to_timedelta_rejects_bad_values(value):
    with pytest.raises(ValueError, match="barrier_timeout"):
        to_timedelta(value, name="barrier_timeout")


def test_to_timedelta_accepts_seconds_and_timedelta():
    assert to_timedelta(2.5, name="t") == timedelta(seconds=2.5)
    assert to_timedelta(timedelta(minutes=1), name="t") == timedelta(minutes=1)


class DeadStore:
    """A store whose host has gone away: every call fails like a lost TCP connection."""

    def __init__(self) -> None:
        self.alive = True

    def _call(self, *args, **kwargs):
        if not self.alive:
            raise RuntimeError("Connection reset by peer")

    set = get = multi_get = check = wait = delete_key = _call


def test_unreachable_store_is_reported_as_rank0_gone():
    store = DeadStore()
    plane = ControlPlane(
        rank=1, world_size=2, store=store, group=None, timeout=timedelta(seconds=5), heartbeat_interval=0
    )
    store.alive = False
    with pytest.raises(CollectiveMismatchError, match="could not reach the rendezvous store") as info:
        plane.barrier("after_rank0_died")
    assert info.value.missing_ranks == (0,)
    assert isinstance(info.value.__cause__, RuntimeError)
    plane.close()
