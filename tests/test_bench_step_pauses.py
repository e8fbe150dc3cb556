"""The step-pauses benchmark's stretch accounting (bench/step_pauses.py): a garbage collection marks its stretch.

No timing is asserted: which stretch ran a collection is counted, not how long it took.
"""

from __future__ import annotations

import gc
import threading
import time
from pathlib import Path

import pytest

from tests.proc import load_bench

BENCH = Path(__file__).resolve().parents[1] / "bench"

pauses = load_bench("bench_step_pauses", BENCH / "step_pauses.py")


def test_a_stretch_that_ran_a_garbage_collection_is_counted_apart_and_the_longest_without_one_kept():
    """On a thread named like the strategy's: three stretches between sleeps, the second with a collection."""
    collections = pauses.Collections()
    holds = pauses.Holds(event_cost=0.0, collections_here=collections.on_this_thread)
    holds.recording = True
    gc.callbacks.append(collections.callback)

    def run() -> None:
        import sys

        sys.setprofile(holds.profile)
        try:
            time.sleep(0)  # the first stretch ends here (from the thread's start)
            sum(range(1000))
            time.sleep(0)  # the second: no collection
            gc.collect()
            time.sleep(0)  # the third: a collection on this thread
        finally:
            sys.setprofile(None)

    thread = threading.Thread(target=run, name="ddp_strategy-test")
    try:
        thread.start()
        thread.join()
    finally:
        gc.callbacks.remove(collections.callback)
    assert holds.stretches == 3 and holds.with_collection == 1
    assert holds.longest_without_collection["garbage_collection"] is False
    assert holds.longest_without_collection["from"] in ("thread start", "test_bench_step_pauses.py:34")
    collected = [s for s in (holds.longest, holds.longest_without_collection) if s["garbage_collection"]]
    assert all(s["from"] == "test_bench_step_pauses.py:36" for s in collected)
    assert collections.on_this_thread() == 0  # the collection ran on the other thread
    assert holds.longest["wall_s"] >= 0.0 and holds.longest["thread"] == "ddp_strategy-test"


def test_a_stretch_counts_the_time_its_thread_waited_for_a_core_while_it_held_the_gil(tmp_path):
    """A busy process pinned to the same core as the stretch's thread: part of the stretch's wall time is runnable.

    The scheduler's counts are read where a stretch starts and where it ends: its wall time splits into its time on a
    core and its time runnable (waiting for one).
    """
    import os
    import subprocess
    import sys

    if not hasattr(os, "sched_setaffinity") or pauses.SchedStat().read() is None:
        pytest.skip("needs Linux's per-thread affinity and /proc/thread-self/schedstat")
    core = min(os.sched_getaffinity(0))
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    holds = pauses.Holds(event_cost=0.0)
    holds.recording = True

    def run() -> None:
        os.sched_setaffinity(0, {core})  # this thread only
        sys.setprofile(holds.profile)
        try:
            time.sleep(0)
            deadline = time.perf_counter() + 0.05
            while time.perf_counter() < deadline:  # 50 ms of Python, sharing the core with the busy process
                pass
            time.sleep(0)
        finally:
            sys.setprofile(None)

    try:
        os.sched_setaffinity(busy.pid, {core})
        time.sleep(0.2)  # the busy process is on the core
        thread = threading.Thread(target=run, name="ddp_strategy-test")
        thread.start()
        thread.join()
    finally:
        busy.kill()
        busy.wait()
    longest = holds.longest_by_wall
    assert longest["wall_s"] >= 0.05
    assert 0.005 < longest["runnable_s"] < longest["wall_s"]  # shared the core: runnable a good part of the time
    assert 0.005 < longest["on_core_s"] < longest["wall_s"] - longest["runnable_s"] + 0.002
    assert holds.over_1ms_wall >= 1 and holds.over_1ms_on_core >= 1


def test_the_schedulers_counts_of_a_thread_grow_with_its_work():
    counts = pauses.SchedStat()
    before = counts.read()
    if before is None:
        pytest.skip("no /proc/thread-self/schedstat here")
    deadline = time.thread_time() + 0.02
    while time.thread_time() < deadline:
        pass
    on_core, runnable = counts.read()
    assert on_core - before[0] >= 15_000_000  # 20 ms of this thread's CPU, in ns
    assert runnable >= before[1]


def test_beats_are_counted_by_the_thread_that_ran_them_and_only_in_training():
    """The heartbeat's beats (``Heartbeat._beat_once``, wrapped): which thread ran each, only inside the window."""
    beats = pauses.Beats()
    runs: list[str] = []

    def beat_once(heartbeat: object, store: object) -> bool:
        runs.append(threading.current_thread().name)
        return True

    timed = beats.wrap(beat_once)
    assert timed(None, None) is True and beats.calls == []  # before the training window: not counted
    beats.training = True
    timed(None, None)
    thread = threading.Thread(target=timed, args=(None, None), name="ddp_strategy-heartbeat-rank0")
    thread.start()
    thread.join()
    timed(None, None)
    summary = beats.summary()
    assert runs == ["MainThread", "MainThread", "ddp_strategy-heartbeat-rank0", "MainThread"]
    assert {name: row["count"] for name, row in summary.items()} == {"MainThread": 2, "ddp_strategy-heartbeat-rank0": 1}


def test_a_timed_call_counts_its_page_faults_and_a_garbage_collection_it_ran():
    """What a call's CPU held: fresh memory touched (page faults), a collection on its thread; the report names both."""
    collections = pauses.Collections()
    beats = pauses.Beats(collections.on_this_thread)
    beats.training = True

    def beat_once(heartbeat: object, store: object) -> bool:
        memory = bytearray(32 << 20)  # 32 MB taken anew from the kernel and zeroed: thousands of minor faults
        gc.collect()
        deadline = time.thread_time() + 0.002
        while time.thread_time() < deadline:  # over 1 ms of CPU
            pass
        return len(memory) > 0

    def plain(heartbeat: object, store: object) -> bool:
        return True

    gc.callbacks.append(collections.callback)
    try:
        beats.wrap(beat_once)(None, None)
        beats.wrap(plain, "step dump")(None, None)
    finally:
        gc.callbacks.remove(collections.callback)
    costly, cheap = beats.calls
    assert costly["minor_faults"] > 1000 and costly["gc"] == 1 and costly["cpu_s"] > 0.002
    assert cheap["minor_faults"] < 100 and cheap["gc"] == 0
    row = {
        "dumps": {"all": [], "training_thread_over_1ms_cpu": [], "longest_training_thread_cpu": None},
        "beats": beats.summary(),
        "step_dumps": beats.summary("step dump"),
    }
    text = pauses._training_thread_usage(row)
    over, longest = text.split(". ", 1)
    assert over.startswith("over 1 ms: beat ") and "a garbage collection" in over
    assert f"{costly['minor_faults']} faults" in over
    assert longest.startswith("longest beat ") and "; longest audit's dump " in longest
