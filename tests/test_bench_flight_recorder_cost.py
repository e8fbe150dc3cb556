"""bench/flight_recorder_cost.py's analysis: the recorder's cost per call is paired per round (figures fabricated)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.proc import load_bench

fr = load_bench("bench_flight_recorder_cost", Path(__file__).resolve().parents[1] / "bench" / "flight_recorder_cost.py")


def test_the_recorders_cost_is_the_paired_difference_per_round():
    # the machine's speed moves from round to round; the recorder adds 5 us in each
    rounds = [{"off": base, "on": base + 5e-6} for base in (30e-6, 40e-6, 35e-6)]
    analysis = fr.analyse(rounds)
    assert analysis["added_per_call_s"] == pytest.approx({"median": 5e-6, "min": 5e-6, "max": 5e-6})
    assert analysis["per_setting_s"]["off"] == pytest.approx({"median": 35e-6, "min": 30e-6, "max": 40e-6})


def test_the_worker_reports_the_cpu_per_all_reduce_of_a_one_rank_group():
    """A short run of the real worker in a fresh process (the recorder off): a positive time per call."""
    import argparse

    args = argparse.Namespace(calls=50, warmup=5, depth=3)
    assert 0 < fr.run_one("off", args, entries=32) < 0.1
