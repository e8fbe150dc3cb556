"""bench/strategy_cost.py's control: a pass-through strategy timed as the strategy is, and its table of differences."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch.strategies import DDPStrategy

from ddp_strategy import SafeDDPStrategy
from tests.proc import load_bench

BENCH = Path(__file__).resolve().parents[1] / "bench"

cost = load_bench("bench_strategy_cost", BENCH / "strategy_cost.py")


def row(workload: str, methods: dict[str, float], value: float | None) -> dict[str, Any]:
    """A workload row as strategy_cost.py writes it (us given, seconds stored)."""
    return {
        "workload": workload,
        "own_per_method_s": {k: v * 1e-6 for k, v in methods.items()},
        "per_sync_dist_value_s": None if value is None else {"median": value * 1e-6},
    }


def test_the_control_overrides_only_methods_the_strategy_overrides_and_each_calls_through():
    mine = {k for k, v in vars(cost.PassThroughDDPStrategy).items() if callable(v) and not k.startswith("__")}
    assert mine == {"on_train_batch_start", "post_backward", "optimizer_step", "reduce"}
    assert mine <= set(vars(SafeDDPStrategy))  # the same keys in both fits' figures
    assert all(callable(getattr(DDPStrategy, name, None)) for name in mine)  # super() reaches Lightning's code


def test_timing_the_control_wraps_its_methods_and_lightnings_and_undoing_restores_them():
    mine, lightnings = vars(cost.PassThroughDDPStrategy)["optimizer_step"], vars(DDPStrategy)["optimizer_step"]
    strategys = vars(SafeDDPStrategy)["optimizer_step"]
    restore = cost.instrument_strategy(cost.Counters(), cost.PassThroughDDPStrategy)
    try:
        assert vars(cost.PassThroughDDPStrategy)["optimizer_step"].__wrapped__ is mine
        assert vars(DDPStrategy)["optimizer_step"].__wrapped__ is lightnings  # what super() reaches: not counted
        assert vars(SafeDDPStrategy)["optimizer_step"] is strategys  # the strategy itself untouched
    finally:
        restore()
    assert vars(cost.PassThroughDDPStrategy)["optimizer_step"] is mine
    assert vars(DDPStrategy)["optimizer_step"] is lightnings


def test_the_control_table_gives_each_key_the_strategys_figure_the_controls_and_their_difference():
    result = {
        "workloads": [row("tiny", {"reduce": 29.3, "on_train_batch_start": 23.8, "ShardingCheck.x": 1.0}, 38.0)],
        "control_workloads": [row("tiny", {"reduce": 13.1, "on_train_batch_start": 3.9, "Reference.y": 9.0}, 20.4)],
    }
    lines = cost.render_control(result)
    assert "| tiny | `reduce` | 29.3 | 13.1 | 16.2 |" in lines
    assert "| tiny | `on_train_batch_start` | 23.8 | 3.9 | 19.9 |" in lines
    assert "| tiny | per `sync_dist` value | 38.0 | 20.4 | 17.6 |" in lines
    assert not any("Reference" in line for line in lines)  # the no-hook callback is in neither total
    assert cost.render_control({"workloads": result["workloads"]}) == []  # no control fit: no section
