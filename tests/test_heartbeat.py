"""The heartbeat thread: one thread and one connection publish the heartbeat and run the beat hooks.

Its pace is checked by counting store calls, not by timing (the machine is shared): hooks at the fast beat's pace
while a hook asks for it, publications once per interval, and a hook that waits long keeps the heartbeat fresh
through ``publish_if_due``.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from ddp_strategy.heartbeat import Heartbeat, _Wakeup
from ddp_strategy.positions import Position
from ddp_strategy.store_barrier import POSITION_KEY
from tests.proc import SCRIPTS, run_script

INTERVAL = 0.2


class CountingStore:
    """A HashStore that counts the publications of rank 0's position and every call by method (``calls``)."""

    def __init__(self, store: Any = None) -> None:
        self._store = dist.HashStore() if store is None else store
        self.published = 0
        self.threads: set[str] = set()
        self.calls: Counter[str] = Counter()
        self.by_thread: Counter[tuple[str, str]] = Counter()  # (thread, method)

    def set(self, key: str, value: str) -> None:
        self.threads.add(threading.current_thread().name)
        self.calls["set"] += 1
        self.by_thread[threading.current_thread().name, "set"] += 1
        if key == POSITION_KEY.format(rank=0):
            self.published += 1
        self._store.set(key, value)

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            self.by_thread[threading.current_thread().name, name] += 1
            return method(*args, **kwargs)

        return counted


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


def test_an_interval_costs_one_set_and_one_multi_get_when_a_hook_reads_its_keys_with_the_failure_count():
    # before: the publication (set), the heartbeat's failure check (check) and the desync hook's own read (a check
    # of the next rank's position, then a multi_get): four round trips per interval and rank on rank 0's store
    store = CountingStore()
    store.set("desync/inquiry", "0")
    beats: list[list[bytes]] = []
    beat = started(store)
    try:
        beat.add_beat(lambda s: beats.append(beat.read_with_failures(s, ["desync/inquiry"])))
        deadline = time.monotonic() + 10
        while len(beats) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        beat.stop()
    calls = dict(store.calls)
    assert len(beats) >= 5 and all(values == [b"0"] for values in beats)
    # set: the test's own key, then one publication per beat (a beat can end the test between the two)
    assert calls.pop("set") - 1 - calls["multi_get"] in (0, 1), store.calls
    assert calls.pop("multi_get") == len(beats)
    assert calls == {"add": 1}  # the failure count made at the start: no check, no second read per interval


def test_without_hooks_an_interval_costs_a_set_and_one_read_of_the_failure_count():
    store = CountingStore()
    beat = started(store)
    try:
        deadline = time.monotonic() + 10
        while store.published < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        beat.stop()
    assert store.calls["add"] - 1 in (store.published - 1, store.published)  # one read per publication
    assert set(store.calls) == {"set", "add"}


@pytest.mark.parametrize("hook", [True, False])
def test_a_peer_failure_is_read_once_and_acknowledged(hook: bool):
    # rank 1 fails; rank 0's heartbeat learns it from the count, with its hook's keys or on its own, reads rank 1's
    # position once, and counts itself among the ranks that saw it (what rank 1 waits for before exiting)
    shared = dist.HashStore()
    store, peer_store = CountingStore(shared), CountingStore(shared)
    beat = started(store)
    peer = Heartbeat(rank=1, world_size=2, interval=0, store=peer_store, desync_agreed=lambda: False)
    try:
        if hook:
            shared.set("desync/inquiry", "0")
            beat.add_beat(lambda s: beat.read_with_failures(s, ["desync/inquiry"]))
        time.sleep(2 * INTERVAL)
        assert beat.peer_failure is None and store.calls["get"] == 0
        peer.note_failure(RuntimeError("CUDA error: an illegal memory access"), 3, peer_store)
        deadline = time.monotonic() + 10
        while beat.peer_failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(3 * INTERVAL)  # more beats: the failure is not read again
    finally:
        beat.stop()
    assert beat.peer_failure is not None
    rank, position = beat.peer_failure
    assert rank == 1 and position.kind == "failed" and position.name.startswith("RuntimeError: CUDA error")
    assert store.calls["get"] == 1  # the first failure's rank once (rank 1's position: one compare_set)
    assert int(shared.add("failure/seen", 0)) == 1


class ThreadLog:
    """A beat hook that records, per beat, the thread it ran on and whether the beat was the training thread's."""

    def __init__(self, beat: Heartbeat) -> None:
        self.beat = beat
        self.runs: list[tuple[str, bool]] = []

    def __call__(self, _: object) -> None:
        self.runs.append((threading.current_thread().name, self.beat.inline))


def logged(store: CountingStore, interval: float) -> tuple[Heartbeat, ThreadLog]:
    """A started heartbeat of rank 0 with a :class:`ThreadLog` hook."""
    beat = Heartbeat(rank=0, world_size=2, interval=interval, store=store, desync_agreed=lambda: False)
    hook = ThreadLog(beat)
    beat.add_beat(hook)
    beat.start()
    return beat, hook


def step_for(beat: Heartbeat, seconds: float, first_step: int = 0) -> int:
    """Note a training step every 5 ms on this (the training) thread for ``seconds``; the next step's number."""
    step = first_step
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        beat.note_step(step, batch=step + 1, epoch=0, epoch_batch=step + 1)
        step += 1
        time.sleep(0.005)
    return step


def test_while_the_training_thread_steps_it_beats_itself_and_the_heartbeat_thread_only_wakes():
    # a Python background thread that the scheduler deschedules while it holds the GIL stalls the training thread
    # (issue 30, point 2): while it trains, the training thread runs the due beats itself, at a step's start
    store = CountingStore()
    beat, hook = logged(store, 1.0)
    try:
        step_for(beat, 3.6)
    finally:
        beat.stop()
    # three beats (at about 1, 2 and 3 s), each run by a training step; the heartbeat thread took none over
    assert hook.runs == [("MainThread", True)] * 3, hook.runs
    assert store.threads == {"MainThread"} and store.published == 3
    assert Position.from_json(store.get(POSITION_KEY.format(rank=0))).kind == "training step"


def test_a_beat_on_the_training_thread_only_sends_sets_its_reads_run_at_the_heartbeat_threads_next_wake_up():
    # rank 0's store answers within milliseconds when its host has no idle core: a beat that read it on the training
    # thread took up to 3.5 ms of a step's wall time (issue 30, point 2). The training thread's beat sends `set`s,
    # which await no answer; the failure check and a hook's reads (at_next_wake) run on the heartbeat thread
    store = CountingStore()
    store.set("desync/inquiry", "0")
    beat = Heartbeat(rank=0, world_size=2, interval=1.0, store=store, desync_agreed=lambda: False)
    beats: list[float] = []
    looks: list[tuple[str, bool, float, list[bytes]]] = []

    def look(s: Any) -> None:
        values = beat.read_with_failures(s, ["desync/inquiry"])
        looks.append((threading.current_thread().name, beat.inline, time.monotonic(), values))

    def hook(s: Any) -> None:
        beats.append(time.monotonic())
        beat.at_next_wake(lambda _: looks.append(("replaced", False, 0.0, [])))
        beat.at_next_wake(look)  # replaces the task not run yet

    beat.add_beat(hook)
    beat.start()
    store.by_thread.clear()  # from the first step on (start() creates the failure counter)
    try:
        step_for(beat, 3.6)
    finally:
        beat.stop()
    assert (
        len(beats) == 3
        and [(name, inline, values) for name, inline, _, values in looks]
        == [("ddp_strategy-heartbeat-rank0", False, [b"0"])] * 3
    ), looks
    # each at the wake-up a quarter of an interval (TAKEOVER) after the beat was due
    assert all(0.1 < at - beaten < 0.5 for (_, _, at, _), beaten in zip(looks, beats, strict=True)), (beats, looks)
    main = {method for thread, method in store.by_thread if thread == "MainThread"}
    assert main == {"set"}, store.by_thread  # the training thread's beats: publications only
    # without a hook that reads, the heartbeat thread reads the failure counter at that wake-up
    store = CountingStore()
    beat, hook_log = logged(store, 1.0)
    store.by_thread.clear()
    try:
        step_for(beat, 2.6)
    finally:
        beat.stop()
    assert hook_log.runs == [("MainThread", True)] * 2, hook_log.runs
    assert store.by_thread["MainThread", "add"] == 0 and store.by_thread["ddp_strategy-heartbeat-rank0", "add"] >= 2


def test_a_training_thread_that_stops_stepping_gets_its_beats_from_the_heartbeat_thread():
    # as when the training thread blocks in a collective: within an interval and a quarter the heartbeat thread beats
    store = CountingStore()
    beat, hook = logged(store, INTERVAL)
    try:
        step_for(beat, 5 * INTERVAL)
        stopped = len(hook.runs)
        time.sleep(6 * INTERVAL)  # "blocked": no step
        age = time.time() - heartbeat_of(store)
        step_for(beat, 5 * INTERVAL, first_step=1000)
    finally:
        beat.stop()
    trained, blocked = hook.runs[:stopped], hook.runs[stopped:]
    assert trained and set(trained) == {("MainThread", True)}, hook.runs
    assert ("ddp_strategy-heartbeat-rank0", False) in blocked, hook.runs  # took over while blocked
    assert age < 2 * INTERVAL  # the position stayed fresh (peers count a rank dead after 3 intervals)
    assert blocked[-1] == ("MainThread", True), hook.runs  # and the training thread beats again once it steps


def test_a_hook_in_a_training_thread_beat_hands_work_that_waits_to_the_heartbeat_thread():
    # a desync inquiry's answer waits for every rank: on the training thread a hook asks the heartbeat thread instead
    store = CountingStore()
    beat = Heartbeat(rank=0, world_size=2, interval=1.0, store=store, desync_agreed=lambda: False)
    answered = threading.Event()
    runs: list[tuple[str, bool, float]] = []

    def hook(_: object) -> None:
        runs.append((threading.current_thread().name, beat.inline, time.monotonic()))
        if beat.inline:
            beat.hand_over()
        else:
            answered.set()

    beat.add_beat(hook)
    beat.start()
    try:
        step = 0
        while not runs and step < 1000:  # until the first beat, about 1 s in
            step = step_for(beat, 0.05, first_step=step)
        # the heartbeat thread answers now, not at its next beat (2 s in): well before then
        assert answered.wait(0.7), runs
    finally:
        beat.stop()
    assert [(name, inline) for name, inline, _ in runs[:2]] == [
        ("MainThread", True),
        ("ddp_strategy-heartbeat-rank0", False),
    ]


def test_a_task_left_for_the_next_step_runs_there_apart_from_the_beat_once():
    # the desync audit's dump (about 0.8 ms) comes one step after the beat on the training thread that found it due
    store = CountingStore()
    beat = Heartbeat(rank=0, world_size=2, interval=1.0, store=store, desync_agreed=lambda: False)
    beats: list[int | None] = []
    ran: list[tuple[int | None, str]] = []

    def task() -> None:
        ran.append((beat.step, threading.current_thread().name))

    def hook(_: object) -> None:
        beats.append(beat.step)
        if beat.inline and len(beats) == 1:
            beat.at_next_step(lambda: ran.append((-1, "replaced")))
            beat.at_next_step(task)  # replaces the task not run yet

    beat.add_beat(hook)
    beat.start()
    try:
        step = 0
        while len(beats) < 2 and step < 1000:  # two beats, about 1 and 2 s in
            step = step_for(beat, 0.05, first_step=step)
    finally:
        beat.stop()
    first = beats[0]
    assert first is not None and ran == [(first + 1, "MainThread")], (beats, ran)  # the next step, once


def test_no_beat_on_the_training_thread_without_a_heartbeat_thread():
    store = CountingStore()
    beat, hook = logged(store, 0)
    beat.note_step(1)
    assert hook.runs == [] and store.published == 0


@pytest.mark.timeout(180)
def test_a_graceful_close_deletes_no_key_while_a_peer_heartbeat_still_reads_it(tmp_path: Path):
    # the desync hook reads the next rank's position in its multi_get, which waits for a missing key: rank 1 must not
    # delete its position while rank 0's heartbeat still beats (here 1 s into close). Deleted right after rank 1's
    # own heartbeat stopped (before), rank 0's beat waited in that read: close took 6 s (the heartbeat's join
    # timeout) and left the thread blocked in the store
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    run = run_script([*torchrun, str(SCRIPTS / "close_order.py"), str(tmp_path)], timeout=120)
    assert run.returncode == 0 and not run.orphans, run.describe()
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert all(r["beats"] >= 5 for r in ranks), ranks  # the hooks ran (their multi_get had the peer's key)
    assert ranks[0]["beats_in_close"] >= 5, ranks  # rank 0 beat on while rank 1 was closing
    assert [r["heartbeat_alive"] for r in ranks] == [[], []], ranks  # no beat stuck in a read of a deleted key
    assert all(r["close_seconds"] < 5 for r in ranks), ranks  # not the heartbeat's 5-s join timeout


def test_the_heartbeat_threads_wake_up_ends_a_sleep_early_once_per_set_and_times_out_otherwise():
    """``_Wakeup``, what the heartbeat thread sleeps on: a set before a wait ends that wait at once, two sets count
    once, a set from another thread ends a running wait, and without a set the wait lasts its timeout."""
    wake = _Wakeup()
    start = time.monotonic()
    assert wake.wait(0.05) is False and time.monotonic() - start >= 0.04  # nothing set: the whole timeout
    wake.set()
    wake.set()  # pending already: the same wake-up
    assert wake.wait(5.0) is True  # at once
    start = time.monotonic()
    assert wake.wait(0.05) is False and time.monotonic() - start >= 0.04  # the two sets counted once
    threading.Timer(0.05, wake.set).start()
    start = time.monotonic()
    assert wake.wait(5.0) is True and time.monotonic() - start < 2.0  # ended by the other thread's set
    assert wake.wait(0) is False  # taken by the wait it ended
