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


def test_each_variant_runs_with_its_recorder_setting():
    from ddp_strategy.collective_record import TRACE_ENTRIES

    assert instructions.variant_environment("stock") == {}
    assert instructions.variant_environment("safe") == {}
    assert instructions.variant_environment("stock_recorder") == {"TORCH_FR_BUFFER_SIZE": str(TRACE_ENTRIES)}
    assert instructions.variant_environment("safe_no_recorder") == {"TORCH_FR_BUFFER_SIZE": "0"}
    with pytest.raises(ValueError, match="unknown variant 'safe_bare'; choose from stock, stock_recorder, safe"):
        instructions.variant_environment("safe_bare")


#: lines as ``callgrind_annotate --inclusive=yes`` prints them (names shortened): the recorder's entry point calls
#: the stack capture, whose count is inside the entry point's
ANNOTATION = """\
--------------------------------------------------------------------------------
Ir
--------------------------------------------------------------------------------
403,764,446 (100.0%)  PROGRAM TOTALS

--------------------------------------------------------------------------------
Ir                   file:function
--------------------------------------------------------------------------------
60,660,042 (15.02%)  Python/ceval.c:_PyEval_EvalFrameDefault'2 [/lib/libpython3.11.so.1.0]
 2,008,002 ( 0.50%)  ???:c10d::FlightRecorder<c10::Event>::recordWithResetEnabled(unsigned long, std::tuple<std::\
string, std::string> const&, bool) [/torch/lib/libtorch_cpu.so]
 1,612,727 ( 0.40%)  ???:torch::CapturedTraceback::gather(bool, bool, bool) [/torch/lib/libtorch_cpu.so]
    12,000 ( 0.00%)  ???:c10d::FlightRecorder<c10::Event>::record(unsigned long) [/torch/lib/libtorch_cpu.so]
"""


def test_the_recorders_instructions_are_its_outermost_record_call(monkeypatch, tmp_path):
    calls = []

    def annotate(command, **kwargs):
        calls.append(command)
        return type("Done", (), {"stdout": ANNOTATION})()

    monkeypatch.setattr(instructions.shutil, "which", lambda tool: f"/usr/bin/{tool}")
    monkeypatch.setattr(instructions.subprocess, "run", annotate)
    assert instructions.recorder_instructions(tmp_path / "safe-nolog-0.1-01") == 2_008_002
    command = ["callgrind_annotate", "--inclusive=yes", "--threshold=100", "--show=Ir"]  # Ir only, with --cache-sim too
    assert calls == [[*command, str(tmp_path / "safe-nolog-0.1-01")]]
    # a thread that recorded nothing, and a machine without the annotation tool
    monkeypatch.setattr(instructions.subprocess, "run", lambda *a, **k: type("Done", (), {"stdout": "Ir\n"})())
    assert instructions.recorder_instructions(tmp_path / "x-01") == 0
    monkeypatch.setattr(instructions.shutil, "which", lambda tool: None)
    assert instructions.recorder_instructions(tmp_path / "x-01") is None


def split_fit(training: float, recorder: float) -> dict[str, float]:
    return {
        "training": training,
        "recorder": recorder,
        "training_less_recorder": training - recorder,
        "other_threads": 100_000,
        "window_s": 7.0,
    }


def test_every_variant_is_paired_with_stock_on_each_part_of_the_training_thread():
    fits = {
        "stock-nolog": [split_fit(4_010_000, 0), split_fit(4_006_000, 0), split_fit(4_011_000, 0)],
        "stock_recorder-nolog": [split_fit(4_030_000, 20_000)] * 3,
        "safe-nolog": [split_fit(4_038_000, 20_100), split_fit(4_042_000, 20_000), split_fit(4_035_000, 20_200)],
        "safe_no_recorder-nolog": [split_fit(4_012_000, 0)] * 3,
    }
    modes = instructions.analyse(fits)
    nolog = modes["nolog"]
    assert list(nolog) == ["training", "recorder", "training_less_recorder", "other_threads"]
    assert nolog["training"]["vs_stock"] == {"stock_recorder": 20_000, "safe": 28_000, "safe_no_recorder": 2_000}
    assert nolog["training"]["added"] == 28_000  # safe against stock, as in the two-variant runs
    assert nolog["recorder"]["vs_stock"]["safe"] == 20_100
    assert nolog["training_less_recorder"]["vs_stock"]["safe"] == pytest.approx(7_900)  # medians of the rest
    lines = instructions.render(
        {"steps": 100, "warmup": 40, "seeds": [0, 1, 2], "modes": modes, "fits": fits, "date": "d",
         "machine": {"platform": "p", "torch": "t", "lightning": "l"}}
    )  # fmt: skip
    header = (
        "| mode | threads | stock `DDPStrategy()` | stock, strategy's ring | `SafeDDPStrategy()` | "
        "safe, recorder off | added by stock, strategy's ring | stock_recorder/stock | "
        "added by `SafeDDPStrategy()` | safe/stock | added by safe, recorder off | safe_no_recorder/stock |"
    )
    assert header in lines
    assert (
        "| nolog | of it, the rest | 4,010.0k [4,006.0k - 4,011.0k] | 4,010.0k [4,010.0k - 4,010.0k] | "
        "4,017.9k [4,014.8k - 4,022.0k] | 4,012.0k [4,012.0k - 4,012.0k] | +0.0k | 1.0000 | +7.9k | 1.0020 | "
        "+2.0k | 1.0005 |"
    ) in lines
    assert "split into the recorder's `record` calls" in lines[0]
    assert "`TORCH_FR_BUFFER_SIZE=0`" in lines[0]
    assert "torch's default size, 2000 entries" in lines[0]


def test_a_mode_without_stock_fits_is_refused():
    with pytest.raises(ValueError, match="mode 'nolog' has no stock fits to compare with"):
        instructions.analyse({"safe-nolog": [split_fit(1, 0)]})


def test_the_cache_simulations_misses_are_read_per_kind_and_reported_as_misses(tmp_path):
    """``--cache-sim``: a thread file's I1/D1 and LL miss totals, summed per kind; a file without them gives none."""
    simulated = tmp_path / "safe-nolog-0.1-01"
    simulated.write_text(
        "events: Ir Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw\nsummary: 0\ntotals: 4000000 900 800 30 20 10 3 2 1\n"
    )
    assert instructions.thread_misses(simulated) == {"l1_misses": 60, "ll_misses": 6}
    plain = tmp_path / "safe-nolog-0.1-02"
    plain.write_text("events: Ir\nsummary: 0\ntotals: 4000000\n")
    assert instructions.thread_misses(plain) == {}
    assert instructions.thread_totals(tmp_path / "safe-nolog-0") == {1: 4_000_000, 2: 4_000_000}  # Ir: the first

    def fit(training: float, l1: float, ll: float) -> dict[str, float]:
        return {"training": training, "other_threads": 0.0, "window_s": 1.0, "l1_misses": l1, "ll_misses": ll}

    modes = instructions.analyse(
        {"stock-nolog": [fit(4e6, 9_000, 300)] * 3, "safe-nolog": [fit(4.03e6, 9_600, 420)] * 3}
    )
    assert modes["nolog"]["ll_misses"]["added"] == pytest.approx(120)
    fits = {"stock-nolog": [fit(4e6, 9_000, 300)], "safe-nolog": [fit(4.03e6, 9_600, 420)]}
    lines = instructions.render(
        {"steps": 100, "warmup": 40, "seeds": [0, 1, 2], "modes": modes, "fits": fits, "date": "d",
         "machine": {"platform": "p", "torch": "t", "lightning": "l"}}
    )  # fmt: skip
    assert "rows of cache misses count the training thread's simulated misses per step" in lines[0]
    row = "| nolog | training thread's last-level cache misses (simulated) | 0.3k [0.3k - 0.3k] | 0.4k [0.4k - 0.4k] |"
    assert any(line.startswith(row) for line in lines), lines
