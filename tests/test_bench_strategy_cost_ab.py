"""bench/strategy_cost_ab.py: the paired ratios it reports come from each round's two runs."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def load() -> Any:
    spec = importlib.util.spec_from_file_location("strategy_cost_ab", ROOT / "bench" / "strategy_cost_ab.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["strategy_cost_ab"] = module
    spec.loader.exec_module(module)
    return module


def workload(name: str, own: float, methods: list[float], threads: dict[str, float]) -> dict[str, Any]:
    """A workload row as strategy_cost.py writes it (seconds per step)."""
    return {
        "workload": name,
        "own_cpu_per_step_s": own * 1e-6,
        "own_per_method_s": {f"m{i}": m * 1e-6 for i, m in enumerate(methods)},
        "threads_cpu_per_step_s": {k: v * 1e-6 for k, v in threads.items()},
        "step_cpu_median_s": 0.1,
        "idle_thread_per_step_s": 2e-6,
    }


def test_figures_split_the_own_cpu_into_the_training_thread_and_the_strategys_python_threads():
    ab = load()
    row = workload("mlp", 400, [100, 80], {"ddp_strategy-pulse-rank0": 70, "ddp_strategy-heartbeat-rank0": 130, "x": 5})
    f = ab.figures(row)
    assert round(f["own"], 6) == 400 and round(f["training thread"], 6) == 180
    assert round(f["Python threads"], 6) == 200  # only the strategy's threads (by name), not "x"
    assert set(f["threads"]) == {"ddp_strategy-pulse-rank0", "ddp_strategy-heartbeat-rank0"}


def test_the_ratios_pair_each_rounds_runs_and_the_table_shows_them():
    ab = load()

    def side(own: float, train: float, threads: float) -> dict[str, Any]:
        return {"mlp": ab.figures(workload("mlp", own, [train], {"ddp_strategy-heartbeat-rank0": threads}))}

    runs = [
        {"base": side(400, 200, 200), "head": side(300, 200, 100)},
        {"base": side(800, 400, 400), "head": side(400, 200, 200)},
        {"base": side(500, 250, 250), "head": side(450, 250, 200)},
    ]
    analysis = ab.analyse(runs, ["mlp"])
    threads = analysis["mlp"]["Python threads"]
    assert [round(r, 3) for r in threads["ratios"]] == [0.5, 0.5, 0.8]
    assert round(threads["median"], 3) == 0.5 and [round(x, 3) for x in threads["range"]] == [0.5, 0.8]
    assert [round(r, 3) for r in analysis["mlp"]["own"]["ratios"]] == [0.75, 0.5, 0.9]
    result = {
        "base": "a" * 40,
        "head": "b" * 40,
        "dirty": False,
        "steps": 300,
        "runs": runs,
        "analysis": analysis,
        "machine": {"platform": "p", "torch": "t", "lightning": "l"},
        "date": "d",
    }
    text = "\n".join(ab.render(result))
    assert "| mlp | Python threads | 200.0, 400.0, 250.0 | 100.0, 200.0, 200.0 | 0.500 [0.500, 0.800] |" in text
    assert "base aaaaaaaaaaaa and of this checkout bbbbbbbbbbbb, alternating, 3 round(s)" in text


def test_the_rounds_alternate_which_commit_runs_first():
    # a drift of the machine within a round would otherwise always count against the same side
    ab = load()
    assert [ab.sides(i) for i in range(3)] == [("base", "head"), ("head", "base"), ("base", "head")]
