"""A run of SafeDDPStrategy leaves the process as stock Lightning's DDPStrategy does (issue 29, point 4): the same
environment variables, signal handlers, logging and torch settings after fit, validate and test, and none of the
strategy's threads."""

from __future__ import annotations

import json
import signal

import pytest

from tests.proc import SCRIPTS, run_script


def changes(before: dict, after: dict) -> dict:
    """What differs between two snapshots: per section, ``{name: (before, after)}``."""
    diff: dict = {}
    for section in ("env", "signals", "logging", "torch"):
        a, b = before[section], after[section]
        changed = {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}
        if changed:
            diff[section] = changed
    if before["switch_interval"] != after["switch_interval"]:
        diff["switch_interval"] = (before["switch_interval"], after["switch_interval"])
    return diff


def run(tmp_path, strategy: str) -> dict[int, dict]:
    out = tmp_path / strategy
    result = run_script([str(SCRIPTS / "side_effects.py"), "--strategy", strategy, "--out", str(out)], timeout=180)
    # Stock Lightning's rank 0 sometimes aborts at interpreter exit, after the snapshots were written (1 run in 4
    # here: "terminate called without an active exception"; the cause: tests/proc.py stock_fit_finished).
    # SafeDDPStrategy must exit 0.
    aborted_at_exit = result.returncode == -signal.SIGABRT and "terminate called without an active exception" in (
        result.output
    )
    ok = result.returncode == 0 or (strategy == "ddp" and aborted_at_exit)
    assert ok and not result.orphans, result.describe()
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)}


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_a_run_leaves_the_environment_signals_and_settings_as_stock_does(tmp_path):
    stock, safe = run(tmp_path, "ddp"), run(tmp_path, "safe_ddp")
    for rank in (0, 1):
        stock_changes = changes(stock[rank]["before"], stock[rank]["after"])
        safe_changes = changes(safe[rank]["before"], safe[rank]["after"])
        # Lightning's own variables (MASTER_ADDR, ... on rank 0, where the launcher sets them) differ alike; the
        # Flight Recorder's size (TORCH_FR_BUFFER_SIZE, which desync detection needs) is gone once the default
        # process group exists
        # names only for the environment: MASTER_PORT is a free port picked per run
        assert sorted(safe_changes.pop("env", {})) == sorted(stock_changes.pop("env", {})), f"rank {rank}"
        assert safe_changes == stock_changes, f"rank {rank}"
        assert "TORCH_FR_BUFFER_SIZE" not in safe[rank]["after"]["env"]
        assert safe[rank]["after"]["threads"] == [], f"rank {rank}: the strategy's threads outlive the run"
    assert "signals" not in changes(safe[0]["before"], safe[0]["after"])
