"""The step-pauses benchmark's stretch accounting (bench/step_pauses.py): a garbage collection marks its stretch.

No timing is asserted: which stretch ran a collection is counted, not how long it took.
"""

from __future__ import annotations

import gc
import threading
import time
from pathlib import Path

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
    assert holds.longest_without_collection["from"] in ("thread start", "test_bench_step_pauses.py:32")
    collected = [s for s in (holds.longest, holds.longest_without_collection) if s["garbage_collection"]]
    assert all(s["from"] == "test_bench_step_pauses.py:34" for s in collected)
    assert collections.on_this_thread() == 0  # the collection ran on the other thread
    assert holds.longest["wall_s"] >= 0.0 and holds.longest["thread"] == "ddp_strategy-test"
