"""bench/callback_turns.py: the variants' callback lists, the paired analysis, and a smoke run's report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.proc import load_bench, run_script

BENCH = Path(__file__).resolve().parents[1] / "bench"

turns = load_bench("bench_callback_turns", BENCH / "callback_turns.py")


def test_the_added_callbacks_are_passed_over_in_every_hook_of_a_step():
    callback = turns.SkippedHooks()
    assert all(getattr(callback, hook) is None for hook in turns.STEP_HOOKS)  # Lightning's callable() test fails


def test_paired_differences_per_step_and_per_turn():
    measured = {
        "per_round_s": {
            "stock": [10e-6, 12e-6, 11e-6],
            "safe": [12.4e-6, 14.0e-6, 13.6e-6],  # +2.4, +2.0, +2.6 us
            "merged": [10.6e-6, 12.8e-6, 11.5e-6],  # +0.6, +0.8, +0.5 us
        },
        "callbacks": {"stock": 0, "safe": 3, "merged": 1},
        "default_callbacks": [],
    }
    a = turns.analyse(measured)
    assert a["median_us"]["stock"] == pytest.approx(11.0)
    assert a["added_us"]["safe"] == pytest.approx({"median": 2.4, "min": 2.0, "max": 2.6})
    assert a["added_us"]["merged"] == pytest.approx({"median": 0.6, "min": 0.5, "max": 0.8})
    assert a["per_turn_us"] == pytest.approx(2.4 / 18)  # 3 callbacks x 6 hooks
    assert a["merge_saves_us"] == pytest.approx(1.8)


@pytest.mark.timeout(180)
def test_a_quick_run_writes_its_report(tmp_path):
    out = tmp_path / "turns"
    run = run_script([str(BENCH / "callback_turns.py"), "--quick", "--out", str(out)], timeout=150)
    assert run.returncode == 0, run.describe()
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["measured"]["callbacks"] == {"stock": 0, "safe": 3, "merged": 1}
    assert all(len(v) == 3 for v in result["measured"]["per_round_s"].values())
    text = out.with_suffix(".md").read_text()
    assert "| safe | 3 |" in text and "Merging the strategy's 3 callbacks into one would save" in text
