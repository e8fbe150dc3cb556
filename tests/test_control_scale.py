"""The control plane's store work per rank does not grow with the world size (issue 32): counted, not timed.

Up to 48 ranks are simulated by threads, each with its own counting view of one in-memory store; the counts are
exact whatever the machine's load, so they are compared between world sizes directly.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from ddp_strategy.control import ControlPlane
from ddp_strategy.errors import CollectiveMismatchError

pytestmark = pytest.mark.serial  # dozens of threads with sub-second waits: run alone (make test)


class CountingStore:
    """One rank's connection to a shared store: counts its calls and the keys they touch."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.ops = 0
        self.keys = 0
        self._lock = threading.Lock()

    def _count(self, keys: int) -> None:
        with self._lock:
            self.ops += 1
            self.keys += keys

    def set(self, key: str, value: str) -> None:
        self._count(1)
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        self._count(1)
        return bytes(self.inner.get(key))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._count(len(keys))
        return list(self.inner.multi_get(keys))

    def check(self, keys: list[str]) -> bool:
        self._count(len(keys))
        return bool(self.inner.check(keys))

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        self._count(len(keys))
        self.inner.wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        self._count(1)
        return bool(self.inner.delete_key(key))

    def add(self, key: str, amount: int) -> int:
        self._count(1)
        return int(self.inner.add(key, amount))

    def append(self, key: str, value: str) -> None:
        self._count(1)
        self.inner.append(key, value)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        self._count(1)
        return bytes(self.inner.compare_set(key, expected, desired))


def late_rank_barrier(world_size: int, late: float, timeout: float = 30.0) -> tuple[list[CountingStore], Any]:
    """Every rank enters barrier 'save'; rank 0 (writing a checkpoint) ``late`` seconds after the others.

    Returns each rank's store view (its count covers the barrier only: no heartbeat thread) and the shared store.
    """
    shared = dist.HashStore()
    stores = [CountingStore(shared) for _ in range(world_size)]
    planes = [
        ControlPlane(
            rank=r, world_size=world_size, store=stores[r], group=None, timeout=timedelta(seconds=timeout),
            heartbeat_interval=0,
        )
        for r in range(world_size)
    ]  # fmt: skip
    for store in stores:
        store.ops = store.keys = 0  # count the barrier, not the construction
    errors: list[BaseException] = []

    def rank(plane: ControlPlane) -> None:
        try:
            if plane.rank == 0:
                time.sleep(late)
            plane.barrier("save")
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=rank, args=(p,)) for p in planes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), "a simulated rank hung"
    assert errors == []
    for plane in planes:
        plane.close()
    return stores, shared


def test_a_barrier_with_a_late_rank_costs_each_rank_the_same_few_operations_at_8_and_48_ranks():
    # before issue 32 every waiting rank polled `check` of all W arrival keys every 0.5-20 ms and, once a second,
    # each missing key alone: O(W) keys per poll, O(W^2) in all
    counts = {}
    for world_size in (8, 48):
        stores, _ = late_rank_barrier(world_size, late=1.5)
        counts[world_size] = sorted((s.ops, s.keys) for s in stores)
    for world_size, per_rank in counts.items():
        most_ops, most_keys = max(o for o, _ in per_rank), max(k for _, k in per_rank)
        # arrive (append, compare_set, add, publish), up to 4 quick looks, one blocking wait, get, leave; the leader
        # adds 2 reads per scan (heartbeat interval 1 s: one scan in 1.5 s) and one batched read of missing positions
        assert most_ops <= 20, (world_size, per_rank)
        assert most_keys <= 20, (world_size, per_rank)  # keys touched: no read of all W ranks' keys
    assert max(counts[48])[0] <= max(counts[8])[0] + 2  # the same work per rank at 6x the ranks


def test_a_barrier_leaves_no_key_behind():
    stores, shared = late_rank_barrier(16, late=0.2)
    # left per run: each rank's position and the list of ranks that published one (one key for all)
    assert shared.num_keys() == 16 + 1


def test_rank0_only_barrier_is_named_by_the_leader_alone():
    # 32 ranks, rank 0 enters a barrier no one else does: rank 0 leads it and reads the 31 missing positions in one
    # batched read per scan, instead of 31 single reads
    world_size = 32
    shared = dist.HashStore()
    stores = [CountingStore(shared) for _ in range(world_size)]
    planes = [
        ControlPlane(
            rank=r, world_size=world_size, store=stores[r], group=None, timeout=timedelta(seconds=1.0),
            heartbeat_interval=0,
        )
        for r in range(world_size)
    ]  # fmt: skip
    for plane in planes[1:]:
        plane.note_step(7)
        plane.publish_heartbeat(plane.store)  # as its heartbeat thread would
    stores[0].ops = stores[0].keys = 0
    with pytest.raises(CollectiveMismatchError) as info:
        planes[0].barrier("only_rank0", site="train.py:10 in training_step")
    assert info.value.missing_ranks == tuple(range(1, world_size))
    text = str(info.value)
    assert "rank(s) 1-31 never arrived" in text and "rank 1: training step 7" in text
    assert "(15 more rank(s) not shown)" in text  # 16 positions travel in the verdict, not 31
    assert stores[0].ops <= 20  # arrive, quick looks, wait, one scan at the timeout (arrived + one batched read)
    for plane in planes:
        plane.close()
