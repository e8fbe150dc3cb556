"""bench/recorder_dump_cost.py: a short run of the real workers, and its table from their rows."""

from __future__ import annotations

import json
from pathlib import Path

from tests.proc import load_bench

BENCH = Path(__file__).resolve().parents[1] / "bench"
cost = load_bench("bench_recorder_dump_cost", BENCH / "recorder_dump_cost.py")


def test_a_short_run_dumps_each_ring_full_and_writes_its_table(tmp_path, monkeypatch):
    argv = ["recorder_dump_cost.py", "--entries", "4", "8", "--dumps", "3", "--evict-mb", "1"]
    monkeypatch.setattr("sys.argv", [*argv, "--results-dir", str(tmp_path), "--name", "short"])
    cost.main()
    result = json.loads((tmp_path / "short.json").read_text())
    assert [row["entries"] for row in result["rows"]] == [4, 8]
    for row in result["rows"]:
        assert row["entries_dumped"] == row["entries"]  # the ring is full: each dump holds the ring's size
        for kind in ("with_stacks", "without_stacks"):
            times = row[kind]
            assert 0 < times["median_s"] <= times["p99_s"] <= times["max_s"] < 1.0
        assert row["pickle_bytes"] > 0 and row["unpickle_s"] > 0
    table = (tmp_path / "short.md").read_text()
    assert "| 4 | 4 | " in table and "| 8 | 8 | " in table
