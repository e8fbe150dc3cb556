"""bench/trainable_test.py: its models, the reference test it times the package's against, and its analysis."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.proc import load_bench

BENCH = Path(__file__).resolve().parents[1] / "bench"

trainable_test = load_bench("bench_trainable_test", BENCH / "trainable_test.py")


def test_the_models_have_the_parameter_tensors_the_report_names():
    assert len(list(trainable_test.network(0).parameters())) == 4  # the tiny model
    assert len(list(trainable_test.network(80).parameters())) == 164  # input, 80 hidden and output layers


def test_the_reference_test_tells_a_change_in_either_direction():
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
    params[2].requires_grad_(False)
    test = trainable_test.python_reads(params, [True, True, False])
    assert not test()
    params[2].requires_grad_(True)
    assert test()
    params[2].requires_grad_(False)
    params[0].requires_grad_(False)
    assert test()


def test_medians_first_in_step_and_over_all_steps_and_the_ratio():
    fit = {
        "tensors": 164,
        "trainable": 2,
        "times": {  # (ns, came first in its step)
            "package": [(10_000, True), (2_000, False), (4_000, False)],
            "python_reads": [(40_000, True), (20_000, True), (8_000, False)],
            "empty": [(1_000, True), (500, False), (600, False)],
        },
    }
    row = trainable_test.analyse(fit)
    assert row["calls"]["package"] == {"first_us": 10.0, "all_us": 4.0, "steps": 3}
    assert row["calls"]["python_reads"] == {"first_us": 30.0, "all_us": 20.0, "steps": 3}
    assert row["package_over_python_reads"] == 0.2 and row["package_over_python_reads_first"] == 10.0 / 30.0
    lines = trainable_test.render(
        {
            "date": "d",
            "steps": 3,
            "warmup": 50,
            "machine": {"platform": "p", "torch": "t", "lightning": "l"},
            "models": {"deep_frozen": row},
        }
    )
    assert "| deep_frozen | 164 (2) | 10.00 | 30.00 | 1.00 | 4.00 | 20.00 | 0.200 |" in lines
