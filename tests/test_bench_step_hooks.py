"""bench/step_hooks.py: the timer it puts around a strategy method, and its analysis of fabricated timings."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.proc import load_bench

BENCH = Path(__file__).resolve().parents[1] / "bench"

hooks = load_bench("bench_step_hooks", BENCH / "step_hooks.py")


def test_the_timer_records_every_call_and_passes_results_and_errors_through():
    record: list[int] = []
    double = hooks.timed(lambda x: 2 * x, record)
    assert double(3) == 6 and len(record) == 1 and record[0] >= 0

    def fail() -> None:
        raise ValueError("boom")

    failing = hooks.timed(fail, record)
    with pytest.raises(ValueError, match="boom"):
        failing()
    assert len(record) == 2  # timed even when it raised


def fit(start: list[int], post: list[int], step: list[int], closure: list[int]) -> dict[str, list[int]]:
    return {"on_train_batch_start": start, "post_backward": post, "optimizer_step": step, "closure": closure}


def test_per_call_medians_take_the_closure_off_each_optimizer_step_and_safe_less_stock_is_paired_by_round():
    rounds = [
        {
            "stock": fit([1000, 2000, 3000], [3000] * 3, [110_000, 120_000, 500_000], [100_000, 100_000, 480_000]),
            "safe": fit([20_000, 22_000, 30_000], [6000] * 3, [112_000, 125_000, 130_000], [100_000, 100_000, 100_000]),
        },
        {
            "stock": fit([1000] * 3, [3000] * 3, [120_000] * 3, [100_000] * 3),
            "safe": fit([10_000] * 3, [5000] * 3, [130_000] * 3, [100_000] * 3),
        },
    ]
    assert hooks.per_call(rounds[0]["stock"]) == {
        "on_train_batch_start": 2.0,
        "post_backward": 3.0,
        "optimizer_step less its closure": 20.0,  # call by call: 10, 20, 20 us
    }
    parts = hooks.analyse(rounds)["parts"]
    assert parts["on_train_batch_start"] == {
        "stock_us": 1.5,
        "safe_us": 16.0,
        "added_us": 14.5,  # 20.0 and 9.0 added, paired by round
        "added_range_us": [9.0, 20.0],
    }
    assert parts["all three"]["added_us"] == 0.5 * ((22 + 6 + 25 - 2 - 3 - 20) + (10 + 5 + 30 - 1 - 3 - 20))
    lines = hooks.render(
        {
            "date": "d",
            "steps": 3,
            "warmup": 50,
            "machine": {"platform": "p", "torch": "t", "lightning": "l"},
            "analysis": hooks.analyse(rounds),
        }
    )
    assert "| on_train_batch_start | 1.50 | 16.00 | +14.50 [+9.00, +20.00] |" in lines
