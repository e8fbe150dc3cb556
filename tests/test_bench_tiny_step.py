"""The tiny-model step benchmark's harness logic (bench/tiny_step.py): the plan of chunks, the ratios and the target.

No timing is asserted: the fits' figures are fabricated.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.proc import load_bench

BENCH = Path(__file__).resolve().parents[1] / "bench"


tiny = load_bench("bench_tiny_step", BENCH / "tiny_step.py")


def test_chunks_cover_the_steps_and_time_all_but_the_first_step_of_each():
    config = tiny.config_for(quick=False, rounds=None)
    assert config["rounds"] >= 10
    steps = tiny.total_steps(config)
    starts = tiny.chunk_starts(config)
    assert starts[0] == 0 and starts[1] == config["warmup"] and starts[-1] == steps - 1  # the closing step
    assert len(starts) == config["chunks"] + 2
    timed = [s for s in range(steps) if tiny.is_timed(s, config)]
    assert len(timed) == config["chunks"] * (config["chunk"] - 1)
    assert not set(timed) & set(starts)  # a chunk's first step (the ranks resuming) is never timed
    assert min(timed) == config["warmup"] + 1 and max(timed) == steps - 2


def test_groups_alternate_the_modes_and_shuffle_every_pass_seeded():
    config = tiny.config_for(quick=False, rounds=None)
    groups = tiny.groups(config)
    assert len(groups) == 2 * config["rounds"]
    assert [g["mode"] for g in groups[:4]] == ["nolog", "sync_dist", "sync_dist", "nolog"]
    for group in groups:
        assert len(group["orders"]) == config["chunks"] + 2  # warm-up, timed chunks, closing step
        assert all(sorted(order) == sorted(tiny.VARIANTS) for order in group["orders"])
        assert len({tuple(order) for order in group["orders"]}) > 1
    assert groups == tiny.groups(config)  # the same seed, the same orders


def test_fit_figures_use_the_timed_steps_only():
    config = {"warmup": 2, "chunks": 2, "chunk": 3}
    # (index, wall, thread CPU, process CPU); steps 0-1 warm-up, 2-4 and 5-7 the chunks, 2 and 5 untimed
    steps = [(i, 1.0, 1.0, 1.0) for i in (0, 1, 2, 5)]
    steps += [(3, 0.002, 0.001, 0.0015), (4, 0.004, 0.001, 0.0025), (6, 0.003, 0.002, 0.002), (7, 0.011, 0.004, 0.01)]
    figures = tiny.fit_figures(sorted(steps), config)
    assert figures["timed_steps"] == 4
    assert figures["step_mean_s"] == pytest.approx(0.005)
    assert figures["step_median_s"] == pytest.approx(0.0035)
    assert figures["cpu_step_s"] == pytest.approx(0.002)
    assert figures["process_cpu_step_s"] == pytest.approx(0.004)
    with pytest.raises(RuntimeError, match="timed steps"):
        tiny.fit_figures(steps[:-1], config)


def fits(safe: tuple[float, float], rounds: int = 10) -> list[dict[str, Any]]:
    """Per round and mode: raw 2 ms, stock 5 ms (CPU 1 ms, 2 ms); safe as (wall, CPU) multiples of stock."""
    out = []
    for r in range(rounds):
        load = 1 + 0.1 * (r % 3)  # the load of a round, seen by its three fits alike
        for mode in tiny.MODES:
            for variant, wall, cpu in (("raw", 0.002, 0.0005), ("stock", 0.005, 0.001), ("safe", 0.005, 0.001)):
                if variant == "safe":
                    wall, cpu = wall * safe[0], cpu * safe[1]
                rank = {
                    "step_mean_s": wall * load,
                    "step_median_s": wall * load * 0.9,
                    "cpu_step_s": cpu,
                    "process_cpu_step_s": 2 * cpu,
                }
                rank1 = {**rank, "step_mean_s": rank["step_mean_s"] * 1.001}
                out.append({"round": r, "mode": mode, "variant": variant, "ranks": [rank, rank1]})
    return out


def full_run(config: dict[str, Any], fits: list[dict[str, Any]]) -> dict[str, Any]:
    """A results record for ``tiny.markdown``: these fits under this configuration, the rest placeholders."""
    return {
        "mode": "full",
        "meta": {
            **dict.fromkeys(("date", "machine", "python", "torch", "lightning", "ddp_strategy", "git"), "-"),
            "wall_seconds": 1.0,
            "loadavg_start": [1.0],
            "loadavg_end": [1.0],
        },
        "config": config,
        "groups": [{"ready_seconds": 1.0, "chunks_seconds": 1.0, "loadavg": [1.0, 1.0]}],
        "fits": fits,
    }


def by(analysis: dict[str, Any], key: str, mode: str, name: str) -> dict[str, Any]:
    (row,) = [r for r in analysis[key] if r["mode"] == mode and r.get("ratio", r.get("target", "")).startswith(name)]
    return row


def test_ratios_of_medians_and_paired_ratios():
    analysis = tiny.analyse({"fits": fits(safe=(1.05, 1.10))})
    row = by(analysis, "ratios", "sync_dist", "safe / stock")
    assert row["step_mean_s"]["of_medians"] == pytest.approx(1.05)
    assert row["step_mean_s"]["paired"]["median"] == pytest.approx(1.05)
    assert row["step_mean_s"]["paired"]["min"] == pytest.approx(1.05)  # the round's load cancels out
    assert row["cpu_step_s"]["of_medians"] == pytest.approx(1.10)
    assert row["cpu_step_s"]["paired_difference_s"]["median"] == pytest.approx(0.0001)  # 1.10 x 1 ms - 1 ms
    assert by(analysis, "ratios", "nolog", "stock / raw")["step_mean_s"]["of_medians"] == pytest.approx(2.5)
    summary = {(r["mode"], r["variant"]): r for r in analysis["rows"]}
    assert summary[("nolog", "stock")]["step_mean_s"] == pytest.approx({"median": 0.0055, "min": 0.005, "max": 0.006})
    assert summary[("nolog", "stock")]["rounds"] == 10


def test_target_is_judged_on_wall_and_separately_on_cpu():
    missed = tiny.analyse({"fits": fits(safe=(1.05, 1.01))})
    for mode in tiny.MODES:
        target = by(missed, "targets", mode, "safe / stock")
        assert target["limit"] == pytest.approx(1.02)
        assert not target["met"] and target["met_by_cpu"]
    met = tiny.analyse({"fits": fits(safe=(1.01, 1.03))})
    target = by(met, "targets", "nolog", "safe / stock")
    assert target["met"] and not target["met_by_cpu"]


def test_report_renders_the_tables():
    result = {
        "mode": "quick",
        "meta": {
            "date": "2026-01-01 00:00",
            "wall_seconds": 100.0,
            "machine": "test machine",
            "python": "3.11",
            "torch": "2",
            "lightning": "2.6.6",
            "ddp_strategy": "0.1.0",
            "git": "commit abc",
            "loadavg_start": [1.0, 1.0, 1.0],
            "loadavg_end": [2.0, 2.0, 2.0],
        },
        "config": {"rounds": 10, "warmup": 30, "chunks": 27, "chunk": 10, "batch_size": 32},
        "groups": [{"ready_seconds": 10.0, "chunks_seconds": 3.0, "loadavg": [1.5, 2.5]}],
        "fits": fits(safe=(1.05, 1.0)),
    }
    text = tiny.markdown(result, tiny.analyse(result))
    assert "| nolog | Lightning DDPStrategy() | 5500 [5000, 6000] |" in text
    assert "| sync_dist | safe / stock <= 1.02 | 1.050 | 1.050 [1.050, 1.050] |" in text
    assert "**missed** | met | 275 [250, 300] | 0 [0, 0] |" in text  # safe's wall added: 5% of 5.0-6.0 ms
    assert "1.50 to 2.50" in text


def test_aa_runs_a_second_stock_fit_instead_of_raw_and_reports_its_ratio_to_stock():
    """``--aa``: the method's own noise, a stock fit against a stock fit of the same round."""
    config = {**tiny.config_for(quick=True, rounds=None), "variants": list(tiny.AA_VARIANTS)}
    assert tiny.variants_of(config) == ("stock_again", "stock", "safe")
    assert all(sorted(order) == sorted(tiny.AA_VARIANTS) for g in tiny.groups(config) for order in g["orders"])
    aa = [dict(f, variant="stock_again") for f in fits(safe=(1.0, 1.0)) if f["variant"] == "raw"]
    stock = {(f["round"], f["mode"]): f for f in fits(safe=(1.0, 1.0)) if f["variant"] == "stock"}
    for fit in aa:  # the second stock fit is 3% slower in odd rounds, 1% faster in even ones
        factor = 1.03 if fit["round"] % 2 else 0.99
        rank = {**stock[(fit["round"], fit["mode"])]["ranks"][0]}
        rank["step_mean_s"] *= factor
        fit["ranks"] = [rank, rank]
    analysis = tiny.analyse({"fits": aa + list(stock.values())})
    row = by(analysis, "ratios", "nolog", "stock_again / stock")["step_mean_s"]
    assert row["paired"] == pytest.approx({"median": 1.01, "min": 0.99, "max": 1.03})
    low, high = row["paired_interval"]
    assert 0.99 <= low <= 1.01 <= high <= 1.03  # the bootstrap interval of the median lies within the rounds' span
    assert not [r for r in analysis["ratios"] if "raw" in r["ratio"]]  # no raw fits: no ratios to them


def test_median_interval_is_seeded_and_narrows_with_more_rounds():
    few = [1.0, 1.1, 0.95, 1.05, 1.02]
    assert tiny.median_interval(few) == tiny.median_interval(few)
    low, high = tiny.median_interval(few)
    many = few * 8
    low8, high8 = tiny.median_interval(many)
    assert min(few) <= low <= high <= max(few) and high8 - low8 < high - low


def test_cpu_added_per_sync_dist_value_is_the_modes_paired_difference_over_the_values_logged():
    """safe adds 0.1 ms of CPU per step in both modes here, plus 4 us per value in sync_dist mode (8 values)."""
    out = []
    for fit in fits(safe=(1.0, 1.1)):
        if fit["variant"] == "safe" and fit["mode"] == "sync_dist":
            rank = {**fit["ranks"][0], "cpu_step_s": fit["ranks"][0]["cpu_step_s"] + 8 * 4e-6}
            fit = {**fit, "ranks": [rank, rank]}
        out.append(fit)
    analysis = tiny.analyse({"fits": out, "config": {"logs": 8}})
    value = analysis["per_sync_dist_value"]
    assert value["logs"] == 8
    assert value["cpu_added_s"] == pytest.approx({"median": 4e-6, "min": 4e-6, "max": 4e-6})
    assert value["interval_s"] == pytest.approx([4e-6, 4e-6])
    assert tiny.analyse({"fits": [f for f in out if f["mode"] == "nolog"]})["per_sync_dist_value"] is None


def test_own_cpu_per_step_adds_the_strategy_threads_cpu_at_the_fits_step_rate_to_the_added_thread_cpu():
    out = []
    for fit in fits(safe=(1.0, 1.1)):  # safe's training thread: 0.1 ms more CPU per step than stock's, both modes
        threads = 0.002 if fit["variant"] == "safe" else None
        ranks = [{**rank, "own_threads_cpu_per_s": threads} for rank in fit["ranks"]]
        out.append({**fit, "ranks": ranks})
    own = tiny.analyse({"fits": out})["own_cpu_per_step"]
    # the threads: 2 ms of CPU a second at safe's 5.0-6.0 ms mean step (the round's load): 10 to 12 us per step
    assert own["nolog"]["own_threads_s"] == pytest.approx({"median": 11e-6, "min": 10e-6, "max": 12e-6})
    assert own["nolog"]["training_thread_added_s"]["median"] == pytest.approx(1e-4)
    assert own["sync_dist"]["total_s"]["median"] == pytest.approx(1e-4 + 11e-6)
    assert tiny.analyse({"fits": fits(safe=(1.0, 1.0))})["own_cpu_per_step"] == {}  # runs before it was measured


def launched_environments(monkeypatch: Any, tmp_path: Path, config: dict[str, Any]) -> dict[str, dict[str, str]]:
    """Per variant of ``config``, the environment its job would be started with (nothing is started)."""
    started: dict[str, dict[str, str]] = {}

    class Popen:
        def __init__(self, cmd: list[str], *, env: dict[str, str], **_: Any) -> None:
            started[cmd[cmd.index("--variant") + 1]] = env

    monkeypatch.setattr(tiny.subprocess, "Popen", Popen)
    monkeypatch.delenv(tiny.RECORDER_SIZE_ENV, raising=False)
    runner = object.__new__(tiny.Runner)
    runner.config, runner.tmp, runner.address = config, tmp_path, "127.0.0.1:1"
    for variant in config["variants"]:
        runner.launch(f"r0/nolog/{variant}", variant, "nolog")
    return started


def test_diagnosis_variants_run_in_one_group_with_their_own_settings_and_ratios(monkeypatch, tmp_path):
    """``--variants``: stock with the strategy's recorder size, safe without background work, in the same rounds."""
    from ddp_strategy.collective_record import TRACE_ENTRIES

    variants = ["stock", "stock_recorder", "safe", "safe_bare"]
    config = {**tiny.config_for(quick=True, rounds=None), "variants": variants}
    assert all(sorted(order) == sorted(variants) for g in tiny.groups(config) for order in g["orders"])
    started = launched_environments(monkeypatch, tmp_path, config)
    assert started["stock_recorder"][tiny.RECORDER_SIZE_ENV] == str(TRACE_ENTRIES)
    assert not [v for v in ("stock", "safe", "safe_bare") if tiny.RECORDER_SIZE_ENV in started[v]]

    base = [f for f in fits(safe=(1.04, 1.0)) if f["variant"] != "raw"]
    extra = []
    for fit in base:  # safe_bare and stock_recorder as fast as stock: safe's 4% is its background work's
        if fit["variant"] == "stock":
            extra += [dict(fit, variant="safe_bare"), dict(fit, variant="stock_recorder")]
    analysis = tiny.analyse({"fits": base + extra})
    assert by(analysis, "ratios", "nolog", "safe / safe_bare")["step_mean_s"]["of_medians"] == pytest.approx(1.04)
    assert by(analysis, "ratios", "nolog", "safe / stock_recorder")["step_mean_s"]["of_medians"] == pytest.approx(1.04)
    assert by(analysis, "ratios", "nolog", "stock_recorder / stock")["step_mean_s"]["of_medians"] == pytest.approx(1.0)
    text = tiny.markdown(full_run({**config, "bare_kwargs": {"desync_detection": False}}, base + extra), analysis)
    assert "the 4 variants' `torchrun` jobs" in text
    assert "The safe_bare variant: `SafeDDPStrategy(**{'desync_detection': False})`." in text
    assert "| nolog | Lightning DDPStrategy(), torch's Flight Recorder at the strategy's size |" in text


def test_thread_sched_counts_read_this_threads_scheduler_counts():
    """Waiting for a core, time slices and both kinds of context switch, from /proc/thread-self: a sleep adds a
    voluntary switch; the counters only grow."""
    import time

    before = tiny.thread_sched_counts()
    time.sleep(0.01)
    after = tiny.thread_sched_counts()
    assert all(isinstance(v, int) and v >= 0 for v in before)
    assert after[2] >= before[2] + 1  # the sleep: at least one voluntary switch
    assert all(b >= a for a, b in zip(before, after, strict=True))


def test_step_breakdown_splits_the_mean_step_into_cpu_waiting_for_a_core_and_asleep_and_pairs_it_with_stock():
    """safe: 5% longer steps, all of it asleep (250-300 us by the round's load), 0.5 more voluntary switches a step."""
    out = []
    for fit in fits(safe=(1.05, 1.0)):
        rank = fit["ranks"][0]
        sched = {
            "runqueue_wait_s": 0.0002,
            "timeslices": 3.0,
            "voluntary_switches": 2.5 if fit["variant"] == "safe" else 2.0,
            "involuntary_switches": 0.1,
        }
        out.append({**fit, "ranks": [{**rank, "sched_per_step": sched}, fit["ranks"][1]]})
    analysis = tiny.analyse({"fits": out})
    rows = {(r["mode"], r["variant"]): r for r in analysis["step_breakdown"]}
    stock, safe = rows[("nolog", "stock")], rows[("nolog", "safe")]
    assert stock["asleep_s"]["median"] == pytest.approx(0.0055 - 0.001 - 0.0002)  # mean - CPU - waiting for a core
    assert stock["asleep_s_added"] is None  # stock is not paired with itself
    assert safe["asleep_s_added"] == pytest.approx({"median": 275e-6, "min": 250e-6, "max": 300e-6})
    assert safe["cpu_step_s_added"]["median"] == pytest.approx(0.0)
    assert safe["runqueue_wait_s_added"]["median"] == pytest.approx(0.0)
    assert safe["voluntary_switches_added"]["median"] == pytest.approx(0.5)
    text = tiny.markdown(full_run(tiny.config_for(quick=True, rounds=None), out), analysis)
    assert "| nolog | SafeDDPStrategy() | 5775 [5250, 6300] | 1000 [1000, 1000] | 200 [200, 200] |" in text
    assert "| 2.50 [2.50, 2.50] | 0.10 [0.10, 0.10] | +275 | +0 | +0 | +275 | +0.50 |" in text
    assert tiny.analyse({"fits": fits(safe=(1.0, 1.0))})["step_breakdown"] == []  # runs before it was measured


def test_bare_recorder_gives_safe_bare_the_strategys_ring_and_says_so(monkeypatch, tmp_path):
    """``--bare-recorder``: safe_bare's jobs get the strategy's ring size: with desync detection off in safe_bare,
    safe and safe_bare then differ in desync detection, not in the ring."""
    from ddp_strategy.collective_record import TRACE_ENTRIES

    variants = ["stock", "safe", "safe_bare"]
    config = {
        **tiny.config_for(quick=True, rounds=None),
        "variants": variants,
        "bare_kwargs": {"desync_detection": False},
        "bare_recorder": True,
    }
    started = launched_environments(monkeypatch, tmp_path, config)
    assert started["safe_bare"][tiny.RECORDER_SIZE_ENV] == str(TRACE_ENTRIES)
    assert not [v for v in ("stock", "safe") if tiny.RECORDER_SIZE_ENV in started[v]]  # safe sets its own
    base = [f for f in fits(safe=(1.0, 1.0)) if f["variant"] != "raw"]
    bare = [dict(f, variant="safe_bare") for f in base if f["variant"] == "stock"]
    text = tiny.markdown(full_run(config, base + bare), tiny.analyse({"fits": base + bare}))
    assert (
        "The safe_bare variant: `SafeDDPStrategy(**{'desync_detection': False})`, torch's Flight Recorder at the "
        "strategy's size." in text
    )
    plain = full_run({**config, "bare_recorder": False}, base + bare)
    with pytest.raises(ValueError, match="was not run as"):
        tiny.pooled([("ring", full_run(config, base + bare)), ("plain", plain)])


def test_pooled_runs_keep_each_round_paired_within_its_own_run_and_refuse_other_configurations():
    """Two runs of one configuration: safe 5% over stock in the first, 1% under in the second; pooled, 20 rounds."""
    config = tiny.config_for(quick=False, rounds=None)
    first, second = full_run(config, fits(safe=(1.05, 1.0))), full_run(config, fits(safe=(0.99, 1.0)))
    for run in (first, second):
        run["meta"]["git"] = "commit abc"
    result = tiny.pooled([("one", first), ("two", second)])
    assert result["config"]["rounds"] == 20 and {f["round"] for f in result["fits"]} >= {"1.0", "2.9"}
    ratio = by(tiny.analyse(result), "ratios", "nolog", "safe / stock")["step_mean_s"]
    assert ratio["paired"] == pytest.approx({"median": 1.02, "min": 0.99, "max": 1.05})  # never across runs
    text = tiny.markdown(result, tiny.analyse(result))
    assert text.startswith("Pooled: the 2 runs `one` (-, commit abc, 10 rounds), `two` (-, commit abc, 10 rounds)")
    assert "20 rounds; per round" in text
    assert [r["nolog"] for r in tiny.analyse(result)["by_run"]] == pytest.approx([1.05, 0.99])  # each run alone
    assert "- nolog: 1.050, 0.990; 1 of 2 runs at most 1.02, median 1.020" in text
    low, high = tiny.analyse(result)["run_resampled_interval"]["nolog"]
    assert low == pytest.approx(0.99) and high == pytest.approx(1.05)  # a draw of one run twice: its ratio alone
    assert "resampling runs, then rounds within them: [0.990, 1.050]" in text
    assert tiny.analyse(first)["run_resampled_interval"] == {"nolog": None, "sync_dist": None}  # not a pool
    other = full_run({**config, "variants": ["stock", "safe", "safe_bare"]}, fits(safe=(1.0, 1.0)))
    with pytest.raises(ValueError, match="other was not run as one was"):
        tiny.pooled([("one", first), ("other", other)])


def test_the_strategy_without_its_step_hooks_runs_ddpstrategys_in_their_place():
    """``--bare-without-step-hooks``: the instance's per-step methods are DDPStrategy's, bound to it; others its own."""
    from lightning.pytorch.strategies import DDPStrategy

    from ddp_strategy import SafeDDPStrategy

    strategy = SafeDDPStrategy()
    tiny.without_step_hooks(strategy, DDPStrategy)
    for name in tiny.STEP_HOOKS:
        method = getattr(strategy, name)
        assert method.__func__ is getattr(DDPStrategy, name) and method.__self__ is strategy
        assert getattr(SafeDDPStrategy, name) is not getattr(DDPStrategy, name)  # the strategy has its own
    assert strategy.reduce.__func__ is SafeDDPStrategy.reduce  # everything else stays the strategy's
