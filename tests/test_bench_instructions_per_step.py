"""bench/instructions_per_step.py: callgrind's per-thread files read, medians over seeds, the skip without tools."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.proc import load_bench

BENCH = Path(__file__).resolve().parents[1] / "bench"

instructions = load_bench("bench_instructions_per_step", BENCH / "instructions_per_step.py")


def test_thread_totals_read_every_thread_file_of_the_run(tmp_path):
    for thread, total in ((1, 4_000_000), (2, 0), (5, 150_000)):
        (tmp_path / f"safe-nolog-0.4242-{thread:02d}").write_text(f"events: Ir\nsummary: 0\ntotals: {total}\n")
    (tmp_path / "safe-nolog-1.99-01").write_text("totals: 7\n")  # another seed's run: not this prefix
    assert instructions.thread_totals(tmp_path / "safe-nolog-0") == {1: 4_000_000, 2: 0, 5: 150_000}


def test_thread_totals_name_an_unfinished_file_and_a_run_outside_callgrind(tmp_path):
    (tmp_path / "stock-nolog-0.7-01").write_text("events: Ir\n")  # killed before callgrind wrote its totals
    with pytest.raises(RuntimeError, match=r"stock-nolog-0\.7-01 has no 'totals:' line"):
        instructions.thread_totals(tmp_path / "stock-nolog-0")
    with pytest.raises(RuntimeError, match="no callgrind file for thread 1"):
        instructions.thread_totals(tmp_path / "safe-nolog-0")


def fits_of(stock: list[float], safe: list[float]) -> list[list[dict[str, float]]]:
    return [
        [{"training": t, "other_threads": t / 100, "window_s": t / 1e5} for t in values] for values in (stock, safe)
    ]


def test_medians_over_seeds_and_what_safe_adds():
    fits = {}
    for mode, (stock, safe) in {
        "nolog": ([4_010_000, 4_002_000, 4_030_000], [4_050_000, 4_041_000, 4_080_000]),
        "sync_dist": ([5_000_000], [5_000_000]),
    }.items():
        fits[f"stock-{mode}"], fits[f"safe-{mode}"] = fits_of(stock, safe)
    modes = instructions.analyse(fits)
    training = modes["nolog"]["training"]
    assert training["stock"] == {"median": 4_010_000, "min": 4_002_000, "max": 4_030_000}
    assert training["safe"]["median"] == 4_050_000
    assert training["added"] == 40_000  # medians' difference, not the mean's
    assert training["ratio"] == pytest.approx(4_050_000 / 4_010_000)
    assert modes["nolog"]["other_threads"]["added"] == pytest.approx(400)
    assert modes["sync_dist"]["training"]["added"] == 0
    lines = instructions.render(
        {
            "steps": 100,
            "warmup": 40,
            "seeds": [0, 1, 2],
            "modes": modes,
            "fits": fits,
            "date": "d",
            "machine": {"platform": "p", "torch": "t", "lightning": "l"},
        }
    )
    row = "| nolog | training thread | 4,010.0k [4,002.0k - 4,030.0k] | 4,050.0k [4,041.0k - 4,080.0k] | +40.0k |"
    assert row + " 1.0100 |" in lines
    assert "once per `PYTHONHASHSEED` in 0, 1, 2" in lines[0]
    assert "a window lasted 40 to 50 s" in lines[0]  # the fits' shortest and longest window


def test_without_valgrind_it_names_what_is_missing_and_writes_nothing(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(instructions.shutil, "which", lambda tool: None if tool == "valgrind" else f"/usr/bin/{tool}")
    monkeypatch.setattr(instructions, "HEADER", tmp_path / "callgrind.h")
    assert instructions.missing_tools() == ["valgrind", f"{tmp_path / 'callgrind.h'} (valgrind's development header)"]
    monkeypatch.setattr("sys.argv", ["instructions_per_step.py", "--results-dir", str(tmp_path / "out")])
    instructions.main()
    assert capsys.readouterr().out.startswith("skipped: this benchmark needs valgrind, ")
    assert not (tmp_path / "out").exists()
