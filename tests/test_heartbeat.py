"""The heartbeat thread: one thread and one connection publish the heartbeat and run the beat hooks.

Its pace is checked by counting store calls, not by timing (the machine is shared): hooks at the fast beat's pace
while a hook asks for it, publications once per interval, and a hook that waits long keeps the heartbeat fresh
through ``publish_if_due``.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch.distributed as dist

from ddp_strategy.heartbeat import Heartbeat
from ddp_strategy.positions import Position
from ddp_strategy.store_barrier import POSITION_KEY

INTERVAL = 0.2


class CountingStore:
    """A HashStore that counts the publications of rank 0's position and notes which threads call it."""

    def __init__(self) -> None:
        self._store = dist.HashStore()
        self.published = 0
        self.threads: set[str] = set()

    def set(self, key: str, value: str) -> None:
        self.threads.add(threading.current_thread().name)
        if key == POSITION_KEY.format(rank=0):
            self.published += 1
        self._store.set(key, value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def started(store: CountingStore, **kwargs: Any) -> Heartbeat:
    beat = Heartbeat(rank=0, world_size=2, interval=INTERVAL, store=store, desync_agreed=lambda: False, **kwargs)
    beat.start()
    return beat


def heartbeat_of(store: CountingStore) -> float:
    return Position.from_json(store.get(POSITION_KEY.format(rank=0))).heartbeat


def test_one_thread_publishes_and_runs_the_hooks_on_its_one_connection():
    store = CountingStore()
    seen: list[tuple[str, object]] = []
    beat = started(store)
    try:
        beat.add_beat(lambda s: seen.append((threading.current_thread().name, s)))
        deadline = time.monotonic() + 10
        while (len(seen) < 3 or store.published < 3) and time.monotonic() < deadline:
            time.sleep(0.05)
        names = {t.name for t in threading.enumerate() if t.name.startswith("ddp_strategy-")}
    finally:
        beat.stop()
    assert names == {"ddp_strategy-heartbeat-rank0"}  # no second thread (the former "pulse" publisher)
    assert len(seen) >= 3 and {name for name, _ in seen} == {"ddp_strategy-heartbeat-rank0"}
    assert all(s is store for _, s in seen)  # the hooks get the heartbeat's own connection, no new one
    assert store.threads == {"ddp_strategy-heartbeat-rank0"}
    assert not any(t.name.startswith("ddp_strategy-") for t in threading.enumerate())  # stopped


def test_fast_beats_run_the_hooks_often_and_publish_once_per_interval():
    store = CountingStore()
    hooks = 0

    def hook(_: object) -> None:
        nonlocal hooks
        hooks += 1

    beat = started(store)
    try:
        beat.fast_beat = True
        beat._fast_interval = INTERVAL / 8
        beat.add_beat(hook)
        deadline = time.monotonic() + 10
        while hooks < 24 and time.monotonic() < deadline:
            time.sleep(0.02)
        hooks_then, published_then = hooks, store.published
    finally:
        beat.stop()
    assert hooks_then >= 24
    # the beats come about 8 times per publication; on a loaded machine fewer, never fewer than one per publication
    assert 1 <= published_then <= hooks_then // 3, (hooks_then, published_then)


@pytest.mark.parametrize("keeps_fresh", [True, False])
def test_a_hook_that_waits_long_keeps_the_heartbeat_fresh_through_publish_if_due(keeps_fresh: bool):
    store = CountingStore()
    inside, done = threading.Event(), threading.Event()
    first = True
    during = -1

    def long_hook(s: Any) -> None:  # as a desync inquiry waiting for every rank's report
        nonlocal first, during
        if not first:
            return
        first = False
        inside.set()
        before = store.published
        end = time.monotonic() + 8 * INTERVAL
        while time.monotonic() < end:
            if keeps_fresh:
                beat.publish_if_due(s)
            time.sleep(INTERVAL / 10)
        during = store.published - before
        done.set()

    beat = started(store)
    try:
        beat.add_beat(long_hook)
        assert inside.wait(10) and done.wait(10)
    finally:
        beat.stop()
    if keeps_fresh:
        assert during >= 3  # about one per interval of the hook's 8 intervals
    else:
        assert during == 0  # the contract: a hook that waits long must call publish_if_due


def test_publish_if_due_does_nothing_without_a_heartbeat_thread():
    store = CountingStore()
    beat = Heartbeat(rank=0, world_size=2, interval=0, store=store, desync_agreed=lambda: False)
    beat.start()
    beat.publish_if_due(store)
    assert store.published == 0 and beat._thread is None
