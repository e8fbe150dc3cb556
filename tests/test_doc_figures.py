"""Every measured figure that README.md and docs/ state is the figure in bench/results/, rounded as printed.

The benchmarks write their results to ``bench/results/*.json``; the pages quote them. Each test below recomputes a
quoted figure from those files and looks for it, in its sentence, on the page: a re-run benchmark whose figures
moved, or a page edited to a figure nobody measured, fails here until the two agree again.
"""

from __future__ import annotations

import inspect
import json
import statistics
from functools import cache
from typing import Any

import pytest

from ddp_strategy.callbacks import StragglerMonitor, WeightSyncCheck
from tests.proc import ROOT

RESULTS = ROOT / "bench" / "results"


@cache
def result(name: str) -> dict[str, Any]:
    return json.loads((RESULTS / f"{name}.json").read_text())


@cache
def page(name: str) -> str:
    """A page's text with line breaks and runs of spaces made single spaces (sentences wrap anywhere)."""
    return " ".join((ROOT / name).read_text().split())


def assert_on(name: str, *phrases: str) -> None:
    text = page(name)
    missing = [p for p in phrases if p not in text]
    assert not missing, f"{name} does not say {missing}"


def suite_ratio(target: str, workload: str, world_size: int) -> float:
    (row,) = [
        r
        for r in result("suite")["analysis"]["ratios"]
        if (r["target"], r["workload"], r["world_size"]) == (target, workload, world_size)
    ]
    return float(row["ratio"])


def suite_row(workload: str, world_size: int, variant: str) -> dict[str, Any]:
    (row,) = [
        r
        for r in result("suite")["analysis"]["rows"]
        if (r["workload"], r["world_size"], r["variant"]) == (workload, world_size, variant)
    ]
    return row


def periodic(workload: str, world_size: int, variant: str, check: str) -> float:
    """Median cost (s) of one periodic check in the suite's last full run."""
    return float(suite_row(workload, world_size, variant)["periodic"][check]["cost_s"]["median"])


def periodic_share(workload: str, world_size: int, variant: str, check: str) -> float:
    """That check's cost per step at its default interval, as a share of the step (as bench/suite.py computes it)."""
    row = suite_row(workload, world_size, variant)
    info = row["periodic"][check]
    return float(info["cost_s"]["median"] / info["every_n_steps"] / row["step_s"]["median"])


def own_hooks_per_step(callback: type) -> float:
    """CPU seconds per training step of the hooks ``callback`` defines itself (not the base class's empty ones)."""
    per_hook = result("callback_cost")["per_hook_s"]
    own = {name for name, value in vars(callback).items() if name.startswith("on_") and inspect.isfunction(value)}
    prefix = f"{callback.__name__}."
    found = {k.removeprefix(prefix): v for k, v in per_hook.items() if k.startswith(prefix)}
    assert found, f"no hook of {callback.__name__} in callback_cost.json"
    return sum(v for k, v in found.items() if k in own)


def median_seconds(variant: str) -> float:
    return float(result("checkpoint_save")["timing"][variant]["median"])


# ---------------------------------------------------------------------------------------------- step time (suite)


def test_safe_over_stock_step_time():
    ratios = [suite_ratio("safe / stock", w, n) for w in ("cifar", "mlp") for n in (1, 2)]
    assert_on("README.md", f"| {min(ratios):.3f} to {max(ratios):.3f} (target <= 1.01) in the ")
    assert_on("bench/README.md", f"wall clock {min(ratios):.3f} to {max(ratios):.3f}")


def test_every_callback_on_over_stock_step_time():
    c1, c2, m1, m2 = (suite_ratio("safe_all / stock", w, n) for w in ("cifar", "mlp") for n in (1, 2))
    assert_on("README.md", f"| {c1:.3f} and {c2:.3f} on CIFAR-10; {m1:.3f} and {m2:.3f} on the MLP,")


def test_callback_hooks_measured_directly():
    cost = result("callback_cost")
    assert cost["model_parameters"] == 25_616_224  # "the MLP" of the suite (25.6M parameters)
    assert_on(
        "README.md",
        f"the callbacks' hooks measured directly: {cost['hooks_cpu_per_step_s'] * 1e3:.1f} ms of CPU per step, "
        f"{cost['fraction_of_step']:.2%} of the MLP's step",
    )
    assert_on("bench/README.md", f"{cost['fraction_of_step']:.2%} of an MLP step")


def test_strategy_own_cost_measured_directly():
    cost = result("strategy_cost")
    rows = {row["workload"]: row for row in cost["workloads"]}
    mlp, cifar = rows["mlp"], rows["cifar"]
    assert mlp["parameters"] == 25_616_224 and cost["devices"] == 2
    phrase = (
        f"`SafeDDPStrategy()`'s own work measured directly: {mlp['own_cpu_per_step_s'] * 1e6:.0f} us of CPU per step "
        f"at 2 ranks, {mlp['fraction_of_step']:.2%} of the MLP's step and {cifar['fraction_of_step']:.2%} of "
        "CIFAR-10's"
    )
    assert_on("README.md", phrase)
    assert_on("bench/README.md", phrase)
    assert_on("bench/README.md", f"**{1 + max(mlp['fraction_of_step'], cifar['fraction_of_step']):.4f}**")
    cells = [r for r in result("suite")["analysis"]["ratios"] if r["target"] == "safe / stock"]
    low, high = min(r["paired_min"] for r in cells), max(r["paired_max"] for r in cells)
    assert_on("bench/README.md", f"per-round safe/stock ratios span {low:.3f} to {high:.3f} over its four cells")


# ---------------------------------------------------------------------------------------------- diagnostics


def test_straggler_monitor_cost():
    hooks_us = own_hooks_per_step(StragglerMonitor) * 1e6
    comparison_ms = periodic("cifar", 2, "safe_straggler", "straggler") * 1e3
    assert_on(
        "README.md",
        f"its hooks: {hooks_us:.0f} us of CPU per training step (one fit of the MLP above, timing included); "
        f"{comparison_ms:.1f} ms per comparison of 2 CPU ranks (every 50 steps by default)",
    )
    assert_on(
        "docs/diagnostics.md",
        f"its hooks {hooks_us:.0f} us of CPU per training step; one small gather ({comparison_ms:.1f} ms median",
        f"the monitor's four per-step hooks took {hooks_us:.0f} us of CPU per training step",
        f"took {comparison_ms:.1f} ms median with 2 CPU ranks, so with the default `every_n_steps=50` it is below 1% "
        "of any batch longer than 5 ms",
    )
    assert comparison_ms / 50 < 0.01 * 5  # the "below 1% of any batch longer than 5 ms" arithmetic
    assert StragglerMonitor().every_n_steps == 50
    per_step = {n for n, v in vars(StragglerMonitor).items() if n.startswith("on_") and inspect.isfunction(v)}
    assert {"on_train_batch_start", "on_before_backward", "on_after_backward", "on_train_batch_end"} <= per_step


def test_weight_sync_check_cost():
    hook_us = own_hooks_per_step(WeightSyncCheck) * 1e6
    mlp = [periodic("mlp", n, "safe_all", "weight_sync") * 1e3 for n in (1, 2)]
    cifar = sorted(periodic("cifar", 2, v, "weight_sync") * 1e3 for v in ("safe_all", "safe_ws"))
    assert_on(
        "docs/diagnostics.md",
        f"{round(min(mlp))} to {round(max(mlp))} ms per check of a 25.6M-parameter model on the CPU",
        f"its per-step hook {hook_us:.0f} us",
        f"on the CIFAR-10 example at 2 ranks {cifar[0]:.1f} to {cifar[1]:.1f} ms per check",
        f"takes {mlp[0]:.1f} ms per check at 1 rank and {mlp[1]:.1f} ms at 2 ranks",
    )
    assert_on("bench/README.md", f"{round(min(mlp))} to {round(max(mlp))} ms per check of the 102 MB MLP")
    mlp_share = [periodic_share("mlp", n, "safe_all", "weight_sync") for n in (1, 2)]
    cifar_share = sorted(periodic_share("cifar", 2, v, "weight_sync") for v in ("safe_all", "safe_ws"))
    assert_on(
        "docs/diagnostics.md",
        f"{min(mlp_share):.2%} to {max(mlp_share):.2%} of a step at the default 100",
        f"({cifar_share[0]:.2%} to {cifar_share[1]:.2%} of a step)",
        f"({mlp_share[0]:.2%} and {mlp_share[1]:.2%} of a step at the default interval)",
    )
    assert WeightSyncCheck().every_n_steps == 100


# ---------------------------------------------------------------------------------------------- handshake


def test_handshake_cost():
    rows = {(r["world_size"], r["model"]): r for r in result("handshake")["rows"]}
    small = statistics.median(rows[(2, "small")]["handshake_seconds"])
    large = statistics.median(rows[(2, "large")]["handshake_seconds"])
    assert 50e6 <= rows[(2, "large")]["params"] < 51e6  # "a 50M-parameter model"
    assert_on(
        "README.md",
        f"| {small * 1e3:.0f} ms median with 2 ranks and a small model; {large:.2f} s for a 50M-parameter model",
    )


# ---------------------------------------------------------------------------------------------- checkpoints


def test_synchronous_checkpoint_save():
    safe, plain = median_seconds("safe"), median_seconds("torch.save")
    timing = result("checkpoint_save")["timing"]
    fastest = timing["safe"]["min"] / timing["torch.save"]["min"]
    fsync = safe / median_seconds("torch.save+fsync")
    extra_mib = result("checkpoint_save")["memory"]["safe"]["extra_bytes"]["median"] / 2**20
    size_mib = result("checkpoint_save")["checkpoint"]["tensor_bytes"] / 2**20
    assert round(size_mib) == 384
    assert_on(
        "README.md",
        f"| {safe / plain:.2f}x a plain `torch.save` that waits for no disk (ratio of medians; {fastest:.2f} for the "
        f"fastest samples), {fsync:.2f}x `torch.save` + `fsync`, {extra_mib:.1f} MiB of extra memory |",
    )
    assert_on(
        "docs/checkpoints.md",
        f"took {safe / plain:.2f} of the time of a plain `torch.save` that waits for no disk (ratio of medians; "
        f"{fastest:.2f} for the fastest samples)",
        f"It needs {extra_mib:.1f} MiB of extra memory",
    )
    assert round(fsync, 1) == 0.5  # "half the time of `torch.save` followed by `fsync`"
    assert round(safe / median_seconds("safe before"), 1) == 0.3  # "a third of the previous format-1 save path"
    assert round(safe / median_seconds("lightning"), 1) == 0.2  # "a fifth of Lightning's `TorchCheckpointIO`"
    floor = median_seconds("durable floor")
    assert_on("docs/checkpoints.md", f"took {floor / plain:.2f} of `torch.save`: the save is within about 10%")
    assert 1.0 <= safe / floor <= 1.15  # "within about 10% of what the disk needs"
    lightning = result("checkpoint_save")["memory"]["lightning"]["fraction"]
    assert_on("docs/checkpoints.md", f"+{lightning['median']:.0%} of its size, median of {len(lightning['samples'])}")


def test_asynchronous_checkpoint_save():
    safe, overlap, blocking = median_seconds("safe"), median_seconds("async overlap"), median_seconds("async submit")
    assert_on(
        "README.md",
        f'| {overlap * 1e3:.1f} ms ({overlap / safe:.3f} of a synchronous save; `async_snapshot="blocking"`: '
        f"{blocking:.2f} s) |",
    )
    assert round(overlap * 1e3) == 2 and round(blocking, 2) == 0.04  # checkpoints.md: "about 2 ms", "about 0.04 s"
    assert_on(
        "docs/checkpoints.md",
        "is blocked about 2 ms per 384 MiB save",
        "(about 0.04 s per 384 MiB in steady state)",
        'training is blocked about 2 ms per save (`"overlap"`) or about 0.04 s (`"blocking"`)',
    )
    steps = {k: v["median"] for k, v in result("checkpoint_save")["async_overlap_steps"].items()}
    lost_overlap = overlap + steps["forward_backward"] - steps["reference"]
    lost_blocking = blocking + steps["beside_blocking"] - steps["reference"]
    assert_on(
        "docs/checkpoints.md",
        f'was {lost_overlap:.2f} s with `"overlap"`, {lost_blocking:.2f} s with `"blocking"` and {safe:.2f} s '
        "for a synchronous save",
    )


# ---------------------------------------------------------------------------------------------- exact evaluation


def test_exact_evaluation_cost():
    ev = result("exact_eval")
    calls = {len(ev["runs"]["ddp"]), len(ev["runs"]["safe_ddp"])}
    assert_on(
        "README.md",
        f"CIFAR-10 example, {ev['samples']} images, 2 ranks | {ev['ratio_test_call']:.2f}x stock Lightning's time for "
        f"the whole call, {ev['ratio_epoch']:.2f}x for the test epoch (medians of {calls.pop()} calls each",
    )
    assert not calls  # both variants ran the same number of calls
    assert ev["counted"] == {"ddp": ev["samples"] + 1, "safe_ddp": ev["samples"]}  # bench README: 2002 vs 2001


# ---------------------------------------------------------------------------------------------- tiny-model step


def cpu_added(name: str, mode: str) -> list[str]:
    """The paired CPU microseconds safe adds per step over stock: median, min, max, as bench/tiny_step.py prints."""
    (target,) = [t for t in result(name)["analysis"]["targets"] if t["mode"] == mode]
    return [f"{target['cpu_added_s'][k] * 1e6:.0f}" for k in ("median", "min", "max")]


def test_tiny_step_safe_vs_stock():
    targets = {t["mode"]: t for t in result("tiny_step")["analysis"]["targets"]}
    nolog, sync = targets["nolog"], targets["sync_dist"]
    (a, a_lo, a_hi), (b, b_lo, b_hi) = cpu_added("tiny_step", "nolog"), cpu_added("tiny_step", "sync_dist")
    assert_on(
        "bench/README.md",
        f"`safe / stock` in wall-clock time: {nolog['wall']:.3f} without logging (missed) and {sync['wall']:.3f} with "
        'the `sync_dist` log ("met" by the rule, not resolved)',
        f"By CPU time the target is missed in both modes: {nolog['cpu']:.3f} and {sync['cpu']:.3f}",
        f"{a} us more per step without logging ({a_lo} to {a_hi}) and {b} us with the `sync_dist` log "
        f"({b_lo} to {b_hi})",
    )
    assert not nolog["met"] and sync["met"]
    assert not nolog["met_by_cpu"] and not sync["met_by_cpu"]
    assert nolog["cpu_added_s"]["min"] > 0 and sync["cpu_added_s"]["min"] > 0  # "in every one of the paired rounds"
    (a, a_lo, a_hi), (b, b_lo, b_hi) = (
        cpu_added("tiny_step-heavy-load", "nolog"),
        cpu_added("tiny_step-heavy-load", "sync_dist"),
    )
    assert_on("bench/README.md", f"again +{a} us ({a_lo} to {a_hi}) and +{b} us ({b_lo} to {b_hi}) of CPU per step")


def test_tiny_step_on_the_intel_machine():
    older = {t["mode"]: t for t in result("tiny_step-intel-dc04d0b")["analysis"]["targets"]}
    assert result("tiny_step-intel-dc04d0b")["meta"]["git"] == "commit dc04d0b"
    assert_on(
        "bench/README.md",
        f"wall {older['nolog']['wall']:.3f} and {older['sync_dist']['wall']:.3f} (both missed), CPU "
        f"{older['nolog']['cpu']:.3f} and {older['sync_dist']['cpu']:.3f};",
    )
    run = result("tiny_step-intel-72e9c5a")
    assert run["meta"]["git"] == "commit 72e9c5a" and "Intel" in run["meta"]["machine"]
    targets = {t["mode"]: t for t in run["analysis"]["targets"]}
    nolog, sync = targets["nolog"], targets["sync_dist"]
    assert nolog["met"] and not sync["met"] and nolog["met_by_cpu"] and sync["met_by_cpu"]
    (a, a_lo, a_hi), (b, b_lo, b_hi) = (cpu_added("tiny_step-intel-72e9c5a", m) for m in ("nolog", "sync_dist"))
    rows = {(r["mode"], r["variant"]): r for r in run["analysis"]["rows"]}
    stock_cpu = [f"{rows[(m, 'stock')]['cpu_step_s']['median'] * 1e6:.0f}" for m in ("nolog", "sync_dist")]
    safe_sync, stock_sync = rows[("sync_dist", "safe")], rows[("sync_dist", "stock")]
    longer = (safe_sync["step_median_s"]["median"] - stock_sync["step_median_s"]["median"]) * 1e6
    more_cpu = (safe_sync["cpu_step_s"]["median"] - stock_sync["cpu_step_s"]["median"]) * 1e6
    raw_median = rows[("sync_dist", "raw")]["step_median_s"]
    assert_on(
        "bench/README.md",
        f"wall **{nolog['wall']:.3f}** without logging (met) and **{sync['wall']:.3f}** with the `sync_dist` log "
        f"(missed), CPU **{nolog['cpu']:.3f} and {sync['cpu']:.3f} (met by CPU in both)**",
        f"{a} us ({a_lo} to {a_hi}) and {b} us ({b_lo} to {b_hi}) more CPU per step than stock's, paired medians, "
        f"against stock's {stock_cpu[0]} and {stock_cpu[1]} us",
        f"missed in both Intel runs ({older['sync_dist']['wall']:.3f} and {sync['wall']:.3f}), with safe's median "
        f"step up to {longer:.0f} us longer for {more_cpu:.0f} us more CPU",
        f"spans {raw_median['min'] * 1e6:.0f} to {raw_median['max'] * 1e6:.0f} us over the rounds of the 72e9c5a run",
    )


def test_waiting_thread_tiny_model_and_calls_counted():
    cost = result("strategy_cost-idle-reference")
    rows = {row["workload"]: row for row in cost["workloads"]}
    assert set(rows) == {"mlp", "cifar", "tiny"} and cost["devices"] == 2
    for label, name in (("MLP", "mlp"), ("CIFAR-10", "cifar"), ("tiny", "tiny")):
        row = rows[name]
        threads = row["threads_cpu_per_step_s"]
        parts = [threads[f"ddp_strategy-{t}-rank0"] * 1e6 for t in ("pulse", "heartbeat", "preemption-watch")]
        assert_on(
            "bench/README.md",
            f"| {label} | {row['step_cpu_median_s'] * 1e3:.1f} | {row['own_cpu_per_step_s'] * 1e6:.0f} | "
            f"{sum(row['own_per_method_s'].values()) * 1e6:.1f} | {sum(threads.values()) * 1e6:.1f} "
            f"({parts[0]:.1f}, {parts[1]:.1f}, {parts[2]:.1f}) | {row['idle_thread_per_step_s'] * 1e6:.1f} | "
            f"{row['own_per_call_s']['reduce']['median'] * 1e6:.1f} |",
        )
    mlp = rows["mlp"]
    assert_on(
        "bench/README.md",
        f"is charged {mlp['idle_thread_per_step_s'] * 1e6:.1f} us of CPU per MLP step",
        f"their {sum(mlp['threads_cpu_per_step_s'].values()) * 1e6:.1f} is waking",
    )
    counts = result("call_count-72e9c5a")["modes"]  # the counts of that afternoon (call_count.json: the newest)
    stock = [counts[m]["calls_per_step"]["stock"] for m in ("nolog", "sync_dist")]
    added = [counts[m]["calls_per_step"]["safe"] - counts[m]["calls_per_step"]["stock"] for m in ("nolog", "sync_dist")]
    assert_on(
        "bench/README.md",
        f"stock's training thread makes {stock[0]:.0f} Python calls without logging and {stock[1]:.0f} with a "
        f"`sync_dist` log; `SafeDDPStrategy()` adds {added[0]:.0f} and {added[1]:.0f}",
    )
    nolog = counts["nolog"]["added_per_step"]
    assert nolog["<built-in method builtins.getattr>"] >= 18 and nolog["<built-in method builtins.callable>"] == 18
    assert not any(
        "ReloadedTrainingBatchesCheck" in name for name in nolog
    )  # no such callback in a fit without reloads


def test_control_group_thread_and_log_wrapper_counted():
    """bench/README.md's evening table: strategy_cost before and after the shared gloo device, calls, tiny_step."""
    for commit in ("3c7f37d", "6b76bcc"):
        rows = {row["workload"]: row for row in result(f"strategy_cost-intel-{commit}")["workloads"]}
        assert set(rows) == {"mlp", "cifar", "tiny"}
        for name in ("mlp", "cifar", "tiny"):
            row = rows[name]
            threads = row["threads_cpu_per_step_s"]
            gloo = sum(v for k, v in threads.items() if k.startswith("control group's gloo_tcp_loop"))
            python = sum(v for k, v in threads.items() if k.startswith("ddp_strategy-"))
            own = row["own_per_method_s"]
            assert_on(
                "bench/README.md",
                f"{row['step_cpu_median_s'] * 1e3:.1f}",
                f"{row['own_cpu_per_step_s'] * 1e6:.0f}",
                f"{python * 1e6:.1f}",
                f"{sum(own.values()) * 1e6:.1f}",
                f"{own['self.log wrapper'] * 1e6:.1f}",
                f"{row['own_per_call_s']['reduce']['median'] * 1e6:.1f}",
            )
            if commit == "3c7f37d":
                assert gloo > 0 and f"{gloo * 1e6:.1f}" in page("bench/README.md")
            else:
                assert gloo == 0  # no network thread of its own
            if row["per_sync_dist_value_s"] is not None:
                assert f"{row['per_sync_dist_value_s']['median'] * 1e6:.1f}" in page("bench/README.md")
    mlp = {row["workload"]: row for row in result("strategy_cost-intel-3c7f37d")["workloads"]}["mlp"]
    gloo = sum(v for k, v in mlp["threads_cpu_per_step_s"].items() if "gloo_tcp_loop" in k)
    assert_on("bench/README.md", f"{gloo * 1e6:.1f} us of CPU per {mlp['step_cpu_median_s'] * 1e3:.1f}-ms MLP step")
    counts = result("call_count")["modes"]
    added = [counts[m]["calls_per_step"]["safe"] - counts[m]["calls_per_step"]["stock"] for m in ("nolog", "sync_dist")]
    assert_on("bench/README.md", f"safe adds {added[0]:.0f} calls per step without logging and {added[1]:.0f} with")
    beats = {
        commit: [
            result(f"strategy_cost-tiny1000-{commit}-{i}")["workloads"][0]["threads_cpu_per_step_s"][
                "ddp_strategy-heartbeat-rank0"
            ]
            * 1e6
            for i in (1, 2)
        ]
        for commit in ("3cad485", "8be0d33")
    }
    assert_on(
        "bench/README.md",
        f"{beats['3cad485'][0]:.1f} and {beats['3cad485'][1]:.1f} us per step before",
        f"{beats['8be0d33'][0]:.1f} and {beats['8be0d33'][1]:.1f} after",
    )
    for commit in ("f7345a8", "6b76bcc"):
        targets = {t["mode"]: t for t in result(f"tiny_step-intel-{commit}")["analysis"]["targets"]}
        wall = " / ".join(f"{targets[m]['wall']:.3f}" for m in ("nolog", "sync_dist"))
        cpu = " / ".join(f"{targets[m]['cpu']:.3f}" for m in ("nolog", "sync_dist"))
        row = page("bench/README.md").split(f"| {commit} | `bench/results/tiny_step-intel-{commit}")[1].split("|")
        assert row[1].replace("*", "").strip() == wall and row[2].replace("*", "").strip() == cpu
    for commit, over in (("f7345a8", 1), ("3c7f37d", 0)):  # the 512-call batches, then the 0.25-ms hold
        holds = [f["background_holds"] for f in result(f"step_pauses-intel-{commit}")["fits"] if f["variant"] == "safe"]
        assert (max(h["over_1ms"] for h in holds) >= 1) == bool(over)
    holds = [f["background_holds"] for f in result("step_pauses-intel-3c7f37d")["fits"] if f["variant"] == "safe"]
    longest = " and ".join(f"{h['longest']['cpu_s'] * 1e3:.3f}" for h in holds)
    assert_on("bench/README.md", f"The longest, {longest} ms, is the audit's recorder dump")


def test_strategy_cost_recounted_at_6c50b88_and_de88abb():
    """bench/README.md's re-count table: each cell is the result file's figure."""
    runs = {
        f"{row['workload']} {commit}": row
        for name, commit in (("strategy_cost-intel-6c50b88", "6c50b88"), ("strategy_cost-tiny-de88abb", "de88abb"))
        for row in result(name)["workloads"]
    }
    assert set(runs) == {"mlp 6c50b88", "cifar 6c50b88", "tiny 6c50b88", "tiny de88abb"}
    columns = ["mlp 6c50b88", "cifar 6c50b88", "tiny 6c50b88", "tiny de88abb"]

    section = (ROOT / "bench/README.md").read_text().split("#### Re-counted 2026-11-28")[1].split("###")[0]
    table = {
        cells[0]: cells[1:]
        for cells in ([c.strip() for c in ln.split("|")[1:-1]] for ln in section.splitlines() if ln.startswith("| "))
    }

    def python_threads(row: dict) -> float:
        return sum(v for k, v in row["threads_cpu_per_step_s"].items() if k.startswith("ddp_strategy-"))

    expected = {
        "own CPU per step, in all": [f"{runs[c]['own_cpu_per_step_s'] * 1e6:.1f}" for c in columns],
        "training thread": [f"{sum(runs[c]['own_per_method_s'].values()) * 1e6:.1f}" for c in columns],
        "of it: `on_train_batch_start`": [
            f"{runs[c]['own_per_method_s']['on_train_batch_start'] * 1e6:.1f}" for c in columns
        ],
        "the strategy's Python threads": [f"{python_threads(runs[c]) * 1e6:.1f}" for c in columns],
        "per `sync_dist` value: wrapper + `reduce`, median": [
            "-"
            if runs[c]["per_sync_dist_value_s"] is None
            else f"{runs[c]['per_sync_dist_value_s']['median'] * 1e6:.1f}"
            for c in columns
        ],
    }
    for label, cells in expected.items():
        assert table[label] == cells, label
    assert all(runs[c]["own_cpu_per_step_s"] > 50e-6 for c in columns)  # "met on none ... by this measure"


def test_step_pauses_around_the_heartbeat_merge():
    """bench/README.md's evening bullet: each run's stretches over 1 ms, the longest, and where they were."""
    for name, where in (
        ("77b49ab-1", "heartbeat.py"),
        ("80d696a", "desync_audit.py"),
        ("77b49ab-2", "desync_audit.py"),
    ):
        holds = [f["background_holds"] for f in result(f"step_pauses-intel-{name}")["fits"] if f["variant"] == "safe"]
        over = " and ".join(f"{h['over_1ms']} of {h['stretches']}" for h in holds)
        longest = " and ".join(f"{h['longest']['cpu_s'] * 1e3:.3f}" for h in holds)
        assert_on("bench/README.md", over, longest)
        assert all(h["longest"]["to"].startswith(where) for h in holds)
    assert any(
        f["background_holds"]["over_1ms"] > 0
        for name in ("77b49ab-1", "80d696a")
        for f in result(f"step_pauses-intel-{name}")["fits"]
        if f["variant"] == "safe"
    )  # "missed this evening by both commits"


def test_step_pauses_dump_apart_from_its_unpickling_table_is_the_result_files():
    """bench/README.md's table of 2026-11-29: each safe fit's row, stock's longest gap beside it, from the results."""
    section = (ROOT / "bench/README.md").read_text().split("#### The dump apart from its unpickling")[1]
    section = section.split("## Tiny-model step")[0]
    rows = 0
    for name in ("144a5f5", "split-dump-first", "split-dump"):
        fits = result(f"step_pauses-intel-{name}")["fits"]
        stock = {f["round"]: f["hook_gaps"]["max_s"] for f in fits if f["variant"] == "stock"}
        for fit in (f for f in fits if f["variant"] == "safe"):
            holds = fit["background_holds"]
            longest, call = holds["longest"], holds["longest_c_call"]
            where = {
                "desync_audit.py:104": "the dump and its unpickling",  # 144a5f5: the sleeps before and after both
                "desync_audit.py:54": "the dump alone",  # since: a sleep between them too
                "collective_record.py:185": "the ledger's settling",
            }[longest["from"]]
            assert longest["to"] == longest["from"].replace(":104", ":107")
            cells = (
                f"| {fit['round']} | {holds['over_1ms']} of {holds['stretches']} | {longest['cpu_s'] * 1e3:.3f}, "
                f"{where} | {call['cpu_s'] * 1e3:.3f} | {fit['hook_gaps']['max_s'] * 1e3:.3f} / "
                f"{stock[fit['round']] * 1e3:.3f} |"
            )
            assert cells in section, cells
            rows += 1
    assert rows == 7
    # "from 0.92-0.98 ms to 0.49-0.61 ms" in the runs without a stretch over 1 ms
    before = [f["background_holds"]["longest"]["cpu_s"] for f in result("step_pauses-intel-144a5f5")["fits"][1:3]]
    after = [f["background_holds"] for f in result("step_pauses-intel-split-dump")["fits"] if f["variant"] == "safe"]
    assert all(h["over_1ms"] == 0 for h in after)
    assert_on("bench/README.md", f"from {min(before) * 1e3:.2f}-{max(before) * 1e3:.2f} ms to")
    assert_on("bench/README.md", f"to {min(h['longest']['cpu_s'] for h in after) * 1e3:.2f}-")
    assert_on("bench/README.md", f"-{max(h['longest']['cpu_s'] for h in after) * 1e3:.2f} ms: what is left")


def test_quiet_ab_table_is_the_result_files():
    """bench/README.md's A/B of 2026-11-29 morning: table, heartbeat and watch medians, point 1's ranges."""
    ab = result("strategy_cost_ab-quiet")
    assert ab["base"].startswith("328e16a") and ab["head"].startswith("312f240") and not ab["dirty"]
    assert len(ab["runs"]) == 6
    assert_ab_table(ab, "#### The same A/B on a quiet VM")

    def per_run(side: str, workload: str, key: str) -> list[float]:
        return [
            run[side][workload][key] if key in run[side][workload] else run[side][workload]["threads"][key]
            for run in ab["runs"]
        ]

    heartbeat, watch = "ddp_strategy-heartbeat-rank0", "ddp_strategy-preemption-watch-rank0"
    before, after = per_run("base", "mlp", heartbeat), per_run("head", "mlp", heartbeat)
    assert_on(
        "bench/README.md",
        f"{statistics.median(before):.1f} us per step before, {statistics.median(after):.1f} after",
        f"per round {min(before):.1f}-{max(before):.1f} against {min(after):.1f}-{max(after):.1f}",
    )
    assert all(cpu == 0.0 for cpu in per_run("head", "mlp", watch))
    watched = per_run("base", "mlp", watch)
    assert_on("bench/README.md", f"0.0 to {max(watched):.1f} (median {statistics.median(watched):.1f}) before")
    ratios = ab["analysis"]["mlp"]["Python threads"]["ratios"]
    assert sum(r < 1 for r in ratios) == 3
    assert_on("bench/README.md", "(ratios " + ", ".join(f"{r:.3f}" for r in ratios) + ")")
    tiny, mlp = per_run("head", "tiny", "own"), per_run("head", "mlp", "own")
    assert sum(t < 50 for t in tiny) == 5  # "under 50 in five rounds of six"
    assert_on(
        "bench/README.md",
        f"is {min(tiny):.1f} to {max(tiny):.1f} us",
        f"{min(mlp):.1f} to {max(mlp):.1f} us stays far off",
    )
    idle = per_run("head", "mlp", "idle_thread") + per_run("base", "mlp", "idle_thread")
    assert_on("bench/README.md", f"the waiting thread cost {min(idle):.1f} to {max(idle):.1f}")


def test_heartbeat_parts_table_is_the_result_files():
    """bench/README.md's heartbeat thread by part: us per step and per beat, from the two result files."""
    section = (ROOT / "bench/README.md").read_text().split("#### The heartbeat thread by part")[1].split("###")[0]
    (mlp,) = result("strategy_cost-heartbeat-parts")["workloads"][:1]
    (tiny,) = result("strategy_cost-heartbeat-parts-tiny")["workloads"]
    assert (mlp["workload"], mlp["steps"], tiny["workload"], tiny["steps"]) == ("mlp", 300, "tiny", 3000)
    rows = {
        "the position's publication (its JSON and its `set`)": "publication (the position's JSON and its set)",
        "the desync monitor's beat hook, in all": "beat hooks (the desync monitor's)",
        "of which its store read (`read_with_failures`, one `multi_get`)": "  their store read (read_with_failures)",
        "of which the audit's recorder dumps (3 and 1 dumps in the window)": "  the audit's recorder dumps",
        "the rest: wake-ups and the loop": "the rest: wake-ups and the loop",
        "the heartbeat thread in all (56 and 13 beats in the window)": None,
    }
    for label, part in rows.items():
        cells = []
        for row in (mlp, tiny):
            beats = row["heartbeat_parts"]["calls_in_window"]["beat hooks (the desync monitor's)"]
            heartbeat = row["threads_cpu_per_step_s"]["ddp_strategy-heartbeat-rank0"]
            cpu = heartbeat if part is None else row["heartbeat_parts"]["cpu_per_step_s"][part]
            cells += [f"{cpu * 1e6:.1f}", f"{cpu * row['steps'] / beats * 1e6:.0f}"]
        assert f"| {label} | {' | '.join(cells)} |" in section, label
    calls = [row["heartbeat_parts"]["calls_in_window"] for row in (mlp, tiny)]
    assert [c["  the audit's recorder dumps"] for c in calls] == [3, 1]
    assert [c["beat hooks (the desync monitor's)"] for c in calls] == [56, 13]
    assert f"cost\n  {mlp['idle_thread_per_step_s'] * 1e6:.1f} us per MLP step" in section


def test_tiny_step_runs_at_3103ff0_table_is_the_result_files():
    """bench/README.md's two tiny-step runs of 2026-11-29: ratios, intervals, own CPU, per value, from the results."""
    section = (ROOT / "bench/README.md").read_text().split("### The tiny-step runs at 3103ff0")[1].split("###")[0]
    runs = (
        ("`--aa`", "tiny_step-intel-aa-3103ff0", "3103ff0"),
        ("default", "tiny_step-intel-3103ff0", "3103ff0"),
        ("`--aa`, again", "tiny_step-intel-aa-e7961cb", "e7961cb"),
    )
    for label, name, commit in runs:
        analysis = result(name)["analysis"]
        assert result(name)["meta"]["git"] == f"commit {commit}"
        targets = {t["mode"]: t for t in analysis["targets"]}
        modes = ("nolog", "sync_dist")

        def bold(target: dict[str, Any]) -> str:
            text = f"{target['wall']:.3f}"
            return text if target["met"] else f"**{text}**"

        aa = {r["mode"]: r for r in analysis["ratios"] if r["ratio"] == "stock_again / stock"}
        own = analysis["own_cpu_per_step"]
        value = analysis["per_sync_dist_value"]
        low, high = value["interval_s"]
        cells = [
            label,
            " / ".join(bold(targets[m]) for m in modes),
            " / ".join("[{:.3f}, {:.3f}]".format(*targets[m]["wall_paired_interval"]) for m in modes),
            " / ".join(f"{aa[m]['step_mean_s']['of_medians']:.3f}" for m in modes) if aa else "-",
            " / ".join(f"{targets[m]['cpu']:.3f}" for m in modes),
            " / ".join(f"{own[m]['total_s']['median'] * 1e6:.0f}" for m in modes),
            f"{value['cpu_added_s']['median'] * 1e6:.1f} [{low * 1e6:.1f}, {high * 1e6:.1f}]",
        ]
        assert f"| {' | '.join(cells)} |" in section, cells
    firsts = [{t["mode"]: t for t in result(name)["analysis"]["targets"]}["nolog"] for _, name, _ in runs[::2]]
    assert all(t["wall_paired_interval"][0] > 1.02 for t in firsts)  # "with paired intervals above 1.02"
    walls, cpus = ([f"{t[key]['median'] * 1e6:.0f}" for t in firsts] for key in ("wall_added_s", "cpu_added_s"))
    assert_on("bench/README.md", f"by {walls[0]} and {walls[1]} us (paired medians), for {cpus[0]} and {cpus[1]} us")


def assert_ab_table(ab: dict[str, Any], heading: str, labels: dict[str, str] | None = None) -> None:
    """The table under ``heading`` in bench/README.md is the A/B result ``ab``: per part, medians and paired ratios."""
    section = (ROOT / "bench/README.md").read_text().split(heading)[1].split("###")[0]
    table = {
        cells[0]: cells[1:]
        for cells in ([c.strip() for c in ln.split("|")[1:-1]] for ln in section.splitlines() if ln.startswith("| "))
    }
    labels = labels or {
        "Python threads": "the strategy's Python threads",
        "training thread": "training thread (code unchanged: the noise)",
    }
    for part, label in labels.items():
        cells = []
        for workload in ("mlp", "tiny"):
            stats = ab["analysis"][workload][part]
            for side in ("base", "head"):
                cells.append(f"{statistics.median(run[side][workload][part] for run in ab['runs']):.1f}")
            low, high = stats["range"]
            cells.append(f"{stats['median']:.3f} [{low:.3f}, {high:.3f}]")
        assert table[label] == cells, label


def assert_ab_section(name: str, base: str, head: str, heading: str, training: str) -> dict[str, Any]:
    """The A/B result ``name`` (``base`` against ``head``, a clean tree) is the table under ``heading``: in all, the
    training thread's part (labelled ``training``) and the strategy's Python threads'. Returns the result."""
    ab = result(name)
    assert ab["base"].startswith(base) and ab["head"].startswith(head) and not ab["dirty"]
    labels = {
        "own": "own CPU per step, in all",
        "training thread": training,
        "Python threads": "the strategy's Python threads",
    }
    assert_ab_table(ab, heading, labels)
    return ab


def test_heartbeat_merge_ab_table_is_the_result_files():
    """bench/README.md's A/B of one heartbeat thread against two: medians and paired ratios from the result file."""
    ab = result("strategy_cost_ab-heartbeat-merge")
    assert ab["base"].startswith("80d696a") and ab["head"].startswith("77b49ab") and not ab["dirty"]
    for side, names in (("base", {"pulse", "heartbeat"}), ("head", {"heartbeat"})):  # whose code ran, by thread
        for run in ab["runs"]:
            threads = {
                k.split("-")[1] for k in run[side]["mlp"]["threads"] if k != "ddp_strategy-preemption-watch-rank0"
            }
            assert threads == names
    assert_ab_table(ab, "#### One heartbeat thread instead of two")
    ratios = ab["analysis"]["mlp"]["Python threads"]["ratios"]
    assert sum(r < 1 for r in ratios) == 3 and len(ratios) == 4  # "less in three rounds of four"
    assert_on("bench/README.md", "(ratios " + ", ".join(f"{r:.3f}" for r in ratios) + ")")
    waits = [run[side]["mlp"]["idle_thread"] for run in ab["runs"] for side in ("base", "head")]
    assert_on("bench/README.md", f"{min(waits):.1f} to {max(waits):.1f} us per MLP step")
    spread = max(abs(r - 1) for w in ("mlp", "tiny") for r in ab["analysis"][w]["training thread"]["ratios"])
    assert_on("bench/README.md", f"moves by up to {spread * 100:.0f}% between")


@pytest.mark.parametrize(
    "name",
    [
        "callback_cost",
        "checkpoint_save",
        "handshake",
        "strategy_cost",
        "strategy_cost-idle-reference",
        "call_count",
        "call_count-72e9c5a",
        "strategy_cost-intel-3c7f37d",
        "strategy_cost-intel-6b76bcc",
        "strategy_cost-intel-6c50b88",
        "strategy_cost-tiny-de88abb",
        "strategy_cost_ab-heartbeat-merge",
        "step_pauses-intel-77b49ab-1",
        "step_pauses-intel-77b49ab-2",
        "step_pauses-intel-80d696a",
        "suite",
        "tiny_step",
        "tiny_step-heavy-load",
        "tiny_step-intel-dc04d0b",
        "tiny_step-intel-72e9c5a",
        "tiny_step-intel-f7345a8",
        "tiny_step-intel-6b76bcc",
        "tiny_step-intel-aa-761665f",
        "tiny_step-intel-aa-4e4b5ee",
        "tiny_step-intel-aa20-ac807a3",
        "tiny_step-intel-aa-232afa9",
        "tiny_step-intel-aa-d160373",
        "step_pauses-intel-de88abb",
        "step_pauses-intel-e8781ec",
        "step_pauses-intel-inline-beat-96bc357",
        "step_pauses-intel-split-audit-9b93cea",
        "step_pauses-intel-dump-step-df9e37c",
        "step_pauses-intel-parse-step-f91297c",
        "strategy_cost_ab-inline-beat",
        "strategy_cost_ab-dump-step",
        "tiny_step-intel-dump-step-1-c46ad94",
        "tiny_step-intel-dump-step-2-c46ad94",
        "tiny_step-intel-dump-step-3-c46ad94",
        "instructions_per_step-d160373",
        "instructions_per_step-6c50b88",
        "flight_recorder_cost",
    ],
)
def test_results_are_from_the_versions_bench_readme_names(name: str):
    """The quoted runs used torch 2.14.1 and (where recorded) Lightning 2.6.6, as bench/README.md says."""
    meta = result(name).get("meta") or result(name)["machine"]
    assert meta["torch"].startswith("2.14.1")
    assert meta.get("lightning", "2.6.6") == "2.6.6"
    assert_on("bench/README.md", "torch 2.14.1", "lightning 2.6.6")


AA_RUNS = ("aa-761665f", "aa-4e4b5ee", "aa20-ac807a3")


def _aa(name: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    analysis = result(f"tiny_step-intel-{name}")["analysis"]
    targets = {t["mode"]: t for t in analysis["targets"]}
    aa = {r["mode"]: r for r in analysis["ratios"] if r["ratio"] == "stock_again / stock"}
    return targets, aa, analysis["own_cpu_per_step"]


def test_tiny_step_a_a_runs_and_reduce_without_the_barrier():
    """bench/README.md's 2026-11-28 table and sentences: the A/A runs, the intervals, safe's own CPU per step."""
    modes = ("nolog", "sync_dist")
    for name in AA_RUNS:
        targets, aa, own = _aa(name)
        cells = page("bench/README.md").split(f"`bench/results/tiny_step-intel-{name}.{{json,md}}` |")[1].split("|")
        assert cells[0].strip() == " / ".join(f"{targets[m]['wall']:.3f}" for m in modes)
        assert cells[1].strip() == " / ".join(f"{aa[m]['step_mean_s']['of_medians']:.3f}" for m in modes)
        assert cells[2].strip() == " / ".join(f"{targets[m]['cpu']:.3f}" for m in modes)
        assert cells[3].strip() == " / ".join(f"{own[m]['total_s']['median'] * 1e6:.0f}" for m in modes)
    runs = [_aa(name) for name in AA_RUNS]
    aa_medians = [r[1][m]["step_mean_s"]["of_medians"] for r in runs for m in modes]
    aa_paired = [r[1][m]["step_mean_s"]["paired"] for r in runs for m in modes]
    intervals = [r[0]["nolog"]["wall_paired_interval"] for r in runs]
    new = runs[1][0]["sync_dist"]
    added = [r[2]["nolog"]["training_thread_added_s"]["median"] * 1e6 for r in runs]
    threads = [r[2]["nolog"]["own_threads_s"]["median"] * 1e6 for r in runs]
    totals = [r[2]["nolog"]["total_s"]["median"] * 1e6 for r in runs]
    assert_on(
        "bench/README.md",
        f"the A/A ratios of medians are {min(aa_medians):.3f} to {max(aa_medians):.3f}",
        f"their per-round paired ratios span {min(p['min'] for p in aa_paired):.3f} to "
        f"{max(p['max'] for p in aa_paired):.3f}",
        f"[{intervals[0][0]:.3f}, {intervals[0][1]:.3f}] at 761665f and [{intervals[1][0]:.3f}, "
        f"{intervals[1][1]:.3f}] at 4e4b5ee",
        f"safe's mean step is {new['wall']:.3f} of stock's at 4e4b5ee (paired {new['wall_paired']['median']:.3f}, its "
        f"90% interval [{new['wall_paired_interval'][0]:.3f}, {new['wall_paired_interval'][1]:.3f}])",
        f"uses {-new['cpu_added_s']['median'] * 1e6:.0f} us less CPU per step",
        f"the training thread adds {added[0]:.0f} and {added[1]:.0f} us per step (paired medians), and safe's own "
        f"threads {threads[0]:.0f} and {threads[1]:.0f} us, so {totals[0]:.0f} and {totals[1]:.0f} us",
    )
    stock_cpu = [
        row["cpu_step_s"]["median"] * 1e3
        for name in AA_RUNS
        for row in result(f"tiny_step-intel-{name}")["analysis"]["rows"]
        if (row["mode"], row["variant"]) == ("nolog", "stock")
    ]
    assert_on("bench/README.md", f"({min(stock_cpu[:2]):.1f} to {max(stock_cpu[:2]):.1f} ms of stock's CPU)")
    (long, _, own20) = runs[2]
    nolog, sync = long["nolog"], long["sync_dist"]
    assert_on(
        "bench/README.md",
        f"safe/stock **{nolog['wall']:.3f} without logging and {sync['wall']:.3f} with the `sync_dist` log**",
        f"by training-thread CPU too ({nolog['cpu']:.3f} and {sync['cpu']:.3f})",
        f"logging is [{nolog['wall_paired_interval'][0]:.3f}, {nolog['wall_paired_interval'][1]:.3f}], with it "
        f"[{sync['wall_paired_interval'][0]:.3f}, {sync['wall_paired_interval'][1]:.3f}]",
        f"without logging: {own20['nolog']['total_s']['median'] * 1e6:.0f} us "
        f"({own20['nolog']['training_thread_added_s']['median'] * 1e6:.0f} on the training thread, "
        f"{own20['nolog']['own_threads_s']['median'] * 1e6:.0f} on its threads",
        f"which span {own20['nolog']['total_s']['min'] * 1e6:.0f} to {own20['nolog']['total_s']['max'] * 1e6:.0f})",
    )
    # README.md's row quotes the eight runs of the current code now (test_readme_tiny_step_row_is_...), and still the
    # A/A spread of these runs
    assert_on(
        "README.md", f"two stock fits differ by {min(aa_medians):.3f} to {max(aa_medians):.3f} by the same method"
    )
    fr = result("flight_recorder_cost")["analysis"]["added_per_call_s"]
    assert_on(
        "bench/README.md",
        f"measures it: {fr['median'] * 1e6:.1f} us of the calling thread's CPU per collective (paired per round, "
        f"median of 6; {fr['min'] * 1e6:.1f} to {fr['max'] * 1e6:.1f};",
    )


def test_tiny_step_with_the_all_gather_on_gloo():
    """bench/README.md's paragraph on 232afa9: safe/stock in both modes, the intervals, the CPU per value."""
    targets, aa, own = _aa("aa-232afa9")
    nolog, sync = targets["nolog"], targets["sync_dist"]
    per_value = result("tiny_step-intel-aa-232afa9")["analysis"]["per_sync_dist_value"]
    assert nolog["wall"] > 1.02 >= sync["wall"]  # the README calls the first missed, the second met
    assert_on(
        "bench/README.md",
        f"safe/stock **{nolog['wall']:.3f} without logging and {sync['wall']:.3f} with the `sync_dist` log**; A/A "
        f"{aa['nolog']['step_mean_s']['of_medians']:.3f} and {aa['sync_dist']['step_mean_s']['of_medians']:.3f}",
        f"(paired 90% interval [{sync['wall_paired_interval'][0]:.3f}, {sync['wall_paired_interval'][1]:.3f}])",
        f"the paired interval is [{nolog['wall_paired_interval'][0]:.3f}, {nolog['wall_paired_interval'][1]:.3f}]",
        f"safe's own CPU per step is {own['nolog']['total_s']['median'] * 1e6:.0f} us "
        f"({own['nolog']['training_thread_added_s']['median'] * 1e6:.0f} on the training thread, "
        f"{own['nolog']['own_threads_s']['median'] * 1e6:.0f} on its threads)",
    )
    old = result("tiny_step-intel-aa20-ac807a3")["analysis"]["per_sync_dist_value"]["cpu_added_s"]["median"]
    low, high = (x * 1e6 for x in per_value["interval_s"])
    assert_on(
        "bench/README.md",
        f"safe's training thread now uses {-per_value['cpu_added_s']['median'] * 1e6:.1f} us less CPU than stock's "
        f"(median; 90% interval [{low:.1f}, {high:.1f}]), against {-old * 1e6:.1f} us less with the all-reduce",
    )


def test_tiny_step_a_a_run_after_the_preemption_hook_skip():
    """bench/README.md's d160373 bullet: safe/stock in both modes, A/A, the intervals, own CPU, CPU per value."""
    targets, aa, own = _aa("aa-d160373")
    nolog, sync = targets["nolog"], targets["sync_dist"]
    assert max(nolog["wall"], sync["wall"]) <= 1.02  # "both under 1.02 by the rule"
    assert nolog["wall_paired_interval"][1] > 1.02 and sync["wall_paired_interval"][1] > 1.02  # "hold 1.02"
    per_value = result("tiny_step-intel-aa-d160373")["analysis"]["per_sync_dist_value"]
    low, high = (x * 1e6 for x in per_value["interval_s"])
    assert_on(
        "bench/README.md",
        f"safe/stock **{nolog['wall']:.3f} without logging and {sync['wall']:.3f} with the `sync_dist` log**, both "
        f"under 1.02 by the rule; by training-thread CPU {nolog['cpu']:.3f} and {sync['cpu']:.3f}",
        f"The A/A ratios are {aa['nolog']['step_mean_s']['of_medians']:.3f} and "
        f"{aa['sync_dist']['step_mean_s']['of_medians']:.3f}",
        f"[{nolog['wall_paired_interval'][0]:.3f}, {nolog['wall_paired_interval'][1]:.3f}] and "
        f"[{sync['wall_paired_interval'][0]:.3f}, {sync['wall_paired_interval'][1]:.3f}]",
        f"Safe's own CPU per step: {own['nolog']['total_s']['median'] * 1e6:.0f} us without logging "
        f"({own['nolog']['training_thread_added_s']['median'] * 1e6:.0f} on the training thread, "
        f"{own['nolog']['own_threads_s']['median'] * 1e6:.0f} on its threads) and "
        f"{own['sync_dist']['total_s']['median'] * 1e6:.0f} us with the log",
        f"used {-per_value['cpu_added_s']['median'] * 1e6:.1f} us less CPU than stock's (median; 90% interval "
        f"[{low:.1f}, {high:.1f}])",
    )


def _k(instructions: float) -> str:
    return f"{instructions / 1000:,.1f}k"


@pytest.mark.parametrize("commit", ["d160373", "6c50b88"])
def test_instructions_per_step_table(commit: str):
    """bench/README.md's table of instructions per step: each run's medians, what safe adds, per `sync_dist` value."""
    modes = result(f"instructions_per_step-{commit}")["modes"]
    nolog, sync = modes["nolog"]["training"], modes["sync_dist"]["training"]
    cells = (
        f"| {commit} | `bench/results/instructions_per_step-{commit}.{{json,md}}` | "
        f"{_k(nolog['stock']['median'])} / {_k(nolog['safe']['median'])} (+{_k(nolog['added'])}) | "
        f"{_k(sync['stock']['median'])} / {_k(sync['safe']['median'])} (+{_k(sync['added'])}) | "
        f"+{_k(sync['added'] - nolog['added'])} |"
    )
    assert_on("bench/README.md", cells)


def test_instructions_per_step_readings():
    """bench/README.md's readings of the instruction counts: the share, the seeds' ranges, the rate, per value."""
    new, old = (result(f"instructions_per_step-{c}")["modes"] for c in ("6c50b88", "d160373"))
    nolog, sync = new["nolog"]["training"], new["sync_dist"]["training"]
    stock_cpu = next(
        row["cpu_step_s"]["median"]
        for row in result("tiny_step-intel-aa-d160373")["analysis"]["rows"]
        if (row["mode"], row["variant"]) == ("nolog", "stock")
    )
    rate = old["nolog"]["training"]["stock"]["median"] / (stock_cpu * 1e9)  # instructions per ns
    per_value = sync["added"] - nolog["added"]
    old_per_value = old["sync_dist"]["training"]["added"] - old["nolog"]["training"]["added"]
    stock_per_value = sync["stock"]["median"] - nolog["stock"]["median"]
    windows = [fit["window_s"] for fits in result("instructions_per_step-6c50b88")["fits"].values() for fit in fits]
    assert_on(
        "bench/README.md",
        f"safe adds {(nolog['ratio'] - 1) * 100:.2f}% to the training thread's instructions** (6c50b88: "
        f"{_k(nolog['added'])} on stock's {_k(nolog['stock']['median'])} per step; the seeds' ranges span "
        f"{_k(nolog['stock']['max'] - nolog['stock']['min'])} for stock and "
        f"{_k(nolog['safe']['max'] - nolog['safe']['min'])} for safe)",
        f"{_k(abs(old['nolog']['training']['added'] - nolog['added']))} apart",
        f"(its {_k(old['nolog']['training']['stock']['median'])} instructions in {stock_cpu * 1e3:.3f} ms of CPU per "
        f"step, {rate:.1f} per ns), {_k(nolog['added'])} instructions are about {nolog['added'] / rate / 1000:.0f} us",
        f"**Each `sync_dist` value adds {_k(per_value)} instructions**",
        f"{per_value / stock_per_value * 100:.1f}% of the {_k(stock_per_value)} that stock spends per value",
        f"Before 6c50b88 it was {_k(old_per_value)}",
        f"lasted {min(windows):.0f} to {max(windows):.0f} s at 6c50b88",
    )
    assert_on(
        "CHANGELOG.md",
        f"Without logging safe adds {(nolog['ratio'] - 1) * 100:.2f}% to the training thread's instructions; each "
        f"`sync_dist` value {_k(per_value)} instructions, {per_value / stock_per_value * 100:.1f}% of what stock "
        "spends",
        f"Python's warning machinery, {_k(old_per_value - per_value)} instructions)",
    )


def test_step_pauses_re_measured():
    """bench/README.md's 2026-11-28 bullet on point 2: no stretch over 1 ms, the longest ones, the epoch-start dumps."""
    safe = {
        commit: [f for f in result(f"step_pauses-intel-{commit}")["fits"] if f["variant"] == "safe"]
        for commit in ("de88abb", "e8781ec")
    }
    assert all(f["background_holds"]["over_1ms"] == 0 for fits in safe.values() for f in fits)
    new = safe["de88abb"]

    def ms(seconds: float) -> str:
        return f"{seconds * 1e3:.3f}"

    assert_on(
        "bench/README.md",
        f"(0 of {new[0]['background_holds']['stretches']} and 0 of {new[1]['background_holds']['stretches']}); the "
        f"longest, {ms(new[0]['background_holds']['longest']['cpu_s'])} and "
        f"{ms(new[1]['background_holds']['longest']['cpu_s'])} ms",
        f"(its C call {ms(new[0]['background_holds']['longest_c_call']['cpu_s'])} and "
        f"{ms(new[1]['background_holds']['longest_c_call']['cpu_s'])} ms)",
        f"its longest stretch was {ms(max(f['background_holds']['longest']['cpu_s'] for f in safe['e8781ec']))} ms",
        f"took up to {ms(new[0]['dumps']['longest_training_thread_wall_s'])} and "
        f"{ms(new[1]['dumps']['longest_training_thread_wall_s'])} ms of wall time "
        f"({ms(max(f['dumps']['longest_training_thread_wall_s'] for f in safe['e8781ec']))} ms in the earlier run)",
    )


def test_one_read_per_heartbeat_table_is_the_result_files():
    """bench/README.md's steady-state counts before and after the heartbeat's one read, from the result files."""
    runs = {n: result(f"control_plane_scale_heartbeat_{n}") for n in ("before", "after")}
    assert runs["before"]["source"]["commit"].startswith("328e16a") and not runs["before"]["source"]["dirty"]
    assert runs["after"]["source"]["commit"].startswith("a6ff6ae") and not runs["after"]["source"]["dirty"]
    rows = {
        n: {r["world"]: r for r in run["rows"] if r["kind"] == "measured" and r["state"] == "steady"}
        for n, run in runs.items()
    }
    assert set(rows["before"]) == set(rows["after"]) == {8, 64, 256}
    section = (ROOT / "bench/README.md").read_text().split("#### One read per heartbeat")[1]
    table = {
        cells[0]: cells[1:]
        for cells in ([c.strip() for c in ln.split("|")[1:-1]] for ln in section.splitlines() if ln.startswith("| "))
    }
    for world in (8, 64, 256):
        before, after = rows["before"][world], rows["after"][world]
        assert table[str(world)] == [
            f"{before['ops_per_rank_s']:.2f} -> {after['ops_per_rank_s']:.2f}",
            f"{before['background_ops_per_beat']:.2f} -> {after['background_ops_per_beat']:.2f}",
            f"{before['calls']['check']} -> {after['calls']['check']}",
        ]
        assert after["calls"]["check"] < 1.1 * world + 20  # each rank's first look at the next rank, the audit's
    before, after = rows["before"][256], rows["after"][256]
    assert_on(
        "bench/README.md",
        f"{before['server_cpu_s']:.2f} s -> {after['server_cpu_s']:.2f} s in the 6-s window",
        f"fell {(1 - after['keys'] / before['keys']) * 100:.0f}% ({before['keys']} -> {after['keys']})",
    )


def test_one_read_ab_table_is_the_result_files():
    """bench/README.md's A/B of the heartbeat's one read: medians, paired ratios and their spread from the result."""
    ab = result("strategy_cost_ab-one-read")
    assert ab["base"].startswith("328e16a") and ab["head"].startswith("eed46b7") and not ab["dirty"]
    assert len(ab["runs"]) == 6
    assert_ab_table(ab, "#### One store read per heartbeat")
    for workload, count in (("tiny", "five rounds of six"), ("mlp", "three of six")):
        ratios = ab["analysis"][workload]["Python threads"]["ratios"]
        assert_on("bench/README.md", "(ratios " * (workload == "tiny") + ", ".join(f"{r:.3f}" for r in ratios))
        assert sum(r < 1 for r in ratios) == {"five rounds of six": 5, "three of six": 3}[count]
        assert_on("bench/README.md", count)
    waits = [run[side]["mlp"]["idle_thread"] for run in ab["runs"] for side in ("base", "head")]
    assert_on("bench/README.md", f"{min(waits):.1f} to {max(waits):.1f} us per MLP step")
    spread = max(abs(r - 1) for w in ("mlp", "tiny") for r in ab["analysis"][w]["training thread"]["ratios"])
    assert_on("bench/README.md", f"moved by up to {spread * 100:.0f}% between")


def test_six_paired_diagnosis_runs_table_is_the_result_files():
    """bench/README.md's diagnosis of safe's excess without logging: the table and the figures its text quotes."""
    section = (ROOT / "bench/README.md").read_text().split("six paired runs (2026-11-29")[1].split("\n## ")[0]
    runs = {
        ("aa-no-background", "938748a"): ("safe / stock", "stock_again / stock"),
        ("bare", "938748a"): ("safe / stock", "safe_bare / stock", "safe / safe_bare", "stock_again / stock"),
        ("bare-no-desync", "938748a"): ("safe / stock", "safe_bare / stock", "safe / safe_bare"),
        ("recorder-off", "938748a"): ("safe / stock", "safe_bare / stock", "safe / safe_bare"),
        ("recorder", "938748a"): (
            "safe / stock",
            "stock_recorder / stock",
            "safe / stock_recorder",
            "safe / safe_bare",
        ),
        ("bare-unpinned", "d283005"): ("safe / stock_recorder", "safe / safe_bare"),
    }
    ratio_of: dict[tuple[str, str, str], dict[str, Any]] = {}
    cpu_of: dict[tuple[str, str], float] = {}  # safe / safe_bare, no logging: CPU ratios per run
    for (run, commit), ratios in runs.items():
        data = result(f"tiny_step-intel-{run}-{commit}")
        assert data["meta"]["git"] == f"commit {commit}"
        rows = {(r["mode"], r["ratio"]): r for r in data["analysis"]["ratios"]}
        for name in ratios:
            cells = [f"`{run}`", name]
            for mode in ("nolog", "sync_dist"):
                mean = rows[(mode, name)]["step_mean_s"]
                cells += [f"{mean['of_medians']:.3f}", "{median:.3f} [{min:.3f}, {max:.3f}]".format(**mean["paired"])]
                ratio_of[(run, name, mode)] = mean
            nolog = rows[("nolog", name)]
            cells += [f"{nolog[k]['of_medians']:.3f}" for k in ("cpu_step_s", "process_cpu_step_s")]
            if name == "safe / safe_bare":
                cpu_of.update({(run, k): nolog[k]["of_medians"] for k in ("cpu_step_s", "process_cpu_step_s")})
            assert f"| {' | '.join(cells)} |" in section, cells
    assert result("tiny_step-intel-recorder-off-938748a")["meta"]["environment"] == {"TORCH_FR_BUFFER_SIZE": "0"}
    assert result("tiny_step-intel-bare-unpinned-d283005")["config"]["bare_unpinned"] is True

    def of(run: str, name: str, mode: str = "nolog") -> str:
        return f"{ratio_of[(run, name, mode)]['of_medians']:.3f}"

    def paired(run: str, name: str) -> str:
        return f"{ratio_of[(run, name, 'nolog')]['paired']['median']:.3f}"

    text = " ".join(section.split())
    recorder = ("recorder", "stock_recorder / stock")
    assert f"{of(*recorder)} without logging and {of(*recorder, 'sync_dist')} with a `sync_dist` log" in text
    bare, no_desync = ("bare", "safe / stock"), ("bare-no-desync", "safe / stock")
    assert f"{of(*bare)} and {of('bare', 'safe / safe_bare')} (`bare`)" in text
    assert f"{of(*no_desync)} and {of('bare-no-desync', 'safe / safe_bare')} (`bare-no-desync`; paired medians" in text
    assert f"medians {paired(*no_desync)} and {paired('bare-no-desync', 'safe / safe_bare')})" in text
    by_recorder = [of("recorder", n) for n in ("safe / stock", "safe / stock_recorder", "safe / safe_bare")]
    assert "{}, {} and {} (`recorder`;".format(*by_recorder) in text
    assert ratio_of[("recorder", "safe / stock_recorder", "nolog")]["paired"]["min"] > 1  # "longer in all 10 rounds"
    assert f"but {of('bare-unpinned', 'safe / stock_recorder')} against stock with the recorder on" in text
    assert f"{of('aa-no-background', 'safe / stock')} against stock (`aa-no-background`)" in text
    off = (of("recorder-off", "safe / stock"), of("recorder-off", "safe / safe_bare"))
    assert "{} against stock and {} against `safe_bare` (`recorder-off`)".format(*off) in text
    spread = sorted(of(run, "safe / stock_recorder") for run in ("recorder", "bare-unpinned"))
    assert f"({spread[0]} to {spread[1]} for safe against stock with the recorder)" in text
    for key, quoted in (("cpu_step_s", "safe's is {} to {} of"), ("process_cpu_step_s", "(process CPU {} to {} of")):
        values = sorted(f"{cpu_of[(run, key)]:.3f}" for run in ("bare", "bare-no-desync", "recorder"))
        assert quoted.format(values[0], values[-1]) in text, key
    unpinned = ratio_of[("bare-unpinned", "safe / safe_bare", "nolog")]
    assert (
        f"{unpinned['of_medians']:.3f} (paired median {{median:.3f}} [{{min:.3f}}, {{max:.3f}}])".format(
            **unpinned["paired"]
        )
        in text
    )
    sync = sorted(of(run, "safe / stock", "sync_dist") for (run, _), ratios in runs.items() if "safe / stock" in ratios)
    assert f"every run ({sync[0]} to {sync[-1]}; {of('bare-unpinned', 'safe / stock_recorder', 'sync_dist')}" in text
    defaults = sorted(of(run, "safe / stock") for run in ("bare", "bare-no-desync", "recorder"))
    assert f"have stock ({defaults[0]} to {defaults[-1]})" in text
    for run in ("aa-no-background", "recorder-off"):
        assert all(ratio_of[(run, "safe / stock", m)]["of_medians"] <= 1.02 for m in ("nolog", "sync_dist"))
    chunks: dict[str, list[float]] = {}
    for fit in result("tiny_step-intel-bare-no-desync-938748a")["fits"]:
        if fit["mode"] == "nolog":
            chunks.setdefault(fit["variant"], []).extend(fit["ranks"][0]["chunk_means_us"])
    safe, plain = (sorted(chunks[v]) for v in ("safe", "safe_bare"))
    assert f"(10th percentile {safe[len(safe) // 10]:.0f} against {plain[len(plain) // 10]:.0f} us" in text
    assert f"median {safe[len(safe) // 2]:.0f} against {plain[len(plain) // 2]:.0f})" in text
    own = sorted(
        result(f"tiny_step-intel-{run}-938748a")["analysis"]["own_cpu_per_step"]["nolog"]["own_threads_s"]["median"]
        for run in ("bare", "bare-no-desync", "recorder")
    )
    assert f"{own[0] * 1e6:.1f} to {own[-1] * 1e6:.1f} us of CPU per step without logging" in text


def test_seventh_diagnosis_run_without_heartbeat_table_is_the_result_file():
    """bench/README.md's seventh tiny-step run (the recorder on, no heartbeat or monitor): its table and figures."""
    section = (ROOT / "bench/README.md").read_text().split("#### A seventh run")[1].split("\n## ")[0]
    data = result("tiny_step-intel-no-heartbeat-4f2c0d9")
    assert data["meta"]["git"] == "commit 4f2c0d9"
    assert data["config"]["bare_kwargs"] == {"heartbeat_interval": 0}
    rows = {(r["mode"], r["ratio"]): r for r in data["analysis"]["ratios"]}
    for name in ("safe / stock_recorder", "safe / safe_bare"):
        cells = ["`no-heartbeat`", name]
        for mode in ("nolog", "sync_dist"):
            mean = rows[(mode, name)]["step_mean_s"]
            cells += [f"{mean['of_medians']:.3f}", "{median:.3f} [{min:.3f}, {max:.3f}]".format(**mean["paired"])]
        nolog = rows[("nolog", name)]
        cells += [f"{nolog[k]['of_medians']:.3f}" for k in ("cpu_step_s", "process_cpu_step_s")]
        assert f"| {' | '.join(cells)} |" in section, cells
    text = " ".join(section.split())
    recorder, bare = (rows[("nolog", n)]["step_mean_s"] for n in ("safe / stock_recorder", "safe / safe_bare"))
    unpinned = result("tiny_step-intel-bare-unpinned-d283005")["analysis"]["ratios"]
    (earlier,) = [r for r in unpinned if r["mode"] == "nolog" and r["ratio"] == "safe / stock_recorder"]
    assert f"is {recorder['of_medians']:.3f} without logging" in text
    assert f"as in `bare-unpinned` ({earlier['step_mean_s']['of_medians']:.3f})" in text
    assert f"monitor {bare['of_medians']:.3f} (paired median {bare['paired']['median']:.3f})" in text


def _ratio_row(data: dict[str, Any], mode: str, name: str) -> dict[str, Any]:
    (row,) = [r for r in data["analysis"]["ratios"] if r["mode"] == mode and r["ratio"] == name]
    return row


POOLED_RUNS = {
    "`bare-no-desync` (938748a)": "tiny_step-intel-bare-no-desync-938748a",
    "`split-1`": "tiny_step-intel-split-1-7eee835",
    "`split-2`": "tiny_step-intel-split-2-7eee835",
    "`split-3`": "tiny_step-intel-split-3-7eee835",
    "pooled, 40 rounds": "tiny_step-intel-pooled-4-runs-938748a-code",
}
RECORDER_RUNS = {
    "`recorder` (938748a)": "tiny_step-intel-recorder-938748a",
    "`recorder-1`": "tiny_step-intel-recorder-1-79cfb6f",
    "`recorder-2`": "tiny_step-intel-recorder-2-79cfb6f",
    "pooled, 30 rounds": "tiny_step-intel-pooled-recorder-3-runs-938748a-code",
}


def _pooled_row(label: str, data: dict[str, Any], *others: str) -> str:
    """A row of bench/README.md's pooled tables: safe / stock (nolog: of medians, paired, interval; sync_dist), then
    the ``others`` ratios without logging."""
    nolog, synced = (_ratio_row(data, m, "safe / stock")["step_mean_s"] for m in ("nolog", "sync_dist"))
    low, high = nolog["paired_interval"]
    cells = [
        label,
        f"{nolog['of_medians']:.3f}",
        "{median:.3f} [{min:.3f}, {max:.3f}]".format(**nolog["paired"]),
        f"[{low:.3f}, {high:.3f}]",
        f"{synced['of_medians']:.3f}",
        *(f"{_ratio_row(data, 'nolog', name)['step_mean_s']['of_medians']:.3f}" for name in others),
    ]
    return f"| {' | '.join(cells)} |"


def test_eight_runs_pooled_by_configuration_tables_breakdown_and_figures_are_the_result_files():
    """bench/README.md's runs of the package code of 938748a, their two pools, and the first pool's step breakdown."""
    section = (ROOT / "bench/README.md").read_text().split("### Eight runs of one package code")[1].split("\n## ")[0]
    for label, name in POOLED_RUNS.items():
        assert _pooled_row(label, result(name), "safe_bare / stock", "safe / safe_bare") in section, label
    for label, name in RECORDER_RUNS.items():
        row = _pooled_row(label, result(name), "stock_recorder / stock", "safe / stock_recorder", "safe / safe_bare")
        assert row in section, label
    first, second = (result(runs[max(runs)]) for runs in (POOLED_RUNS, RECORDER_RUNS))
    assert [s["run"] for s in first["pooled_from"]] == list(POOLED_RUNS.values())[:-1]
    assert [s["run"] for s in second["pooled_from"]] == list(RECORDER_RUNS.values())[:-1]
    assert first["config"]["rounds"] == 40 and second["config"]["rounds"] == 30
    breakdown = {b["variant"]: b for b in first["analysis"]["step_breakdown"] if b["mode"] == "nolog"}
    parts = ("step_mean_s", "cpu_step_s", "runqueue_wait_s", "asleep_s")
    for variant, b in breakdown.items():
        cells = [
            f"`{variant}`",
            *(f"{b[n]['median'] * 1e6:.0f}" for n in parts),
            f"{b['voluntary_switches']['median']:.2f}",
        ]
        cells += [f"{b[f'{n}_added']['median'] * 1e6:+.0f}" if b[f"{n}_added"] else "-" for n in parts]
        assert f"| {' | '.join(cells)} |" in section, cells
    text = " ".join(section.split())
    for data in (first, second):
        nolog = _ratio_row(data, "nolog", "safe / stock")["step_mean_s"]
        low, high = nolog["paired_interval"]
        assert f"{nolog['of_medians']:.3f} (paired median {nolog['paired']['median']:.3f}, " in text
        assert f"[{low:.3f}, {high:.3f}])" in text
    # every run of this package code with stock and safe at its defaults: each run's own ratio
    names = [*list(POOLED_RUNS.values())[:-1], *list(RECORDER_RUNS.values())[:-1], "tiny_step-intel-bare-938748a"]
    runs = sorted(_ratio_row(result(n), "nolog", "safe / stock")["step_mean_s"]["of_medians"] for n in names)
    assert len(runs) == 8
    bare = _ratio_row(result("tiny_step-intel-bare-938748a"), "nolog", "safe / stock")["step_mean_s"]["of_medians"]
    assert f"the seven above and `bare`, {bare:.3f})" in text
    assert (
        f"gave {runs[0]:.3f} to {runs[-1]:.3f} without logging, {sum(r <= 1.02 for r in runs)} of 8 at most 1.02"
        in text
    )
    assert f"median {(runs[3] + runs[4]) / 2:.3f}" in text
    clustered = [data["analysis"]["run_resampled_interval"]["nolog"] for data in (first, second)]
    assert (
        "interval is [{:.3f}, {:.3f}] in the first pool and [{:.3f}, {:.3f}] in the second".format(
            *clustered[0], *clustered[1]
        )
        in text
    )
    for data, label in ((first, "in the first pool"), (second, "in the second")):
        against = _ratio_row(data, "nolog", "safe / safe_bare")["step_mean_s"]
        assert f"{against['of_medians']:.3f} (paired median {against['paired']['median']:.3f}) {label}" in text or (
            f"{against['of_medians']:.3f} (paired {against['paired']['median']:.3f}) {label}" in text
        ), label
    bare_ratios = [_ratio_row(d, "nolog", "safe_bare / stock")["step_mean_s"]["of_medians"] for d in (first, second)]
    assert "safe without it against stock {:.3f} and {:.3f}".format(*bare_ratios) in text
    recorder = _ratio_row(second, "nolog", "stock_recorder / stock")["step_mean_s"]["of_medians"]
    by_run = ", ".join(
        f"{_ratio_row(result(n), 'nolog', 'stock_recorder / stock')['step_mean_s']['of_medians']:.3f}"
        for n in list(RECORDER_RUNS.values())[:-1]
    )
    recorder_line = f"stock with it at 32 against stock at torch's default of 2000, {recorder:.3f} pooled"
    assert f"{recorder_line} ({by_run} by run)" in text
    against = _ratio_row(first, "nolog", "safe / safe_bare")
    assert f"(CPU ratio {against['cpu_step_s']['of_medians']:.3f} pooled)" in text
    safe, bare_b = breakdown["safe"], breakdown["safe_bare"]
    assert safe["voluntary_switches"]["median"] == pytest.approx(bare_b["voluntary_switches"]["median"], abs=0.005)
    asleep = (safe["asleep_s"]["median"] - bare_b["asleep_s"]["median"]) * 1e6
    assert 60 <= asleep <= 80 and "about 70 us more per step" in text
    assert f"medians {safe['asleep_s']['median'] * 1e6:.0f} against {bare_b['asleep_s']['median'] * 1e6:.0f}" in text
    assert f"(paired medians {safe['cpu_step_s_added']['median'] * 1e6:+.0f} and" in text
    synced = _ratio_row(first, "sync_dist", "safe / stock")["step_mean_s"]
    assert f"safe is {synced['of_medians']:.3f} in the first pool" in text


def test_step_pauses_remeasured_on_the_afternoon_of_2026_11_29_are_the_result_file():
    """bench/README.md's point 2 re-measure at 7eee835: stretches over 1 ms, the longest's sites, the step-hook gaps."""
    section = (
        (ROOT / "bench/README.md").read_text().split("#### Re-measured 2026-11-29, afternoon")[1].split("\n## ")[0]
    )
    text = " ".join(section.split())
    fits = result("step_pauses-intel-7eee835")["fits"]
    safe = [f for f in fits if f["variant"] == "safe"]
    stock = [f for f in fits if f["variant"] == "stock"]
    holds = [f["background_holds"] for f in safe]
    assert [f["round"] for f in safe] == [1, 2]
    counts = " and ".join(f"{h['over_1ms']} of {h['stretches']}" for h in holds)
    assert f"{counts} background stretches over 1 ms" in text
    assert all(h["longest"]["from"] == "threading.py:331" and h["longest"]["to"] == "heartbeat.py:192" for h in holds)
    longest = " and ".join(f"{h['longest']['cpu_s'] * 1e3:.3f}" for h in holds)
    assert f"the longest, {longest} ms, run from the heartbeat thread's wake-up" in text
    audit = [s["cpu_s"] for h in holds for s in h["longest_by_sites"] if s["from"] == s["to"] == "desync_audit.py:54"]
    assert f"dump and its settling {min(audit) * 1e3:.2f}-{max(audit) * 1e3:.2f} ms" in text
    collection = safe[1]["garbage_collections"]["longest"]
    assert collection["thread"] == "ddp_strategy-heartbeat-rank0" and collection["generation"] == 0
    assert f"{collection['wall_s'] * 1e3:.1f} ms (generation 0), ran on the heartbeat thread in round 2" in text

    def gaps(runs: list[dict[str, Any]], key: str) -> str:
        return " and ".join(f"{f['hook_gaps'][key] * 1e3:.2f}" for f in sorted(runs, key=lambda f: f["round"]))

    assert f"99.9th percentile {gaps(safe, 'p999_s')} ms against stock's {gaps(stock, 'p999_s')}" in text
    assert f"the longest {gaps(safe, 'max_s')} ms against {gaps(stock, 'max_s')}" in text


def test_step_pauses_with_garbage_collections_apart_are_the_result_file():
    """bench/README.md's second afternoon run of step_pauses: no stretch over 1 ms ran a collection; CPU above wall."""
    section = (
        (ROOT / "bench/README.md").read_text().split("#### Re-measured 2026-11-29, afternoon")[1].split("\n## ")[0]
    )
    text = " ".join(section.split())
    holds = [f["background_holds"] for f in result("step_pauses-intel-gc-233102d")["fits"] if f["variant"] == "safe"]
    counts = " and ".join(f"{h['over_1ms']} of {h['stretches']}" for h in holds)
    assert f"{counts} stretches over 1 ms, none of them with a garbage collection" in text
    assert all(h["over_1ms_with_collection"] == 0 and h["with_collection"] == 1 for h in holds)
    longest = [h["longest"] for h in holds]
    assert all(not s["garbage_collection"] for s in longest)
    assert all(s["cpu_s"] > s["wall_s"] > 1e-3 for s in longest[1:])  # round 2: CPU ahead of the wall clock
    cpu = " and ".join(f"{s['cpu_s'] * 1e3:.3f}" for s in longest)
    wall = " and ".join(f"{s['wall_s'] * 1e3:.3f}" for s in longest)
    assert f"took {cpu} ms of thread CPU but {wall} ms of wall time" in text


#: the tiny-step runs with the Flight Recorder's ring of 8 (README.md's tiny-model row; bench/README.md)
RING8_RUNS = (
    *((n, f"tiny_step-ring8-{n}-1a09e77") for n in (1, 2, 3, 4)),
    (5, "tiny_step-ring8-5-24825e3"),
    (6, "tiny_step-ring8-6-724a2e9"),
)


def test_readme_tiny_step_row_is_the_eight_runs_of_the_current_package_code():
    """README.md's tiny-model row: the spread, median and count of the eight runs, and the sync_dist range."""
    row = next(line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("| a tiny model's"))
    names = [
        *list(POOLED_RUNS.values())[:-1],
        *list(RECORDER_RUNS.values())[:-1],
        "tiny_step-intel-bare-938748a",
    ]
    nolog = sorted(_ratio_row(result(n), "nolog", "safe / stock")["step_mean_s"]["of_medians"] for n in names)
    synced = sorted(_ratio_row(result(n), "sync_dist", "safe / stock")["step_mean_s"]["of_medians"] for n in names)
    assert f"without logging {nolog[0]:.3f} to {nolog[-1]:.3f} by run (median {(nolog[3] + nolog[4]) / 2:.3f}, " in row
    assert f"{sum(r <= 1.02 for r in nolog)} of 8 at most 1.02" in row
    assert f"{synced[0]:.3f} to {synced[-1]:.3f} with `self.log(..., sync_dist=True)`" in row
    assert "#eight-runs-of-one-package-code-pooled-by-configuration-and-the-step-split-by-the-scheduler" in row
    added = result("instructions_per_step-recorder-77f4468")["modes"]["nolog"]["training"]["ratio"]
    assert f"add {(added - 1) * 100:.2f}% to the training thread's instructions" in row
    ring16 = [
        _ratio_row(result(n), "nolog", "safe / stock")["step_mean_s"]["of_medians"]
        for n in list(RING16_RUNS.values())[:-1]
    ]
    pooled = _ratio_row(result(RING16_RUNS["pooled, 40 rounds"]), "nolog", "safe / stock")["step_mean_s"]
    assert (
        f"{min(ring16):.3f} to {max(ring16):.3f} by run with the ring of 16 ({pooled['of_medians']:.3f} pooled" in row
    )
    assert "four with the ring of 16 (until 2026-12-02), six with today's ring of 8" in row and len(ring16) == 4
    assert len(RING8_RUNS) == 6
    beat = _ratio_row(result("tiny_step-intel-inline-beat-96bc357"), "nolog", "safe / stock")["step_mean_s"]
    assert (
        f"{beat['of_medians']:.3f} in one run since the heartbeat's beat moved to the training thread (96bc357; "
        f"paired median {beat['paired']['median']:.3f})" in row
    )
    pool = _ratio_row(result("tiny_step-intel-pooled-dump-step-3-runs"), "nolog", "safe / stock")
    by_run = [_ratio_row(result(f"tiny_step-intel-dump-step-{n}-c46ad94"), "nolog", "safe / stock") for n in (1, 2, 3)]
    runs = ", ".join(f"{r['step_mean_s']['of_medians']:.3f}" for r in by_run)
    assert (
        f"{pool['step_mean_s']['of_medians']:.3f} pooled over three runs at c46ad94 ({runs} by run; the training "
        f"thread's CPU {pool['cpu_step_s']['of_medians']:.3f})" in row
    )
    ring8 = [_ratio_row(result(name), "nolog", "safe / stock") for _, name in RING8_RUNS]
    means = [r["step_mean_s"]["of_medians"] for r in ring8]
    pool8 = result("tiny_step-pooled-ring8-6-runs-724a2e9")
    assert [s["run"] for s in pool8["pooled_from"]] == [name for _, name in RING8_RUNS]
    share = _ratio_row(pool8, "nolog", "safe / safe_bare")["step_mean_s"]["of_medians"]
    assert (
        f"{_ratio_row(pool8, 'nolog', 'safe / stock')['step_mean_s']['of_medians']:.3f} pooled over six runs with "
        f"the ring of 8 ({min(means):.3f} to {max(means):.3f} by run; desync detection's share {share:.3f}; with no "
        "background thread at all the excess stays" in row
    )
    # "with no background thread at all the excess stays": safe_bare without a heartbeat, by CPU, every round
    alone = _ratio_row(result("tiny_step-no-heartbeat-24825e3"), "nolog", "safe_bare / stock")
    assert alone["cpu_step_s"]["paired"]["min"] > 1.0
    hooks = result("strategy_cost-tiny-24825e3")["workloads"][0]["own_per_method_s"]
    per_step = sum(
        v for k, v in hooks.items() if k not in ("reduce", "self.log wrapper")
    )  # what a step without a log pays
    assert 45e-6 < per_step < 55e-6 and "the strategy's per-step hooks, about 50 us of CPU" in row


def test_where_safes_added_instructions_go_is_the_result_files():
    """bench/README.md's split of the training thread's instructions (the recorder's record, the rest) and opcodes."""
    readme = (ROOT / "bench/README.md").read_text()
    section = readme.split("### Where safe's added instructions go")[1].split("\n## ")[0]
    text = " ".join(section.split())
    nolog = result("instructions_per_step-recorder-77f4468")["modes"]["nolog"]
    variants = ("stock", "stock_recorder", "safe", "safe_no_recorder")

    def cell(kind: str, variant: str) -> str:
        median = _k(nolog[kind][variant]["median"])
        if variant == "stock":
            return median
        added = nolog[kind]["vs_stock"][variant]
        return f"{median} ({'+' if added >= 0 else '-'}{_k(abs(added))})"

    training = " | ".join(cell("training", v) for v in variants)
    assert f"| training thread | {training} |" in text
    recorder = " | ".join(_k(nolog["recorder"][v]["median"]) for v in variants)
    assert f"| of it, the recorder's `record` | {recorder} |" in text
    rest = [cell("training_less_recorder", v) for v in variants]
    assert f"| of it, the rest | {' | '.join(rest)} |" in text
    t, r = nolog["training"], nolog["training_less_recorder"]
    against_same_ring = t["safe"]["median"] - t["stock_recorder"]["median"]
    safe_t, same_ring_t = _k(t["safe"]["median"]), _k(t["stock_recorder"]["median"])
    assert f"safe adds {_k(against_same_ring)} ({safe_t} against {same_ring_t})" in text
    assert f"{_k(r['safe']['median'] - r['stock_recorder']['median'])} of them outside the recorder" in text
    assert f"it adds {_k(t['added'])} ({(t['ratio'] - 1) * 100:.2f}%)" in text
    assert f"saves stock {_k(-t['vs_stock']['stock_recorder'])} instructions per step**, " in text
    assert f"{_k(-r['vs_stock']['stock_recorder'])} of them outside `record`" in text
    assert f"safe counts {_k(-t['vs_stock']['safe_no_recorder'])} fewer than stock" in text
    rec = nolog["recorder"]
    stock_rec, safe_rec = _k(rec["stock"]["median"]), _k(rec["safe"]["median"])
    assert f"takes {stock_rec} instructions per step in stock and {safe_rec} in safe" in text
    opcodes = result("call_count-opcodes")["modes"]["nolog"]
    counts, added = opcodes["calls_per_step"], opcodes["added_per_step"]
    assert f"stock runs {counts['stock']:,.0f} bytecode instructions per step and safe {counts['safe']:,.0f}" in text
    assert f"(+{counts['safe'] - counts['stock']:.0f})" in text
    loop = added["call.py:203(_call_callback_hooks)"]
    assert f"turning over the strategy's three callbacks | +{loop:.1f} |" in text
    batch_start = sum(added[k] for k in added if k.split(":")[0] in (
        "lifecycle.py", "heartbeat.py", "weight_checks.py", "lightning.py", "trainable.py", "control.py"
    )) + added["strategy.py:251(on_train_batch_start)"]  # fmt: skip
    step = sum(added[k] for k in ("strategy.py:289(optimizer_step)", "bucket_layout.py:196(after_optimizer_step)",
                                  "strategy.py:352(model)", "saving.py:123(closure_waiting_for_snapshot)"))  # fmt: skip
    assert f"the desync check) | +{batch_start:.0f} |" in text
    assert f"`model`) | +{step:.0f} |" in text
    assert f"`post_backward` | +{added['strategy.py:283(post_backward)']:.0f} |" in text
    assert batch_start + step + loop + added["strategy.py:283(post_backward)"] == pytest.approx(sum(added.values()))
    assert f"about {round(loop / 18)} bytecodes" in text  # three callbacks, six per-batch hooks
    assert f"an estimated {round(loop * 12 / 18, -1):.0f} bytecodes fewer" in text


@pytest.mark.parametrize(
    ("run", "label"),
    [("step_pauses-intel-sched-97770d8", "ring of 32"), ("step_pauses-intel-ring16-b98ada2", "ring of 16")],
)
def test_step_pauses_split_by_the_scheduler_is_the_result_file(run: str, label: str):
    """bench/README.md's table of the background stretches split by the scheduler's counts, per run and round."""
    fits = result(run)["fits"]
    for fit in (f for f in fits if f["variant"] == "safe"):
        holds = fit["background_holds"]
        longest = holds["longest_by_wall"]
        wall, on_core, runnable = longest["wall_less_profiling_s"], longest["on_core_s"], longest["runnable_s"]
        assert max(0.0, wall - on_core - runnable) < 0.0005  # "the rest" shows as 0.000
        assert on_core < 1e-3
        row = (
            f"| {label} | {fit['round']} | {holds['stretches']} | {holds['over_1ms']} | {holds['over_1ms_wall']} | "
            f"{holds['over_1ms_on_core']} | {holds['longest']['cpu_s'] * 1e3:.3f} | "
            f"{holds['longest_c_call']['cpu_s'] * 1e3:.3f} | "
            f"{wall * 1e3:.3f} ({on_core * 1e3:.3f} / {runnable * 1e3:.3f}) |"
        )
        assert_on("bench/README.md", row)
    if label == "ring of 16":
        safe = [f for f in fits if f["variant"] == "safe"]
        stock = [f for f in fits if f["variant"] == "stock"]
        gaps = "safe {} and {} ms against stock's {} and {}".format(
            *(f"{f['hook_gaps']['p999_s'] * 1e3:.3f}" for f in (*safe, *stock))
        )
        assert_on("bench/README.md", f"The step-hook gaps, 99.9th percentile: {gaps}")


def test_tiny_step_run_with_the_ring_of_16_is_the_result_file():
    """bench/README.md's one tiny-step run after the ring went to 16 entries: its row and the figures quoted."""
    data = result("tiny_step-intel-ring16-ed5b76a")
    assert data["config"]["variants"] == ["stock", "safe", "safe_bare"]
    assert data["config"]["bare_kwargs"] == {"desync_detection": False}
    row = _pooled_row("`ring16` (b98ada2)", data, "safe_bare / stock", "safe / safe_bare")
    assert_on("bench/README.md", row)
    nolog = _ratio_row(data, "nolog", "safe / stock")["step_mean_s"]["of_medians"]
    synced = _ratio_row(data, "sync_dist", "safe / stock")["step_mean_s"]["of_medians"]
    cpu = _ratio_row(data, "nolog", "safe / safe_bare")["cpu_step_s"]["of_medians"]
    pooled = _ratio_row(result(POOLED_RUNS["pooled, 40 rounds"]), "nolog", "safe / safe_bare")["cpu_step_s"]
    assert_on(
        "bench/README.md",
        f"**Point 3 without logging is missed in this run** ({nolog:.3f})",
        f"With the `sync_dist` log safe is {synced:.3f}.",
        f"(CPU ratio {cpu:.3f}, against {pooled['of_medians']:.3f} pooled over the earlier runs of this configuration)",
    )
    assert nolog > 1.02


RING16_RUNS = {
    "`ring16` (b98ada2)": "tiny_step-intel-ring16-ed5b76a",
    "`ring16-2`": "tiny_step-intel-ring16-2-e161607",
    "`ring16-3`": "tiny_step-intel-ring16-3-e161607",
    "`ring16-4`": "tiny_step-intel-ring16-4-e161607",
    "pooled, 40 rounds": "tiny_step-intel-pooled-ring16-4-runs",
}


def test_tiny_step_four_runs_with_the_ring_of_16_pooled_are_the_result_files():
    """bench/README.md's four runs at the ring of 16, their pool, and the figures quoted under the table."""
    readme = (ROOT / "bench/README.md").read_text()
    section = " ".join(
        readme.split("#### The tiny-model step with the ring of 16: four runs pooled")[1].split("####")[0].split()
    )
    for label, name in RING16_RUNS.items():
        assert _pooled_row(label, result(name), "safe_bare / stock", "safe / safe_bare") in readme, label
    pool = result(RING16_RUNS["pooled, 40 rounds"])
    assert [s["run"] for s in pool["pooled_from"]] == list(RING16_RUNS.values())[:-1]
    nolog = _ratio_row(pool, "nolog", "safe / stock")["step_mean_s"]
    low, high = pool["analysis"]["run_resampled_interval"]["nolog"]
    assert f"**Point 3 without logging stays missed, by a hair**: {nolog['of_medians']:.3f} pooled" in section
    assert (
        f"(paired median {nolog['paired']['median']:.3f}; resampling runs, then rounds within them, "
        f"[{low:.3f}, {high:.3f}])" in section
    )
    runs = [
        _ratio_row(result(n), "nolog", "safe / stock")["step_mean_s"]["of_medians"]
        for n in list(RING16_RUNS.values())[:-1]
    ]
    assert (
        f"by run {min(runs):.3f} to {max(runs):.3f}, {sum(r <= 1.02 for r in runs)} of 4 at most 1.02, "
        f"median {statistics.median(runs):.3f}" in section
    )
    synced = _ratio_row(pool, "sync_dist", "safe / stock")["step_mean_s"]["of_medians"]
    assert f"`sync_dist` log safe is {synced:.3f} pooled" in section
    assert nolog["of_medians"] > 1.02

    def cpu(name: str, ratio: str) -> float:
        return float(_ratio_row(result(name), "nolog", ratio)["cpu_step_s"]["of_medians"])

    new = list(RING16_RUNS.values())[1:-1]
    against_bare = ", ".join(f"{cpu(n, 'safe / safe_bare'):.3f}" for n in new[:-1])
    assert f"{against_bare} and {cpu(new[-1], 'safe / safe_bare'):.3f} in the three new runs" in section
    assert f"{cpu(RING16_RUNS['pooled, 40 rounds'], 'safe / safe_bare'):.3f} pooled (" in section
    bare = [_ratio_row(result(n), "nolog", "safe_bare / stock")["step_mean_s"]["of_medians"] for n in new[1:]]
    assert f"was itself {bare[0]:.3f} and {bare[1]:.3f} of stock" in section
    by_run = [cpu(n, "safe / stock") for n in list(RING16_RUNS.values())[:-1]]
    pooled_cpu = cpu(RING16_RUNS["pooled, 40 rounds"], "safe / stock")
    assert (
        f"safe's CPU per step is {min(by_run):.3f} to {max(by_run):.3f} of stock's by run, {pooled_cpu:.3f} pooled"
        in section
    )
    assert f"`safe_bare`'s {cpu(RING16_RUNS['pooled, 40 rounds'], 'safe_bare / stock'):.3f} pooled" in section


def test_what_merging_the_callbacks_would_save_is_the_result_file():
    """bench/README.md's table of bench/callback_turns.py and the per-turn and merge figures."""
    data = result("callback_turns")
    a, measured = data["analysis"], data["measured"]
    for name in ("stock", "safe", "merged"):
        added = a["added_us"].get(name)
        cell = f"{added['median']:+.2f} [{added['min']:+.2f}, {added['max']:+.2f}]" if added else "-"
        assert_on(
            "bench/README.md", f"| {name} | {measured['callbacks'][name]} | {a['median_us'][name]:.2f} | {cell} |"
        )
    assert data["rounds"] == 15 and data["calls"] == 5000 and data["repeats"] == 3
    assert measured["callbacks"]["safe"] == 3  # a default fit's: ShardingCheck, WeightSyncCheck, PreemptionStop
    assert_on(
        "bench/README.md",
        f"A turn of a callback whose hook is skipped costs {a['per_turn_us'] * 1000:.0f} ns.",
        f"Merging the three callbacks into one would save {a['merge_saves_us']:.2f} us",
        f"Timed, that is worth {a['merge_saves_us']:.2f} us per step with hot caches",
    )


BARE_RING16_RUNS = {
    "`bare-ring16-1`": "tiny_step-intel-bare-ring16-1-e161607",
    "`bare-ring16-2`": "tiny_step-intel-bare-ring16-2-e161607",
    "`bare-ring16-3`": "tiny_step-intel-bare-ring16-3-e161607",
    "pooled, 30 rounds": "tiny_step-intel-pooled-bare-ring16-3-runs",
}


def test_desync_detection_at_the_same_ring_is_the_result_files():
    """bench/README.md's three runs with safe_bare at the strategy's ring, their pool, and the figures quoted."""
    readme = (ROOT / "bench/README.md").read_text()
    section = " ".join(readme.split("#### Desync detection at the same ring")[1].split("####")[0].split())

    def cpu(data: dict[str, Any], ratio: str) -> str:
        return f"{_ratio_row(data, 'nolog', ratio)['cpu_step_s']['of_medians']:.3f}"

    for label, name in BARE_RING16_RUNS.items():
        data = result(name)
        assert data["config"]["bare_kwargs"] == {"desync_detection": False} and data["config"]["bare_recorder"]
        row = _pooled_row(label, data, "safe_bare / stock", "safe / safe_bare")[:-1]
        cells = (cpu(data, r) for r in ("safe / stock", "safe_bare / stock", "safe / safe_bare"))
        assert f"{row}| {' | '.join(cells)} |" in readme, label
    pool = result(BARE_RING16_RUNS["pooled, 30 rounds"])
    runs = [result(n) for n in list(BARE_RING16_RUNS.values())[:-1]]

    def ratio(data: dict[str, Any], name: str, mode: str = "nolog") -> dict[str, Any]:
        return dict(_ratio_row(data, mode, name)["step_mean_s"])

    by_run = [ratio(r, "safe / safe_bare")["of_medians"] for r in runs]
    assert f"0.997 pooled ({min(by_run):.3f} to {max(by_run):.3f} by run)" in section
    assert f"{ratio(pool, 'safe / safe_bare')['of_medians']:.3f} pooled" in section
    assert f"its training thread's CPU {cpu(pool, 'safe / safe_bare')}" in section
    assert f"is itself {ratio(pool, 'safe_bare / stock')['of_medians']:.3f} of stock pooled" in section
    assert f"uses {cpu(pool, 'safe_bare / stock')} of stock's CPU (safe {cpu(pool, 'safe / stock')})" in section
    safe = [ratio(r, "safe / stock")["of_medians"] for r in runs]
    assert f"each run {min(safe):.3f} to {max(safe):.3f} (0 of 3 at most 1.02)" in section and min(safe) > 1.02
    low, high = pool["analysis"]["run_resampled_interval"]["nolog"]
    paired = ratio(pool, "safe / stock")["paired"]["median"]
    assert (
        f"paired median {paired:.3f} pooled, 90% interval resampling runs, then rounds within them, "
        f"[{low:.3f}, {high:.3f}]" in section
    )
    pooled = ratio(pool, "safe / stock")["of_medians"]
    assert f"{pooled:.3f}, is lower than every run's" in section and pooled < min(safe)
    assert f"safe is {ratio(pool, 'safe / stock', 'sync_dist')['of_medians']:.3f} pooled" in section


def test_the_simulated_caches_are_the_result_file():
    """bench/README.md's table of callgrind's cache simulation: instructions and simulated misses per step."""
    nolog = result("instructions_per_step-cache-503b4a2")["modes"]["nolog"]
    t, l1, ll = nolog["training"], nolog["l1_misses"], nolog["ll_misses"]

    def pct(row: dict[str, Any]) -> str:
        return f"{(row['ratio'] - 1) * 100:.2f}%"

    assert_on(
        "bench/README.md",
        f"| instructions | {_k(t['stock']['median'])} | {_k(t['safe']['median'])} | +{_k(t['added'])} ({pct(t)}) |",
        f"| first-level cache misses (simulated) | {_k(l1['stock']['median'])} | {_k(l1['safe']['median'])} | "
        f"+{_k(l1['added'])} ({pct(l1)}) |",
        f"| last-level cache misses (simulated) | {_k(ll['stock']['median'])} | {_k(ll['safe']['median'])} | "
        f"-{_k(-ll['added'])} |",
        f"the first-level misses grow with the instructions ({pct(l1)} against {pct(t)})",
    )
    assert ll["added"] < 0


def test_every_option_off_run_is_the_result_file():
    """bench/README.md's one run with safe_bare at every option off: its row and the figures quoted."""
    data = result("tiny_step-intel-bare-all-off-3b7f4db")
    bare = data["config"]["bare_kwargs"]
    assert data["config"]["bare_recorder"] and bare["heartbeat_interval"] == 0 and bare["desync_detection"] is False
    assert {k for k, v in bare.items() if v in (None, False, 0)} == set(bare)  # every option off

    def ratio(name: str, kind: str = "step_mean_s") -> dict[str, Any]:
        return dict(_ratio_row(data, "nolog", name)[kind])

    row = _pooled_row("`bare-all-off`", data, "safe_bare / stock", "safe / safe_bare")[:-1]
    cpu = [
        f"{ratio(r, 'cpu_step_s')['of_medians']:.3f}" for r in ("safe / stock", "safe_bare / stock", "safe / safe_bare")
    ]
    assert_on("bench/README.md", f"{row}| {' | '.join(cpu)} |")
    safe = ratio("safe / stock")
    assert_on(
        "bench/README.md",
        f"used as much CPU as stock's ({cpu[1]}), while its step was {ratio('safe_bare / stock')['of_medians']:.3f}",
        f"Safe at its defaults was {safe['of_medians']:.3f} of stock (paired median {safe['paired']['median']:.3f}), "
        f"its CPU {cpu[0]} of stock's in this run.",
    )


def _beat_table_rows(name: str, *, step_dumps: bool = False) -> list[dict[str, Any]]:
    """bench/README.md's rows of a step_pauses run with the beat on the training thread; its safe fits.

    Every beat in training ran on the training thread ("training thread / heartbeat thread": n / 0). ``step_dumps``:
    the rows have a column for the audit's dumps at a step of their own, all on the training thread.
    """
    fits = result(name)["fits"]
    stock = {f["round"]: f for f in fits if f["variant"] == "stock"}
    safe = [f for f in fits if f["variant"] == "safe"]
    for fit in safe:
        holds, beats = fit["background_holds"], fit["beats"]
        main = beats["MainThread"]
        assert set(beats) == {"MainThread"}
        row = (
            f"| {fit['round']} | {holds['stretches']} | {holds['over_1ms']} | {holds['over_1ms_wall']} | "
            f"{holds['over_1ms_on_core']} | {holds['longest']['cpu_s'] * 1e3:.3f} | {main['count']} / 0 | "
            f"{main['longest_wall_s'] * 1e3:.3f} / {main['longest_cpu_s'] * 1e3:.3f} | "
        )
        if step_dumps:
            assert set(fit["step_dumps"]) == {"MainThread"}
            dump = fit["step_dumps"]["MainThread"]
            row += f"{dump['count']} ({dump['longest_wall_s'] * 1e3:.3f} / {dump['longest_cpu_s'] * 1e3:.3f}) | "
        row += f"{fit['hook_gaps']['p999_s'] * 1e3:.3f} / {stock[fit['round']]['hook_gaps']['p999_s'] * 1e3:.3f} |"
        assert_on("bench/README.md", row)
    return safe


def test_the_beat_on_the_training_thread_is_the_result_files():
    """bench/README.md's section on the beat on the training thread: step_pauses' row per round, the A/B table."""
    safe = _beat_table_rows("step_pauses-intel-inline-beat-96bc357")
    stock = [f for f in result("step_pauses-intel-inline-beat-96bc357")["fits"] if f["variant"] == "stock"]
    for fit in safe:
        holds = fit["background_holds"]
        assert holds["over_1ms"] == holds["over_1ms_wall"] == holds["over_1ms_on_core"] == 0
        (same,) = [f for f in stock if f["round"] == fit["round"]]
        assert fit["hook_gaps"]["p999_s"] < same["hook_gaps"]["p999_s"]  # "below stock's in both"
    longest = max(f["background_holds"]["longest"]["cpu_s"] for f in safe)
    assert_on("bench/README.md", f"the longest {longest * 1e3:.3f} ms of CPU, against about 450 stretches before")
    ab = assert_ab_section(
        "strategy_cost_ab-inline-beat", "8d30fe1", "96bc357", "#### The beat on the training thread",
        "training thread (the beats moved here)",
    )  # fmt: skip
    for workload in ("mlp", "tiny"):
        assert max(ab["analysis"][workload]["own"]["ratios"]) < 1  # "two rounds each, both lower"
    waits = [run[side]["mlp"]["idle_thread"] for run in ab["runs"] for side in ("base", "head")]
    assert_on("bench/README.md", f"({min(waits):.1f} to {max(waits):.1f} us per MLP")


def test_the_tiny_step_run_with_the_beat_on_the_training_thread_is_the_result_file():
    """bench/README.md's one tiny-step run after the beat moved to the training thread: its row and figures."""
    data = result("tiny_step-intel-inline-beat-96bc357")
    assert data["config"]["variants"] == ["stock", "safe", "safe_bare"]
    assert data["config"]["bare_kwargs"] == {"desync_detection": False}
    assert data["meta"]["git"] == "commit 96bc357"
    assert data["meta"]["loadavg_end"][0] > 5  # "the load average rose to 5 during it"
    assert_on("bench/README.md", _pooled_row("`inline-beat` (96bc357)", data, "safe_bare / stock", "safe / safe_bare"))
    nolog = _ratio_row(data, "nolog", "safe / stock")
    own = data["analysis"]["own_cpu_per_step"]["nolog"]["own_threads_s"]["median"]
    assert_on(
        "bench/README.md",
        f"the training thread's CPU ratio {nolog['cpu_step_s']['of_medians']:.3f}: one noisy run",
        f"The strategy's own threads took {own * 1e6:.1f} us per step",
    )


def test_the_audits_dump_at_a_step_of_its_own_is_the_result_files():
    """bench/README.md's step_pauses run at df9e37c and the A/B against 5251d69."""
    safe = _beat_table_rows("step_pauses-intel-dump-step-df9e37c", step_dumps=True)
    stock = {f["round"]: f for f in result("step_pauses-intel-dump-step-df9e37c")["fits"] if f["variant"] == "stock"}
    for fit in safe:
        holds = fit["background_holds"]
        assert holds["over_1ms"] == holds["over_1ms_wall"] == holds["over_1ms_on_core"] == 0
        assert fit["hook_gaps"]["p999_s"] < stock[fit["round"]]["hook_gaps"]["p999_s"]
    beats = [f"{f['beats']['MainThread']['longest_cpu_s'] * 1e3:.2f}" for f in safe]
    assert_on("bench/README.md", f"**The longest beat took {beats[0]} and {beats[1]} ms of CPU**")
    dumps = sorted(f["step_dumps"]["MainThread"]["longest_cpu_s"] for f in safe)
    assert f"{dumps[0] * 1e3:.1f} to {dumps[-1] * 1e3:.1f} ms" == "1.3 to 1.5 ms"  # "takes 1.3 to 1.5 ms of CPU"
    fits = result("step_pauses-intel-dump-step-df9e37c")["fits"]
    seconds = sorted(f["seconds"] for f in fits if f["variant"] == "safe")
    assert f"per fit of {seconds[0]:.0f} to {seconds[-1]:.0f} s" in " ".join(
        (ROOT / "bench/README.md").read_text().split()
    )
    walls = [
        c["wall_s"] for f in safe for c in f["dumps"]["all"] if c["during_training"] and c["thread"] == "MainThread"
    ]
    assert_on("bench/README.md", f"({min(walls) * 1e3:.2f} to {max(walls) * 1e3:.2f} ms of wall time per call on the")
    ab = result("strategy_cost_ab-dump-step")
    assert ab["base"].startswith("5251d69") and ab["head"].startswith("263e29f") and not ab["dirty"]
    earlier = statistics.median(r["head"]["tiny"]["own"] for r in result("strategy_cost_ab-inline-beat")["runs"])
    base = statistics.median(r["base"]["tiny"]["own"] for r in ab["runs"])
    assert_on("bench/README.md", f"(the base's tiny step {base:.1f} us here, against {earlier:.1f} at 96bc357 there;")
    assert_ab_table(ab, "#### The audit's dump at a step of its own", {"own": "own CPU per step, in all"})
    assert min(ab["analysis"]["mlp"]["own"]["ratios"]) > 1.04  # "both rounds came out 5% higher"
    assert ab["analysis"]["tiny"]["own"]["median"] < 1


def test_the_audits_parsing_at_a_step_of_its_own_is_the_result_file():
    """bench/README.md's step_pauses run at f91297c: its rows and the figures quoted under them."""
    name = "step_pauses-intel-parse-step-f91297c"
    fits = result(name)["fits"]
    stock = {f["round"]: f for f in fits if f["variant"] == "stock"}
    safe = [f for f in fits if f["variant"] == "safe"]
    longest: dict[str, float] = {}
    for fit in safe:
        holds = fit["background_holds"]
        cells = [str(fit["round"]), str(holds["stretches"]), str(holds["over_1ms"]), str(holds["over_1ms_wall"])]
        cells += [str(holds["over_1ms_on_core"]), f"{holds['longest']['cpu_s'] * 1e3:.3f}"]
        beat = fit["beats"]["MainThread"]
        assert set(fit["beats"]) == set(fit["step_dumps"]) == set(fit["step_parses"]) == {"MainThread"}
        cells += [f"{beat['count']} / 0", f"{beat['longest_wall_s'] * 1e3:.3f} / {beat['longest_cpu_s'] * 1e3:.3f}"]
        for kind in ("step_dumps", "step_parses"):
            b = fit[kind]["MainThread"]
            cells.append(f"{b['count']} ({b['longest_wall_s'] * 1e3:.3f} / {b['longest_cpu_s'] * 1e3:.3f})")
            longest[kind] = max(longest.get(kind, 0.0), b["longest_cpu_s"])
        longest["beats"] = max(longest.get("beats", 0.0), beat["longest_cpu_s"])
        longest["torch"] = max(longest.get("torch", 0.0), fit["dumps"]["longest_training_thread_wall_s"])
        cells.append(f"{fit['dumps']['longest_training_thread_wall_s'] * 1e3:.3f}")
        gaps = fit["hook_gaps"]["p999_s"], stock[fit["round"]]["hook_gaps"]["p999_s"]
        assert gaps[0] < gaps[1]
        cells.append(f"{gaps[0] * 1e3:.3f} / {gaps[1] * 1e3:.3f}")
        assert_on("bench/README.md", f"| {' | '.join(cells)} |")
    assert max(longest.values()) < 1e-3  # "No piece ... took 1 ms of CPU" (torch's dump: of wall time)
    for fit in safe:  # "16 of the 21 after the epoch starts' dumps": the other parsings follow the audit's dumps
        parses, dumps = fit["step_parses"]["MainThread"]["count"], fit["step_dumps"]["MainThread"]["count"]
        assert (parses, parses - dumps) == (21, 16)
    assert_on(
        "bench/README.md",
        f"a beat at most {longest['beats'] * 1e3:.2f} ms, a dump {longest['step_dumps'] * 1e3:.2f}, a parsing "
        f"{longest['step_parses'] * 1e3:.2f}",
        f"torch's dump, timed alone, {longest['torch'] * 1e3:.2f} ms of wall",
    )
    walls = [f"{f['beats']['MainThread']['longest_wall_s'] * 1e3:.1f}" for f in safe]
    assert_on("bench/README.md", f"**A beat still took up to {walls[0]} and {walls[1]} ms of wall time**")
    wide = safe[0]["background_holds"]["longest_by_wall"]
    assert [f["background_holds"]["over_1ms_wall"] for f in safe] == [1, 0]
    assert_on(
        "bench/README.md",
        f"{wide['wall_less_profiling_s'] * 1e3:.3f} ms wall, {wide['on_core_s'] * 1e3:.3f} ms on a core, "
        f"{wide['runnable_s'] * 1e3:.3f} ms runnable",
    )


def _assert_pooled_runs(section: str, runs: dict[str, str], before: str = "") -> tuple[dict[str, Any], dict[str, Any]]:
    """``section`` has a row per run of ``runs`` (label: result; the pool last, made of the others) and the pool's
    sentence "{ratio} without logging (paired median ...; resampling runs, ...)", after ``before``. Returns the
    pool and its safe / stock row without logging."""
    for label, name in runs.items():
        assert _pooled_row(label, result(name), "safe_bare / stock", "safe / safe_bare") in section, label
    *parts, pooled = runs.values()
    pool = result(pooled)
    assert [s["run"] for s in pool["pooled_from"]] == parts
    nolog = _ratio_row(pool, "nolog", "safe / stock")
    low, high = pool["analysis"]["run_resampled_interval"]["nolog"]
    assert (
        f"{before}{nolog['step_mean_s']['of_medians']:.3f} without logging (paired median "
        f"{nolog['step_mean_s']['paired']['median']:.3f}; resampling runs, then rounds within them, "
        f"[{low:.3f}, {high:.3f}])" in section
    )
    return pool, nolog


DUMP_STEP_RUNS = {
    "`dump-step-1`": "tiny_step-intel-dump-step-1-c46ad94",
    "`dump-step-2`": "tiny_step-intel-dump-step-2-c46ad94",
    "`dump-step-3`": "tiny_step-intel-dump-step-3-c46ad94",
    "pooled, 30 rounds": "tiny_step-intel-pooled-dump-step-3-runs",
}


def test_the_tiny_step_runs_with_the_audits_dump_at_a_step_of_its_own_are_the_result_files():
    """bench/README.md's three tiny-step runs at c46ad94, their pool and the figures quoted under the table."""
    section = " ".join((ROOT / "bench/README.md").read_text().split("#### The audit's dump at a step")[1].split())
    for name in list(DUMP_STEP_RUNS.values())[:-1]:
        assert result(name)["meta"]["git"] == "commit c46ad94"
        assert result(name)["config"]["bare_kwargs"] == {"desync_detection": False}
    _, nolog = _assert_pooled_runs(section, DUMP_STEP_RUNS)
    runs = [_ratio_row(result(n), "nolog", "safe / stock") for n in list(DUMP_STEP_RUNS.values())[:-1]]
    means = [f"{r['step_mean_s']['of_medians']:.3f}" for r in runs]
    assert f"2 of 3 runs at most 1.02 ({means[0]}, {means[1]}; the third {means[2]})" in section
    cpus = ", ".join(f"{r['cpu_step_s']['of_medians']:.3f}" for r in runs[:2])
    assert f"{nolog['cpu_step_s']['of_medians']:.3f} pooled without logging ({cpus} and " in section
    loads = [
        x
        for n in list(DUMP_STEP_RUNS.values())[1:-1]
        for k in ("loadavg_start", "loadavg_end")
        for x in result(n)["meta"][k][:1]
    ]
    assert f"{min(loads):.1f} to {max(loads):.1f} at the starts and ends of the last two runs" in section


def test_the_audit_split_over_two_beats_is_the_result_file():
    """bench/README.md's step_pauses run at 9b93cea (the audit's dump and its publication in different beats)."""
    safe = _beat_table_rows("step_pauses-intel-split-audit-9b93cea")
    cpu = [f"{f['beats']['MainThread']['longest_cpu_s'] * 1e3:.3f}" for f in safe]
    assert_on("bench/README.md", f"({cpu[0]} and {cpu[1]}, against 2.0 and 2.2 before the")
    earlier = result("step_pauses-intel-inline-beat-96bc357")["fits"]
    before = [f["beats"]["MainThread"]["longest_cpu_s"] for f in earlier if f["variant"] == "safe"]
    assert [f"{c * 1e3:.1f}" for c in before] == ["2.0", "2.2"]
    assert [f["background_holds"]["over_1ms_wall"] for f in safe] == [1, 0]
    assert [f["background_holds"]["over_1ms_on_core"] for f in safe] == [0, 0]
    longest = safe[0]["background_holds"]["longest_by_wall"]
    assert_on(
        "bench/README.md",
        f"{longest['wall_less_profiling_s'] * 1e3:.3f} ms wall, {longest['on_core_s'] * 1e3:.3f} ms on a core, "
        f"{longest['runnable_s'] * 1e3:.3f} ms runnable",
    )


WAKE_READS = ("32d963c", "f569b3b", "f950971")


def test_the_beats_reads_on_the_heartbeat_thread_are_the_result_files():
    """bench/README.md's section on the beat's reads: step_pauses rows, the A/B table, the tiny-step row, figures."""
    heading = "#### The beat's reads on the heartbeat thread"
    section = " ".join((ROOT / "bench/README.md").read_text().split(heading)[1].split("\n## ")[0].split())
    fits: dict[str, list[dict[str, Any]]] = {}
    for sha in WAKE_READS:
        data = result(f"step_pauses-intel-wake-reads-{sha}")
        stock = {f["round"]: f for f in data["fits"] if f["variant"] == "stock"}
        fits[sha] = [f for f in data["fits"] if f["variant"] == "safe"]
        for fit in fits[sha]:
            holds, beat = fit["background_holds"], fit["beats"]["MainThread"]
            wake = fit["wake_reads"]["ddp_strategy-heartbeat-rank0"]
            assert set(fit["beats"]) == {"MainThread"}  # every beat in training on the training thread
            median = f"{beat['median_wall_s'] * 1e3:.3f}" if "median_wall_s" in beat else "-"
            wake_median = f"{wake['median_cpu_s'] * 1e3:.3f}" if "median_cpu_s" in wake else "-"
            cells = [sha, str(fit["round"]), str(holds["stretches"]), str(holds["over_1ms"])]
            cells += [
                str(holds["over_1ms_wall"]),
                str(holds["over_1ms_on_core"]),
                f"{holds['longest']['cpu_s'] * 1e3:.3f}",
            ]
            cells.append(
                f"{beat['count']} ({beat['longest_wall_s'] * 1e3:.3f} / {beat['longest_cpu_s'] * 1e3:.3f}; {median})"
            )
            cells.append(f"{wake['count']} ({wake_median})")
            gaps = fit["hook_gaps"]["p999_s"], stock[fit["round"]]["hook_gaps"]["p999_s"]
            assert gaps[0] < gaps[1]  # "below stock's in every round"
            cells.append(f"{gaps[0] * 1e3:.3f} / {gaps[1] * 1e3:.3f}")
            assert f"| {' | '.join(cells)} |" in section, cells
    last = fits["f950971"]
    assert all(f["background_holds"][k] == 0 for f in last for k in ("over_1ms", "over_1ms_wall", "over_1ms_on_core"))
    longest = max(f["background_holds"]["longest"]["cpu_s"] for f in last)
    assert f"in either fit (the longest {longest * 1e3:.3f} ms of CPU)" in section
    beats = [f["beats"]["MainThread"] for f in last]
    medians = sorted(b["median_wall_s"] for b in beats)
    walls = sorted(b["longest_wall_s"] for b in beats)
    worst = max(beats, key=lambda b: b["longest_wall_s"])
    assert (
        f"{medians[0] * 1e3:.2f} to {medians[1] * 1e3:.2f} ms of wall time at the median; the longest of "
        f"{sum(b['count'] for b in beats)} took {walls[1] * 1e3:.3f} ms of wall time** "
        f"({worst['longest_cpu_s'] * 1e3:.3f} of CPU;" in section
    )
    assert f"the other fit's longest {walls[0] * 1e3:.3f}" in section
    first = [f["background_holds"]["longest"] for f in fits["32d963c"]]
    assert all(h["from"] == "heartbeat.py:358" and h["to"] == "collective_record.py:189" for h in first)
    assert f"stretches {first[0]['cpu_s'] * 1e3:.3f} and {first[1]['cpu_s'] * 1e3:.3f} ms of CPU" in section
    wide = max((f["background_holds"]["longest"] for f in fits["f569b3b"]), key=lambda h: h["cpu_s"])
    assert wide["from"] == "heartbeat.py:358" and f"one stretch of {wide['cpu_s'] * 1e3:.3f} ms of CPU" in section
    ab = assert_ab_section("strategy_cost_ab-wake-reads", "55deedf", "f569b3b", heading, "the training thread")
    mlp = ab["analysis"]["mlp"]
    assert f"({mlp['training thread']['median']:.3f})" in section and mlp["training thread"]["range"][1] < 1
    assert (
        f"In all, {mlp['own']['median']:.3f} of before on the MLP, {ab['analysis']['tiny']['own']['median']:.3f}"
        in section
    )
    tiny = result("tiny_step-intel-wake-reads-f569b3b")
    assert tiny["meta"]["git"] == "commit f569b3b" and tiny["config"]["bare_kwargs"] == {"desync_detection": False}
    assert _pooled_row("`wake-reads` (f569b3b)", tiny, "safe_bare / stock", "safe / safe_bare") in section
    nolog, synced = (_ratio_row(tiny, m, "safe / stock") for m in ("nolog", "sync_dist"))
    assert (
        f"**Point 3 held in this run**: {nolog['step_mean_s']['of_medians']:.3f} without logging, "
        f"{synced['step_mean_s']['of_medians']:.3f} with the `sync_dist` log; by the training thread's CPU "
        f"{nolog['cpu_step_s']['of_medians']:.3f} without logging" in section
    )
    assert nolog["step_mean_s"]["of_medians"] <= 1.02 and synced["step_mean_s"]["of_medians"] <= 1.02
    assert f"{synced['cpu_step_s']['of_medians']:.3f} with it" in section
    loads = tiny["meta"]["loadavg_start"][0], tiny["meta"]["loadavg_end"][0]
    assert f"{loads[0]:.1f} at its start and {loads[1]:.1f} at its end" in section
    runs = {
        "`wake-reads-2` (d83ad17)": "tiny_step-intel-wake-reads-2-f950971",
        "`wake-reads-3` (02df4d9)": "tiny_step-intel-wake-reads-3-f950971",
        "pooled, 20 rounds": "tiny_step-intel-pooled-wake-reads-2-runs",
    }
    commits = [result(name)["meta"]["git"] for name in list(runs.values())[:2]]
    assert commits == ["commit d83ad17", "commit 02df4d9"]
    pool, _ = _assert_pooled_runs(section, runs, "20 rounds): ")
    cpus = [f"{_ratio_row(result(n), 'nolog', 'safe / stock')['cpu_step_s']['of_medians']:.3f}" for n in runs.values()]
    assert f"By the training thread's CPU {cpus[0]} and {cpus[1]} by run, {cpus[2]} pooled" in section
    synced = _ratio_row(pool, "sync_dist", "safe / stock")["step_mean_s"]["of_medians"]
    assert f"`sync_dist` log {synced:.3f}. By" in section
    third = _ratio_row(result(runs["`wake-reads-3` (02df4d9)"]), "nolog", "safe / stock")["step_mean_s"]["of_medians"]
    assert f"only in two of them ({third:.3f} the third)" in section and third > 1.02


def test_where_a_steps_own_cpu_goes_tables_and_figures_are_the_result_files():
    """bench/README.md's heartbeat by part on both threads, the step's own CPU in four parts, the third tiny run."""
    heading = "#### Where a step's own CPU goes: the heartbeat on both threads"
    section = " ".join((ROOT / "bench/README.md").read_text().split(heading)[1].split("\n## ")[0].split())
    data = result("strategy_cost-heartbeat-both-threads")
    mlp, cifar = data["workloads"]
    assert (mlp["workload"], cifar["workload"], mlp["steps"], cifar["steps"]) == ("mlp", "cifar", 120, 120)
    readme_labels = {
        "training thread: the beat (`beat_if_due`)": "training thread: the beat (`beat_if_due`)",
        "of the beat: the position's publication (its JSON and its `set`)": (
            "  the position's publication (its JSON and its `set`)"
        ),
        "of the beat: the desync monitor's beat (the ledger's digest, the audit's publication)": (
            "  the desync monitor's beat (the ledger's digest, the audit's publication)"
        ),
        "training thread: the audit's dump, at the step after a beat": (
            "training thread: the audit's dump, at the step after a beat"
        ),
        "training thread: its parsing, at the step after that": "training thread: its parsing, at the step after that",
        "heartbeat thread: what a beat left it (`_after_inline_beat`)": (
            "heartbeat thread: what a beat left it (`_after_inline_beat`)"
        ),
        "of it: the desync monitor's look (`_look`)": "  the desync monitor's look (`_look`)",
        "of the look: its store read (`read_with_failures`, one `multi_get`)": (
            "    its store read (`read_with_failures`, one `multi_get`)"
        ),
        "heartbeat thread: the rest (wake-ups and the loop)": "heartbeat thread: the rest (wake-ups and the loop)",
    }
    for label, part in readme_labels.items():
        cells = [label]
        for row in (mlp, cifar):
            cpu, calls = row["heartbeat_parts"]["cpu_per_step_s"][part], row["heartbeat_parts"]["calls_in_window"]
            cells.append(f"{cpu * 1e6:.1f}")
            cells.append(f"{cpu * row['steps'] / calls[part] * 1e6:.0f} ({calls[part]})" if calls.get(part) else "-")
        assert f"| {' | '.join(cells)} |" in section, label
    other_hooks = (
        "the other per-step hooks: `on_train_batch_start` less the heartbeat's parts, `optimizer_step`, "
        "`post_backward`, the callbacks"
    )
    parts: dict[str, dict[str, float]] = {}
    for row in (mlp, cifar):
        own, hb_parts = row["own_per_method_s"], row["heartbeat_parts"]["cpu_per_step_s"]
        training = sum(v for k, v in hb_parts.items() if k.startswith("training thread:"))
        callbacks = sum(v for k, v in own.items() if "." in k and k != "self.log wrapper")
        hooks = own["on_train_batch_start"] - training + own["optimizer_step"] + own["post_backward"] + callbacks
        parts[row["workload"]] = {
            "own CPU per step, in all": row["own_cpu_per_step_s"],
            "the heartbeat on the training thread (the beat, the audit's dump and parsing)": training,
            "the heartbeat thread": row["threads_cpu_per_step_s"]["ddp_strategy-heartbeat-rank0"],
            "the `self.log(..., sync_dist=True)` values (`reduce` and the `self.log` wrapper)": (
                own["reduce"] + own["self.log wrapper"]
            ),
            other_hooks: hooks,
            "obs": own["on_train_batch_start"] - training,
            "callbacks": callbacks,
        }
        in_all = sum(
            v for k, v in parts[row["workload"]].items() if k not in ("own CPU per step, in all", "obs", "callbacks")
        )
        assert abs(in_all - row["own_cpu_per_step_s"]) < 1e-9  # the four parts are the whole
    for label in list(parts["mlp"])[:5]:
        assert f"| {label} | {parts['mlp'][label] * 1e6:.1f} | {parts['cifar'][label] * 1e6:.1f} |" in section, label
    m = parts["mlp"]
    own = mlp["own_per_method_s"]
    hooks = m[other_hooks]
    assert (
        f"the per-step hooks without any heartbeat work are {hooks * 1e6:.0f} us** (`on_train_batch_start`'s own "
        f"{m['obs'] * 1e6:.1f} with the trainable-set test, `optimizer_step` {own['optimizer_step'] * 1e6:.1f}, the "
        f"callbacks' turns {m['callbacks'] * 1e6:.1f}, `post_backward` {own['post_backward'] * 1e6:.1f})" in section
    )
    hb = mlp["heartbeat_parts"]
    rest = hb["cpu_per_step_s"]["heartbeat thread: the rest (wake-ups and the loop)"]
    read_part = "    its store read (`read_with_failures`, one `multi_get`)"
    read = hb["cpu_per_step_s"][read_part]
    look = hb["cpu_per_step_s"]["  the desync monitor's look (`_look`)"]
    assert (
        f"about {rest * 1e6 + read * 1e6:.0f} us per MLP step**: its wake-ups and loop ({rest * 1e6:.1f}; a thread "
        f"that only waits 1 s at a time measured beside it cost {mlp['idle_thread_per_step_s'] * 1e6:.1f})" in section
    )
    per_read = read * mlp["steps"] / hb["calls_in_window"][read_part]
    assert f"({read * 1e6:.1f}, {per_read * 1e6:.0f} us of the thread's CPU per `multi_get`" in section
    assert f"the look's own Python is the other {(look - read) * 1e6:.1f}" in section
    runs = {
        "`wake-reads-2` (d83ad17)": "tiny_step-intel-wake-reads-2-f950971",
        "`wake-reads-3` (02df4d9)": "tiny_step-intel-wake-reads-3-f950971",
        "`wake-reads-4` (e666f71)": "tiny_step-intel-wake-reads-4-f950971",
        "pooled, 30 rounds": "tiny_step-intel-pooled-wake-reads-3-runs",
    }
    assert result(runs["`wake-reads-4` (e666f71)"])["meta"]["git"] == "commit e666f71"
    pool, nolog = _assert_pooled_runs(section, runs, "(30 rounds): ")
    assert nolog["step_mean_s"]["of_medians"] <= 1.02
    synced = _ratio_row(pool, "sync_dist", "safe / stock")["step_mean_s"]["of_medians"]
    cpus = [_ratio_row(result(n), "nolog", "safe / stock")["cpu_step_s"]["of_medians"] for n in runs.values()]
    assert (
        f"{synced:.3f} with the `sync_dist` log; by the training thread's CPU {cpus[2]:.3f} in the new run, "
        f"{cpus[3]:.3f} pooled" in section
    )
    ab = result("strategy_cost_ab-wakeup-lock")
    assert ab["base"].startswith("c253cd4") and ab["head"].startswith("7ad47d1") and not ab["dirty"]
    labels = {
        "own": "own CPU per step, in all",
        "training thread": "the training thread (code unchanged: the noise)",
        "Python threads": "the strategy's Python threads",
    }
    for part, label in labels.items():
        medians = [
            f"{statistics.median(run[side]['mlp'][part] for run in ab['runs']):.1f}" for side in ("base", "head")
        ]
        stats = ab["analysis"]["mlp"][part]
        ratio = f"{stats['median']:.3f} [{stats['range'][0]:.3f}, {stats['range'][1]:.3f}]"
        assert f"| {label} | {medians[0]} | {medians[1]} | {ratio} |" in section, label
    threads = ab["analysis"]["mlp"]["Python threads"]
    assert threads["range"][0] < 1 < threads["range"][1]  # "has a range across 1"
    assert f"the heartbeat thread's ratio, {threads['median']:.3f}, has a range across 1" in section
    training = ab["analysis"]["mlp"]["training thread"]["median"]
    assert f"moved as much ({training:.3f})" in section
    pauses = result("step_pauses-intel-wakeup-lock-e5afa0c")
    stock = {f["round"]: f for f in pauses["fits"] if f["variant"] == "stock"}
    safe = [f for f in pauses["fits"] if f["variant"] == "safe"]
    for fit in safe:
        holds, beat, dump = fit["background_holds"], fit["beats"]["MainThread"], fit["step_dumps"]["MainThread"]
        gaps = fit["hook_gaps"]["p999_s"], stock[fit["round"]]["hook_gaps"]["p999_s"]
        assert gaps[0] < gaps[1] and holds["over_1ms"] == holds["over_1ms_on_core"] == 0
        cells = [str(fit["round"]), str(holds["stretches"]), str(holds["over_1ms"]), str(holds["over_1ms_wall"])]
        cells += [str(holds["over_1ms_on_core"]), f"{holds['longest']['cpu_s'] * 1e3:.3f}"]
        cells += [
            f"{beat['count']} ({beat['longest_wall_s'] * 1e3:.3f} / {beat['longest_cpu_s'] * 1e3:.3f})",
            f"{dump['count']} ({dump['longest_wall_s'] * 1e3:.3f} / {dump['longest_cpu_s'] * 1e3:.3f})",
            f"{gaps[0] * 1e3:.3f} / {gaps[1] * 1e3:.3f}",
        ]
        assert f"| {' | '.join(cells)} |" in section, cells
    assert [f["background_holds"]["over_1ms_wall"] for f in safe] == [0, 2]
    wall = safe[1]["background_holds"]["longest_by_wall"]
    assert (wall["from"], wall["to"]) == ("heartbeat.py:383", "heartbeat.py:114")
    assert (
        f"the longest {wall['wall_less_profiling_s'] * 1e3:.3f} ms less the profiling "
        f"({wall['runnable_s'] * 1e3:.3f} of it runnable" in section
    )
    dumps = [f["step_dumps"]["MainThread"]["longest_wall_s"] for f in safe]
    assert f"took {dumps[0] * 1e3:.3f} ms** (round 1; {dumps[1] * 1e3:.3f} in round 2)" in section
    assert max(f["beats"]["MainThread"]["longest_wall_s"] for f in safe) < 0.00051  # "stayed under 0.51 ms"


def test_the_audits_dump_unpickling_and_parsing_at_three_steps_tables_and_figures_are_the_result_files():
    """bench/README.md's step_pauses runs with the dump split in three steps, and recorder_dump_cost's tails."""
    heading = "#### The audit's dump, its unpickling and its parsing at three steps"
    section = " ".join((ROOT / "bench/README.md").read_text().split(heading)[1].split("\n## ")[0].split())
    safe_fits: dict[str, list[dict[str, Any]]] = {}
    for run in ("58e246f", "735b388"):
        pauses = result(f"step_pauses-dump-unpickle-{run}")
        stock = {f["round"]: f for f in pauses["fits"] if f["variant"] == "stock"}
        safe_fits[run] = [f for f in pauses["fits"] if f["variant"] == "safe"]
        for fit in safe_fits[run]:
            holds = fit["background_holds"]
            gaps = fit["hook_gaps"]["p999_s"], stock[fit["round"]]["hook_gaps"]["p999_s"]
            assert gaps[0] < gaps[1] and holds["over_1ms"] == holds["over_1ms_on_core"] == 0
            cells = [f"{run}, {fit['round']}", str(holds["stretches"]), str(holds["over_1ms"])]
            cells += [
                str(holds["over_1ms_wall"]),
                str(holds["over_1ms_on_core"]),
                f"{holds['longest']['cpu_s'] * 1e3:.3f}",
            ]
            for kind in ("beats", "step_dumps", "step_unpickles", "step_parses"):
                b = fit[kind]["MainThread"]
                cells.append(f"{b['count']} ({b['longest_wall_s'] * 1e3:.3f} / {b['longest_cpu_s'] * 1e3:.3f})")
            cells.append(f"{gaps[0] * 1e3:.3f} / {gaps[1] * 1e3:.3f}")
            assert f"| {' | '.join(cells)} |" in section, cells
    every = [f for fits in safe_fits.values() for f in fits]
    assert [f["background_holds"]["over_1ms_wall"] for f in every] == [0, 1, 0, 0]
    wall = safe_fits["58e246f"][1]["background_holds"]["longest_by_wall"]
    assert (
        f"(58e246f, round 2: {wall['wall_less_profiling_s'] * 1e3:.3f} ms, {wall['runnable_s'] * 1e3:.3f} of it"
        in section
    )
    unpickle = max(f["step_unpickles"]["MainThread"]["longest_wall_s"] for f in every)
    parse = max(f["step_parses"]["MainThread"]["longest_wall_s"] for f in every)
    assert unpickle < 1e-3 and parse < 1e-3
    assert f"(at most {unpickle * 1e3:.3f} and {parse * 1e3:.3f} ms)" in section
    beat_cpu = max(f["beats"]["MainThread"]["longest_cpu_s"] for f in every)
    beat_walls = [
        f["beats"]["MainThread"]["longest_wall_s"] for f in every if f["beats"]["MainThread"]["longest_wall_s"] > 1e-3
    ]
    assert f"by CPU ({beat_cpu * 1e3:.3f} ms; two over 1 ms of wall time, " in section and len(beat_walls) == 2
    assert f"{beat_walls[0] * 1e3:.3f} and {beat_walls[1] * 1e3:.3f}, off their core" in section
    dumps = [
        d
        for f in safe_fits["735b388"]
        for d in f["dumps"]["all"]
        if d["during_training"] and not d["thread"].startswith("ddp_strategy-")
    ]
    cpus = sorted(d["cpu_s"] for d in dumps)
    assert len(dumps) == 40 and cpus[-1] > 1e-3 > cpus[-2]  # one over 1 ms of CPU
    assert f"one took {cpus[-1] * 1e3:.3f} ms of CPU" in section
    assert f"the others at most {cpus[-2] * 1e3:.3f} ms (median {statistics.median(cpus) * 1e3:.3f})" in section
    walled = [d for d in dumps if d["wall_s"] > 1e-3 and d["cpu_s"] < 1e-3]
    assert len(walled) == 1 and f"took {walled[0]['wall_s'] * 1e3:.3f} ms of wall time, off its core" in section
    costs = [result(f"recorder_dump_cost-{name}") for name in ("b0a1d77", "b0a1d77-2")]
    longest: dict[int, list[float]] = {}
    for entries in (8, 16, 32):
        rows = [next(r for r in cost["rows"] if r["entries"] == entries) for cost in costs]
        assert all(r["entries_dumped"] == entries for r in rows) and costs[0]["dumps"] == costs[1]["dumps"] == 200
        cells = [
            " / ".join(f"{row[kind][stat] * 1e3:.3f}" for stat in ("median_s", "p99_s", "max_s"))
            for kind in ("with_stacks", "without_stacks")
            for row in rows
        ]
        assert f"| {entries} | {' | '.join(cells)} |" in section, entries
        longest[entries] = [row["with_stacks"]["max_s"] for row in rows]
    assert min(longest[16]) > 1e-3 > max(longest[8])  # "crossed 1 ms in both runs"; "stayed under"
    assert f"({longest[16][0] * 1e3:.3f} and {longest[16][1] * 1e3:.3f} ms); at 8 entries it stayed under " in section
    assert f"stayed under {max(longest[8]) * 1e3:.3f} ms" in section


def test_the_tiny_step_runs_with_the_dump_in_three_steps_are_the_result_files():
    """bench/README.md's three tiny-step runs at 3fa24ab, their pool, and the figures under the table."""
    heading = "#### The tiny-model step with the dump in three steps"
    section = " ".join((ROOT / "bench/README.md").read_text().split(heading)[1].split("\n## ")[0].split())
    runs = {
        "`split-1`": "tiny_step-split-1-3fa24ab",
        "`split-2`": "tiny_step-split-2-3fa24ab",
        "`split-3`": "tiny_step-split-3-3fa24ab",
        "pooled, 30 rounds": "tiny_step-pooled-split-3-runs-3fa24ab",
    }
    commits = [result(name)["meta"]["git"] for name in list(runs.values())[:-1]]
    assert commits == ["commit 3fa24ab", "commit f100e70", "commit 9f1d804"]  # one src/: later commits added results
    assert all(
        result(name)["config"]["bare_kwargs"] == {"desync_detection": False} for name in list(runs.values())[:-1]
    )
    pool, nolog = _assert_pooled_runs(section, runs, "(30 rounds): ")
    synced = _ratio_row(pool, "sync_dist", "safe / stock")
    assert nolog["step_mean_s"]["of_medians"] <= 1.02 and synced["step_mean_s"]["of_medians"] <= 1.02
    assert nolog["cpu_step_s"]["of_medians"] <= 1.02 and synced["cpu_step_s"]["of_medians"] <= 1.02
    assert (
        f"{synced['step_mean_s']['of_medians']:.3f} with the `sync_dist` log; by the training thread's CPU too, "
        f"{nolog['cpu_step_s']['of_medians']:.3f} without logging and {synced['cpu_step_s']['of_medians']:.3f} with it"
        in section
    )
    cpus = [
        _ratio_row(result(n), "nolog", "safe / stock")["cpu_step_s"]["of_medians"] for n in list(runs.values())[:-1]
    ]
    assert f"(by run {cpus[0]:.3f}, {cpus[1]:.3f} and {cpus[2]:.3f} without logging)" in section
    before = _ratio_row(result("tiny_step-intel-pooled-wake-reads-3-runs"), "nolog", "safe / stock")
    assert f"The pool at f950971 had {before['cpu_step_s']['of_medians']:.3f} by CPU" in section
    own = pool["analysis"]["own_cpu_per_step"]["nolog"]
    total, threads = own["total_s"], own["own_threads_s"]["median"]
    assert (
        f"costs safe {total['median'] * 1e6:.0f} us of CPU more than stock's at the median of the 30 paired rounds "
        f"without logging ([{total['min'] * 1e6:.0f}, {total['max'] * 1e6:.0f}]" in section
    )
    assert f"the strategy's own threads {threads * 1e6:.1f} of it" in section
    value = pool["analysis"]["per_sync_dist_value"]
    low, high = value["interval_s"]
    assert value["cpu_added_s"]["median"] < 0 and high < 0  # cheaper than stock's
    assert (
        f"costs safe's training thread {-value['cpu_added_s']['median'] * 1e6:.0f} us less than stock's (90% "
        f"interval of the median [{low * 1e6:.0f}, {high * 1e6:.0f}])" in section
    )


def test_the_heartbeat_by_part_with_the_dump_in_three_steps_is_the_result_file():
    """bench/README.md's strategy_cost run at ce1527e beside the earlier one (figures from both result files)."""
    heading = "#### The audit's dump, its unpickling and its parsing at three steps"
    section = " ".join((ROOT / "bench/README.md").read_text().split(heading)[1].split("\n## ")[0].split())
    now = {w["workload"]: w for w in result("strategy_cost-heartbeat-three-steps-ce1527e")["workloads"]}
    before = {w["workload"]: w for w in result("strategy_cost-heartbeat-both-threads")["workloads"]}
    assert now["mlp"]["steps"] == now["cifar"]["steps"] == 120
    assert (
        f"own CPU per step {now['mlp']['own_cpu_per_step_s'] * 1e6:.1f} us on the MLP and "
        f"{now['cifar']['own_cpu_per_step_s'] * 1e6:.1f} on the CIFAR model "
        f"({before['mlp']['own_cpu_per_step_s'] * 1e6:.1f} and {before['cifar']['own_cpu_per_step_s'] * 1e6:.1f}"
        in section
    )
    parts = now["mlp"]["heartbeat_parts"]
    labels = [
        "training thread: the audit's dump, at the step after a beat",
        "training thread: its unpickling, at the step after that",
        "training thread: its parsing, at the step after that",
    ]
    pieces = ", ".join(f"{parts['cpu_per_step_s'][label] * 1e6:.1f}" for label in labels[:2])
    assert f"pieces {pieces} and {parts['cpu_per_step_s'][labels[2]] * 1e6:.1f} us per MLP step" in section
    assert [parts["calls_in_window"][label] for label in labels] == [2, 2, 2]
    look, rest = "  the desync monitor's look (`_look`)", "heartbeat thread: the rest (wake-ups and the loop)"
    old = before["mlp"]["heartbeat_parts"]["cpu_per_step_s"]
    new = parts["cpu_per_step_s"]
    assert f"the heartbeat thread's look ({new[look] * 1e6:.1f} against {old[look] * 1e6:.1f})" in section
    assert f"and its rest ({new[rest] * 1e6:.1f} against {old[rest] * 1e6:.1f})" in section
    shared = [label for label in old if label in new]
    assert all(new[label] > old[label] for label in shared if old[label] > 0)  # "every part is higher"
    assert now["mlp"]["own_cpu_per_step_s"] > 50e-6  # "point 1's figure is not met"


def test_the_third_step_pauses_run_with_the_dump_in_three_steps_is_the_result_file():
    """bench/README.md's step_pauses run at 1d38bd0: its rows and the misses named under them."""
    heading = "#### The audit's dump, its unpickling and its parsing at three steps"
    section = " ".join((ROOT / "bench/README.md").read_text().split(heading)[1].split("\n## ")[0].split())
    pauses = result("step_pauses-dump-unpickle-1d38bd0")
    stock = {f["round"]: f for f in pauses["fits"] if f["variant"] == "stock"}
    safe = [f for f in pauses["fits"] if f["variant"] == "safe"]
    for fit in safe:
        holds = fit["background_holds"]
        gaps = fit["hook_gaps"]["p999_s"], stock[fit["round"]]["hook_gaps"]["p999_s"]
        cells = [f"1d38bd0, {fit['round']}", str(holds["stretches"]), str(holds["over_1ms"])]
        cells += [str(holds["over_1ms_wall"]), str(holds["over_1ms_on_core"]), f"{holds['longest']['cpu_s'] * 1e3:.3f}"]
        for kind in ("beats", "step_dumps", "step_unpickles", "step_parses"):
            b = fit[kind]["MainThread"]
            cells.append(f"{b['count']} ({b['longest_wall_s'] * 1e3:.3f} / {b['longest_cpu_s'] * 1e3:.3f})")
        cells.append(f"{gaps[0] * 1e3:.3f} / {gaps[1] * 1e3:.3f}")
        assert f"| {' | '.join(cells)} |" in section, cells
    longest = safe[1]["background_holds"]["longest"]
    assert [f["background_holds"]["over_1ms_on_core"] for f in safe] == [0, 1]
    assert (longest["from"], longest["to"], longest["garbage_collection"]) == (
        "heartbeat.py:383",
        "heartbeat.py:114",
        False,
    )
    assert f"one stretch of the heartbeat thread took {longest['cpu_s'] * 1e3:.3f} ms of CPU (round 2;" in section
    earlier = [
        f["background_holds"]["longest"]["cpu_s"]
        for run in ("58e246f", "735b388")
        for f in result(f"step_pauses-dump-unpickle-{run}")["fits"]
        if f["variant"] == "safe"
    ]
    assert f"at most {max(earlier) * 1e3:.2f} ms in the four fits above" in section
    over = sorted(
        d["cpu_s"]
        for f in safe
        for d in f["dumps"]["all"]
        if d["during_training"] and not d["thread"].startswith("ddp_strategy-") and d["cpu_s"] > 1e-3
    )
    assert len(over) == 3
    assert f"({over[0] * 1e3:.3f}, {over[1] * 1e3:.3f} and {over[2] * 1e3:.3f} ms)" in section
    above = [f["round"] for f in safe if f["hook_gaps"]["p999_s"] > stock[f["round"]]["hook_gaps"]["p999_s"]]
    assert above == [1]
    first = safe[0]["hook_gaps"]["p999_s"], stock[1]["hook_gaps"]["p999_s"]
    assert f"above stock's in round 1 ({first[0] * 1e3:.3f} against {first[1] * 1e3:.3f} ms)" in section


def test_the_step_pauses_runs_with_the_ring_of_8_are_the_result_files():
    """bench/README.md's three step_pauses runs of 1a09e77's src (ring of 8, the look's comparisons apart)."""
    heading = "#### The ring halved to 8, and the look's comparisons apart"
    section = " ".join((ROOT / "bench/README.md").read_text().split(heading)[1].split("\n## ")[0].split())
    runs = ((1, "step_pauses-ring8-1a09e77"), (2, "step_pauses-ring8-1a09e77-2"), (3, "step_pauses-ring8-fbe7d99-3"))
    fits, dumps, read, audit = [], {1: [], 2: [], 3: []}, [], []
    for run, name in runs:
        pauses = result(name)
        stock = {f["round"]: f for f in pauses["fits"] if f["variant"] == "stock"}
        for fit in (f for f in pauses["fits"] if f["variant"] == "safe"):
            holds = fit["background_holds"]
            gaps = fit["hook_gaps"]["p999_s"], stock[fit["round"]]["hook_gaps"]["p999_s"]
            assert gaps[0] < gaps[1]  # below stock's in every round
            cells = [f"{run}, {fit['round']}", str(holds["stretches"]), str(holds["over_1ms"])]
            cells += [str(holds["over_1ms_wall"]), str(holds["over_1ms_on_core"])]
            cells.append(f"{holds['longest']['cpu_s'] * 1e3:.3f}")
            for kind in ("beats", "step_dumps", "step_unpickles", "step_parses"):
                b = fit[kind]["MainThread"]
                cells.append(f"{b['count']} ({b['longest_wall_s'] * 1e3:.3f} / {b['longest_cpu_s'] * 1e3:.3f})")
            trained = [d for d in fit["dumps"]["all"] if d["during_training"] and d["thread"] == "MainThread"]
            longest_wall, longest_cpu = max(d["wall_s"] for d in trained), max(d["cpu_s"] for d in trained)
            cells.append(f"{len(trained)} ({longest_wall * 1e3:.3f} / {longest_cpu * 1e3:.3f})")
            cells.append(f"{gaps[0] * 1e3:.3f} / {gaps[1] * 1e3:.3f}")
            assert f"| {' | '.join(cells)} |" in section, cells
            assert not any(d["thread"].startswith("ddp_strategy-") for d in fit["dumps"]["all"] if d["during_training"])
            fits.append((run, fit))
            dumps[run] += trained
            sites = {(s["from"], s["to"]): s["cpu_s"] for s in holds["longest_by_sites"]}
            read.append(sites[("heartbeat.py:383", "desync_audit.py:66")])
            audit.append(sites[("desync_audit.py:66", "heartbeat.py:114")])
    holds = [f["background_holds"] for _, f in fits]
    assert all(h["over_1ms"] == 0 and h["over_1ms_on_core"] == 0 for h in holds) and len(holds) == 6
    assert f"(the longest {max(h['longest']['cpu_s'] for h in holds) * 1e3:.3f} ms of CPU;" in section
    assert f"{sum(h['over_1ms_wall'] for h in holds)} over 1 ms of wall time" in section
    first = dumps[1] + dumps[2]
    assert max(d["cpu_s"] for d in first) < 1e-3
    in_step = {
        run: max(f["step_dumps"]["MainThread"]["longest_cpu_s"] for r, f in fits if r == run) for run in (1, 2, 3)
    }
    assert f"none of the {len(first)} in training of runs 1 and 2 over 1 ms of CPU" in section
    assert f"(the longest {max(d['cpu_s'] for d in first) * 1e3:.3f} ms, as an epoch started;" in section
    assert max(in_step[1], in_step[2]) < max(d["cpu_s"] for d in first)  # the longest was as an epoch started
    assert f"at a step of their own at most {max(in_step[1], in_step[2]) * 1e3:.3f} ms)" in section
    over = sorted(d["cpu_s"] for d in dumps[3] if d["cpu_s"] > 1e-3)
    assert len(over) == 2 and in_step[3] < over[0]  # both as an epoch started
    assert (
        f"but two of the {len(dumps[3])} of run 3 took {over[0] * 1e3:.3f} and {over[1] * 1e3:.3f} ms of CPU" in section
    )
    assert f"at most {in_step[3] * 1e3:.3f} ms there" in section
    beats = sorted(f["beats"]["MainThread"]["longest_cpu_s"] for _, f in fits)
    assert (
        f"one beat on the training thread took {beats[-1] * 1e3:.3f} ms of CPU (at most {beats[-2] * 1e3:.3f}"
        in section
    )
    assert f"from the store read to the sleep {max(read) * 1e3:.3f} ms" in section
    assert f"to the thread's next wait {max(audit) * 1e3:.3f} ms" in section


def test_the_tiny_step_runs_with_the_ring_of_8_are_the_result_files():
    """bench/README.md's four tiny-step runs at 1a09e77 (ring of 8), their pool, and the figures under the table."""
    heading = "#### The tiny-model step with the ring of 8"
    section = " ".join((ROOT / "bench/README.md").read_text().split(heading)[1].split("\n## ")[0].split())
    runs = {f"`ring8-{n}`": f"tiny_step-ring8-{n}-1a09e77" for n in (1, 2, 3, 4)}
    runs["pooled, 40 rounds"] = "tiny_step-pooled-ring8-4-runs-1a09e77"
    parts = list(runs.values())[:-1]
    commits = [result(name)["meta"]["git"] for name in parts]
    assert commits == ["commit 1a09e77"] + ["commit 7d356bc"] * 3  # one src/: 7d356bc added results and tests
    assert all(result(name)["config"]["bare_kwargs"] == {"desync_detection": False} for name in parts)
    pool, nolog = _assert_pooled_runs(section, runs, "(40 rounds) gives ")
    assert nolog["step_mean_s"]["of_medians"] > 1.02  # not shown: the sentence says so
    assert "Point 3 is not shown on this package code" in section
    synced = _ratio_row(pool, "sync_dist", "safe / stock")["step_mean_s"]["of_medians"]
    assert f"{synced:.3f} with the `sync_dist` log" in section
    by_run = [_ratio_row(result(n), "nolog", "safe / stock")["step_mean_s"]["of_medians"] for n in parts]
    assert f"by run from {min(by_run):.3f} to {max(by_run):.3f} without logging" in section
    assert f"the ratio moved by {max(by_run) - min(by_run):.3f}" in section
    before = result("tiny_step-pooled-split-3-runs-3fa24ab")
    earlier = _ratio_row(before, "nolog", "safe / stock")["step_mean_s"]["of_medians"]
    low, high = before["analysis"]["run_resampled_interval"]["nolog"]
    assert f"The pool at 3fa24ab had {earlier:.3f} ([{low:.3f}, {high:.3f}])" in section
    share = _ratio_row(pool, "nolog", "safe / safe_bare")
    assert (
        f"safe / safe_bare: {share['step_mean_s']['of_medians']:.3f} by wall time and "
        f"{share['cpu_step_s']['of_medians']:.3f} by the training thread's CPU (paired median "
        f"{share['cpu_step_s']['paired']['median']:.3f})" in section
    )
    bare = _ratio_row(pool, "nolog", "safe_bare / stock")
    assert (
        f"safe_bare's as much ({bare['step_mean_s']['of_medians']:.3f}, by CPU {bare['cpu_step_s']['of_medians']:.3f})"
        in section
    )
    own = pool["analysis"]["own_cpu_per_step"]["nolog"]["own_threads_s"]["median"]
    assert f"own threads took {own * 1e6:.1f} us per step at the median" in section

    def stock(data: dict[str, Any], key: str) -> float:
        rows = data["analysis"]["rows"]
        return next(r for r in rows if r["mode"] == "nolog" and r["variant"] == "stock")[key]["median"]

    assert (
        f"stock's own step took {stock(pool, 'step_mean_s') * 1e6:.0f} us at the median of the 40 rounds "
        f"({stock(before, 'step_mean_s') * 1e6:.0f} in the 30 rounds at 3fa24ab) and its training thread "
        f"{stock(pool, 'cpu_step_s') * 1e6:.0f} us of CPU per step ({stock(before, 'cpu_step_s') * 1e6:.0f})" in section
    )


#: bench/README.md's "A fifth tiny-step run": label, result, what its safe_bare switched off
DIAGNOSIS_RUNS = (
    ("`ring8-5`", "tiny_step-ring8-5-24825e3", "no desync detection"),
    ("pooled, 50 rounds", "tiny_step-pooled-ring8-5-runs-24825e3", "no desync detection"),
    ("`no-heartbeat`", "tiny_step-no-heartbeat-24825e3", "no heartbeat"),
    ("`all-off`", "tiny_step-all-off-24825e3", "every option off"),
)


def _bare_cpu_added(data: dict[str, Any]) -> float:
    """safe_bare's training-thread CPU per step less stock's in the same round, median over rounds, without logging."""
    rows = data["analysis"]["step_breakdown"]
    row = next(r for r in rows if r["mode"] == "nolog" and r["variant"] == "safe_bare")
    return float(row["cpu_step_s_added"]["median"])


def test_the_fifth_tiny_step_run_and_the_runs_without_background_work_are_the_result_files():
    """bench/README.md's fifth tiny-step run, the pool of five, the two diagnosis runs and the tiny model's own CPU."""
    heading = "#### A fifth tiny-step run, and where the excess without logging lies"
    section = " ".join((ROOT / "bench/README.md").read_text().split(heading)[1].split("\n#### ")[0].split())
    for label, name, bare in DIAGNOSIS_RUNS:
        data = result(name)
        safe = _ratio_row(data, "nolog", "safe / stock")["step_mean_s"]
        paired = safe["paired"]
        synced = _ratio_row(data, "sync_dist", "safe / stock")["step_mean_s"]["of_medians"]
        bare_row = _ratio_row(data, "nolog", "safe_bare / stock")
        cpu = bare_row["cpu_step_s"]["paired"]
        assert (
            f"| {label} | {bare} | {safe['of_medians']:.3f} | {paired['median']:.3f} [{paired['min']:.3f}, "
            f"{paired['max']:.3f}] | {synced:.3f} | {bare_row['step_mean_s']['of_medians']:.3f} | "
            f"{cpu['median']:.3f} [{cpu['min']:.3f}, {cpu['max']:.3f}] | {_bare_cpu_added(data) * 1e6:+.0f} |"
            in section
        ), label
    configs = {name: result(name)["config"]["bare_kwargs"] for _, name, _ in DIAGNOSIS_RUNS}
    assert configs["tiny_step-ring8-5-24825e3"] == {"desync_detection": False}
    assert configs["tiny_step-no-heartbeat-24825e3"] == {"heartbeat_interval": 0}
    assert configs["tiny_step-all-off-24825e3"] == {
        "heartbeat_interval": 0,
        "desync_detection": False,
        "preemption_signals": None,
        "sharding_check": None,
        "uneven_inputs": None,
        "weight_check": None,
        "track_trainable_set": False,
        "handshake": False,
        "exact_evaluation": False,
    }
    assert result("tiny_step-all-off-24825e3")["meta"]["git"] == "commit 98f917c"
    pool = result("tiny_step-pooled-ring8-5-runs-24825e3")
    assert [s["run"] for s in pool["pooled_from"]] == [f"tiny_step-ring8-{n}-1a09e77" for n in (1, 2, 3, 4)] + [
        "tiny_step-ring8-5-24825e3"
    ]
    nolog = _ratio_row(pool, "nolog", "safe / stock")["step_mean_s"]
    low, high = pool["analysis"]["run_resampled_interval"]["nolog"]
    assert (
        f"the pool of five runs gives {nolog['of_medians']:.3f} without logging** (paired median "
        f"{nolog['paired']['median']:.3f}; resampling runs, then rounds within them, [{low:.3f}, {high:.3f}])"
        in section
    )
    assert nolog["of_medians"] > 1.02 and "Point 3 is still not shown" in section
    loads = [result(part["run"])["meta"]["loadavg_start"][0] for part in pool["pooled_from"]]
    assert loads[-1] < min(loads[:-1])  # "started on a less loaded machine than the four above"
    assert (
        f"load average {loads[-1]:.2f} at its start, {min(loads[:-1]):.2f} to {max(loads[:-1]):.2f} at theirs"
        in section
    )
    fifth = _ratio_row(result("tiny_step-ring8-5-24825e3"), "nolog", "safe / stock")["step_mean_s"]
    assert f"The fifth run alone: {fifth['of_medians']:.3f} (paired median {fifth['paired']['median']:.3f})" in section
    beat = _ratio_row(result("tiny_step-no-heartbeat-24825e3"), "nolog", "safe_bare / stock")["cpu_step_s"]["paired"]
    assert beat["min"] > 1.0  # "in every one of the 10 rounds"
    assert "in every one of the 10 rounds (by CPU" in section
    assert f"{_bare_cpu_added(result('tiny_step-no-heartbeat-24825e3')) * 1e6:.0f} us per step at the median" in section
    assert f"with every option off, {_bare_cpu_added(result('tiny_step-all-off-24825e3')) * 1e6:.0f} us (" in section
    shares = [
        _ratio_row(result(f"tiny_step-{run}-24825e3"), "nolog", "safe / safe_bare")["cpu_step_s"]["paired"]["median"]
        for run in ("no-heartbeat", "all-off")
    ]
    assert (
        f"paired median {shares[0]:.3f} with no heartbeat thread at all (`no-heartbeat`) and {shares[1]:.3f} with "
        "every option off" in section
    )
    aa = result("tiny_step-all-off-aa-6f71f7b")
    assert aa["config"]["bare_kwargs"] == configs["tiny_step-all-off-24825e3"]
    again, bare = (_ratio_row(aa, "nolog", ratio) for ratio in ("stock_again / stock", "safe_bare / stock"))
    assert (
        f"stock again / stock {again['step_mean_s']['of_medians']:.3f} by wall time (paired median "
        f"{again['step_mean_s']['paired']['median']:.3f}) and {again['cpu_step_s']['paired']['median']:.3f} by CPU "
        f"(paired median), safe_bare / stock {bare['step_mean_s']['of_medians']:.3f} by wall time (paired median "
        f"{bare['step_mean_s']['paired']['median']:.3f}) and {bare['cpu_step_s']['paired']['median']:.3f} by CPU"
        in section
    )
    by_cpu = [_ratio_row(result(n), "nolog", "safe_bare / stock")["cpu_step_s"]["paired"]["median"] for n in configs]
    assert min([*by_cpu, bare["cpu_step_s"]["paired"]["median"]]) > 1.0  # "shows by CPU in every run"
    assert bare["step_mean_s"]["of_medians"] <= 1.0005  # "by wall time not in every one"
    own = [
        result(name)["analysis"]["own_cpu_per_step"]["nolog"]["own_threads_s"]["median"]
        for _, name, _ in DIAGNOSIS_RUNS
        if "pooled" not in name
    ]
    assert f"took {min(own) * 1e6:.1f} to {max(own) * 1e6:.1f} us per step in these runs" in section
    tiny = result("strategy_cost-tiny-24825e3")["workloads"][0]
    assert tiny["workload"] == "tiny" and tiny["steps"] == 600
    methods = tiny["own_per_method_s"]
    callbacks = {"ShardingCheck", "WeightSyncCheck", "PreemptionStop"}  # the strategy's three, 6 hooks each
    turns = sum(v for k, v in methods.items() if k.split(".")[0] in callbacks)
    assert sum(k.split(".")[0] in callbacks for k in methods) == 18
    rest = methods["on_train_batch_start"] + methods["optimizer_step"] + methods["post_backward"] + turns
    assert (
        f"{tiny['own_cpu_per_step_s'] * 1e6:.0f} us of own CPU per step, of which the log's `reduce` "
        f"{methods['reduce'] * 1e6:.1f} us and its `self.log` wrapper {methods['self.log wrapper'] * 1e6:.1f} us"
        in section
    )
    assert (
        f"{rest * 1e6:.1f} us: `on_train_batch_start` {methods['on_train_batch_start'] * 1e6:.1f} (its beat once a "
        f"second included), `optimizer_step` {methods['optimizer_step'] * 1e6:.1f}, `post_backward` "
        f"{methods['post_backward'] * 1e6:.1f}, the callbacks' 18 turns {turns * 1e6:.1f}" in section
    )
    stock = next(
        r
        for r in result("tiny_step-ring8-5-24825e3")["analysis"]["rows"]
        if r["mode"] == "nolog" and r["variant"] == "stock"
    )["cpu_step_s"]["median"]
    assert (
        f"That is {rest / stock * 100:.1f}% of stock's {stock * 1e3:.1f} ms of training-thread CPU per step" in section
    )
    hooks = result("tiny_step-all-off-no-hooks-7d13b74")
    assert hooks["config"]["bare_without_step_hooks"] is True
    assert hooks["config"]["safe_kwargs"] == hooks["config"]["bare_kwargs"] == configs["tiny_step-all-off-24825e3"]
    share = _ratio_row(hooks, "nolog", "safe / safe_bare")["cpu_step_s"]
    left = _ratio_row(hooks, "nolog", "safe_bare / stock")["cpu_step_s"]
    assert (
        f"safe / safe_bare by the training thread's CPU: {share['of_medians']:.3f} (paired median "
        f"{share['paired']['median']:.3f} [{share['paired']['min']:.3f}, {share['paired']['max']:.3f}]); without them "
        f"safe_bare / stock by CPU {left['of_medians']:.3f} (paired median {left['paired']['median']:.3f})" in section
    )
    assert left["paired"]["median"] < again["cpu_step_s"]["paired"]["median"]  # "within the A/A run's"
    assert (
        f"{(share['paired']['median'] - 1) * 100:.1f}% to {(share['of_medians'] - 1) * 100:.1f}% of its CPU" in section
    )
    walled = _ratio_row(hooks, "nolog", "safe / stock")["step_mean_s"]["of_medians"]
    assert f"safe (every option off) / stock {walled:.3f}" in section
    counted = result("call_count-24825e3")["modes"]["nolog"]
    calls, extra = counted["calls_per_step"], counted["added_per_step"]
    before = result("call_count-72e9c5a")["modes"]["nolog"]["calls_per_step"]
    assert (
        f"makes {calls['safe'] - calls['stock']:.0f} calls per step more than stock's ({calls['safe']:.0f} against "
        f"{calls['stock']:.0f}; {before['safe'] - before['stock']:.0f} more at 72e9c5a)" in section
    )
    turns = extra["<built-in method builtins.getattr>"] + extra["<built-in method builtins.callable>"]
    functions = {name: n for name, n in extra.items() if ".py:" in name and n >= 0.5}
    assert round(turns) == 36 and round(sum(functions.values())) == 14 and len(functions) == 13
    assert "36 of them are Lightning's `getattr` and `callable` of the 18 hooks" in section
    assert "14 are calls of Python functions" in section and functions["strategy.py:352(model)"] == 2
    added = result("instructions_per_step-6c50b88")["modes"]["nolog"]["training"]
    assert f"({added['added'] / 1e3:.1f}k per step at 6c50b88" in section


USAGE_RUNS = (
    ("1", "step_pauses-usage-98f917c"),
    ("2", "step_pauses-usage-98f917c-2"),
    ("3", "step_pauses-usage-b460fe8-3"),
)


#: the training thread's timed calls at steps of their own, as bench/step_pauses.py names them in its results
USAGE_KINDS = ("beats", "step_dumps", "step_unpickles", "step_parses")


def _bench_section(heading: str) -> str:
    """The text of bench/README.md's section under ``heading`` (to the next ``## `` heading), whitespace collapsed."""
    return " ".join((ROOT / "bench/README.md").read_text().split(heading)[1].split("\n## ")[0].split())


def _ms(call: dict[str, Any], key: str) -> str:
    """``call[key]`` (seconds) in milliseconds, as bench/README.md's step_pauses tables give it."""
    return f"{call[key] * 1e3:.3f}"


def _usage_row(run: object, fit: dict[str, Any], stock_gaps: dict[str, Any]) -> str:
    """A safe fit's row of bench/README.md's step_pauses tables with the calls' usage counts (ms wall / CPU)."""
    ms = _ms

    def part(summary: dict[str, Any]) -> str:
        row = summary["MainThread"]
        return f"{row['count']} ({ms(row, 'longest_wall_s')} / {ms(row, 'longest_cpu_s')})"

    holds, gap = fit["background_holds"], fit["hook_gaps"]
    dumps = [d for d in fit["dumps"]["all"] if d["during_training"]]
    return (
        f"| {run}, {fit['round']} | {holds['stretches']} | {holds['over_1ms']} | {holds['over_1ms_wall']} | "
        f"{holds['over_1ms_on_core']} | {ms(holds['longest'], 'cpu_s')} | "
        + " | ".join(part(fit[kind]) for kind in USAGE_KINDS)
        + f" | {len(dumps)} ({max(d['wall_s'] for d in dumps) * 1e3:.3f} / "
        f"{max(d['cpu_s'] for d in dumps) * 1e3:.3f}) | {sum(d['minor_faults'] for d in dumps)} | "
        f"{ms(gap, 'p999_s')} / {ms(stock_gaps, 'p999_s')} | {ms(gap, 'max_s')} / {ms(stock_gaps, 'max_s')} |"
    )


def test_the_step_pauses_runs_with_each_calls_faults_and_preemptions_are_the_result_files():
    """bench/README.md's three step_pauses runs with the calls' usage counts: table rows and the figures under it."""
    heading = "#### The training thread's long calls, with their page faults and preemptions"
    section = " ".join((ROOT / "bench/README.md").read_text().split(heading)[1].split("\n## ")[0].split())

    ms, longest, kinds = _ms, dict[str, float](), USAGE_KINDS
    safe_fits, gaps = [], []
    for run, name in USAGE_RUNS:
        fits = result(name)["fits"]
        stock = {f["round"]: f["hook_gaps"] for f in fits if f["variant"] == "stock"}
        for fit in (f for f in fits if f["variant"] == "safe"):
            holds, gap = fit["background_holds"], fit["hook_gaps"]
            dumps = [d for d in fit["dumps"]["all"] if d["during_training"]]
            assert _usage_row(run, fit, stock[fit["round"]]) in section, (run, fit["round"])
            safe_fits.append(fit)
            gaps.append((run, fit["round"], gap, stock[fit["round"]]))
            longest["stretch"] = max(longest.get("stretch", 0.0), holds["longest"]["cpu_s"])
            longest["dump"] = max(longest.get("dump", 0.0), *(d["cpu_s"] for d in dumps))
            for kind in kinds:
                longest[kind] = max(longest.get(kind, 0.0), fit[kind]["MainThread"]["longest_cpu_s"])
            assert sum(d["minor_faults"] for d in dumps) == 0  # "took no page fault in any fit"
            assert all(not fit[kind]["MainThread"]["longest_cpu_call"]["gc"] for kind in kinds)
            assert not fit["dumps"]["longest_training_thread_cpu"]["gc"]
    assert len(safe_fits) == 6 and all(f["background_holds"]["over_1ms"] == 0 for f in safe_fits)
    assert max(longest.values()) < 1e-3  # no call of the strategy's over 1 ms of CPU
    assert f"no background stretch (the longest {longest['stretch'] * 1e3:.3f} ms)" in section
    assert f"no torch dump (the longest {longest['dump'] * 1e3:.3f} ms, as an epoch started), beat" in section
    assert (
        f"beat ({longest['beats'] * 1e3:.3f}), audit's dump at a step of its own ({longest['step_dumps'] * 1e3:.3f}), "
        f"unpickling ({longest['step_unpickles'] * 1e3:.3f}) or parsing ({longest['step_parses'] * 1e3:.3f})" in section
    )
    in_step = max(f["step_dumps"]["MainThread"]["longest_cpu_s"] for f in safe_fits)
    assert longest["dump"] > in_step  # the longest torch dump was one as an epoch started
    before = [f for f in result("step_pauses-ring8-fbe7d99-3")["fits"] if f["variant"] == "safe"]
    over = [
        (f["round"], d["cpu_s"])
        for f in before
        for d in f["dumps"]["all"]
        if d["during_training"] and d["cpu_s"] > 1e-3
    ] + [(f["round"], f["beats"]["MainThread"]["longest_cpu_s"]) for f in before]
    over = [o for o in over if o[1] > 1e-3]
    assert len(over) == 3 and len({r for r, _ in over}) == 1  # "three calls ... all in one fit"
    assert "three calls of the training thread crossed 1 ms of CPU in the 12 safe fits, all in one fit" in section
    costs = {
        row["entries"]: row["with_stacks"]["median_s"]
        for row in result("recorder_dump_cost-b0a1d77-2")["rows"]
        if row["entries"] in (8, 16, 32)
    }
    assert (
        f"{costs[8] * 1e3:.3f} ms at the median for 8 entries, {costs[16] * 1e3:.3f} for 16, "
        f"{costs[32] * 1e3:.3f} for 32" in section
    )
    below = [(run, rnd) for run, rnd, gap, stock in gaps if gap["p999_s"] < stock["p999_s"]]
    assert len(below) == 5 and "below stock's in five rounds of six" in section
    (run, rnd, gap, stock) = next(g for g in gaps if (g[0], g[1]) not in below)
    assert f"({ms(gap, 'p999_s')} against {ms(stock, 'p999_s')} ms in run {run}, round {rnd})" in section
    second = [(g, s) for r, _, g, s in gaps if r == "2"]
    assert (
        f"Run 2's longest gaps, {ms(second[0][0], 'max_s')} and {ms(second[1][0], 'max_s')} ms against stock's "
        f"{ms(second[0][1], 'max_s')} and {ms(second[1][1], 'max_s')}" in section
    )
    third = [(g, s) for r, _, g, s in gaps if r == "3"]
    assert all("longest" not in g for g, _ in second)  # run 2 came before the gaps were located
    assert all(
        g["longest"]["after"] == "on_before_backward" and g["longest"]["before"] == "on_after_backward"
        for g, _ in third
    )
    assert (
        f"{ms(third[0][0], 'max_s')} and {ms(third[1][0], 'max_s')} ms against stock's {ms(third[0][1], 'max_s')} "
        f"and {ms(third[1][1], 'max_s')}" in section
    )


def test_the_three_calls_fewer_and_the_sixth_tiny_step_run_are_the_result_files():
    """bench/README.md's section on 9d30435's three calls fewer per step, the sixth tiny-step run, its pool of six and
    the fourth step_pauses run with the calls' usage counts."""
    heading = "#### Three calls fewer per step, a sixth tiny-step run and a fourth run of the long calls"
    text = (ROOT / "bench/README.md").read_text().split(heading)[1].split("\n## ")[0]
    section = " ".join(text.split())
    # counted
    now, before = result("call_count-9d30435")["modes"], result("call_count-24825e3")["modes"]
    calls = {mode: {k: round(v) for k, v in now[mode]["calls_per_step"].items()} for mode in now}
    added = {mode: calls[mode]["safe"] - calls[mode]["stock"] for mode in calls}
    was = {
        mode: round(before[mode]["calls_per_step"]["safe"] - before[mode]["calls_per_step"]["stock"]) for mode in before
    }
    functions = sum(round(v) for k, v in now["nolog"]["added_per_step"].items() if ".py:" in k and v > 0.99)
    assert (
        f"makes {added['nolog']} calls per step more than stock's ({calls['nolog']['safe']} against "
        f"{calls['nolog']['stock']}; {was['nolog']} at 24825e3), {functions} of them Python functions; with the "
        f"`sync_dist` log {added['sync_dist']} more ({was['sync_dist']} at 24825e3)" in section
    )
    gone = ("saving.py:123(closure_waiting_for_snapshot)", "bucket_layout.py:196(after_optimizer_step)")
    assert functions == 11 and all(before["nolog"]["added_per_step"][k] == 1.0 for k in gone)
    assert not any(k in now["nolog"]["added_per_step"] for k in (*gone, "control.py:148(<lambda>)"))
    # timed against the commit before
    ab = result("strategy_cost_ab-fold-9d30435")
    assert ab["base"].startswith("724a2e9") and ab["head"].startswith("9d30435") and len(ab["runs"]) == 5
    own = ab["analysis"]["tiny"]["own"]
    assert f"paired median {own['median']:.3f} [{own['range'][0]:.3f}, {own['range'][1]:.3f}]" in section
    base = [r["base"]["tiny"]["own"] for r in ab["runs"]]
    saved = statistics.median(r["base"]["tiny"]["own"] - r["head"]["tiny"]["own"] for r in ab["runs"])
    assert f"a paired median of {saved:.1f} us against the base's {statistics.median(base):.1f}" in section
    mlp = result("strategy_cost_ab-fold-mlp-b4ab843")
    assert mlp["base"].startswith("724a2e9") and mlp["head"].startswith("b4ab843") and len(mlp["runs"]) == 5
    own, thread = mlp["analysis"]["mlp"]["own"], mlp["analysis"]["mlp"]["training thread"]
    lower = sum(r < 1 for r in thread["ratios"])
    assert (
        f"own CPU per step paired median {own['median']:.3f} [{own['range'][0]:.3f}, {own['range'][1]:.3f}], the "
        f"training thread's part {thread['median']:.3f} [{thread['range'][0]:.3f}, {thread['range'][1]:.3f}], lower "
        f"in {['no', 'one', 'two', 'three', 'four', 'five'][lower]} rounds of five" in section
    )
    base_mlp = [r["base"]["mlp"]["own"] for r in mlp["runs"]]
    assert f"the base's own CPU per step {min(base_mlp):.1f} to {max(base_mlp):.1f} us" in section
    cost, earlier = (result(f"strategy_cost-tiny-{c}")["workloads"][0] for c in ("9d30435", "24825e3"))
    assert (
        f"the own CPU per step was {cost['own_cpu_per_step_s'] * 1e6:.0f} us "
        f"({earlier['own_cpu_per_step_s'] * 1e6:.0f} "
        f"at 24825e3, in an hour whose steps took {earlier['step_cpu_median_s'] * 1e3:.1f} ms of CPU against "
        f"{cost['step_cpu_median_s'] * 1e3:.1f} in this one" in section
    )
    # the sixth tiny-step run and the pool of six
    sixth = result("tiny_step-ring8-6-724a2e9")
    assert (
        sixth["meta"]["git"] == "commit 724a2e9"
        and f"load average of {sixth['meta']['loadavg_start'][0]:.2f}" in section
    )
    safe = _ratio_row(sixth, "nolog", "safe / stock")
    paired, cpu = safe["step_mean_s"]["paired"], safe["cpu_step_s"]["paired"]["median"]
    synced = _ratio_row(sixth, "sync_dist", "safe / stock")["step_mean_s"]["of_medians"]
    assert (
        f"safe/stock {safe['step_mean_s']['of_medians']:.3f} without logging (paired median {paired['median']:.3f} "
        f"[{paired['min']:.3f}, {paired['max']:.3f}]; by the training thread's CPU, paired median {cpu:.3f}), "
        f"{synced:.3f} with the `sync_dist` log" in section
    )
    parts = next(r for r in sixth["analysis"]["step_breakdown"] if (r["mode"], r["variant"]) == ("nolog", "safe"))
    us = {k: parts[f"{k}_added"]["median"] * 1e6 for k in ("step_mean_s", "cpu_step_s", "runqueue_wait_s", "asleep_s")}
    assert (
        f"safe's mean step was {us['step_mean_s']:.0f} us longer than stock's in the same round (median), of which its "
        f"training thread ran {us['cpu_step_s']:.0f} us more, waited {us['runqueue_wait_s']:.0f} us more for a core "
        f"and slept {us['asleep_s']:.0f} us more" in section
    )
    aa = next(
        r
        for r in result("tiny_step-all-off-aa-6f71f7b")["analysis"]["step_breakdown"]
        if (r["mode"], r["variant"]) == ("nolog", "stock_again")
    )
    assert (
        f"a second stock fit's training thread ran {aa['cpu_step_s_added']['median'] * 1e6:.0f} us more than the "
        f"first's and slept {-aa['asleep_s_added']['median'] * 1e6:.0f} us less" in section
    )
    pool = result("tiny_step-pooled-ring8-6-runs-724a2e9")
    assert [s["run"] for s in pool["pooled_from"]] == [name for _, name in RING8_RUNS]
    row = _ratio_row(pool, "nolog", "safe / stock")["step_mean_s"]
    interval = pool["analysis"]["run_resampled_interval"]["nolog"]
    rounds = sum(result(name)["config"]["rounds"] for _, name in RING8_RUNS)
    assert (
        f"{rounds} rounds): **{row['of_medians']:.3f} without logging** (paired median {row['paired']['median']:.3f} "
        f"[{row['paired']['min']:.3f}, {row['paired']['max']:.3f}]; resampling runs, then rounds within them, "
        f"[{interval[0]:.3f}, {interval[1]:.3f}]), "
        f"{_ratio_row(pool, 'sync_dist', 'safe / stock')['step_mean_s']['of_medians']:.3f} with the `sync_dist`"
        in section
    )
    assert row["of_medians"] > 1.02 and "Point 3 is still not shown" in section
    # the two runs with the three calls fewer, and their pool
    fold = [result(f"tiny_step-fold-{n}-c0d3705") for n in (1, 2)]
    assert all(r["meta"]["git"] == "commit c0d3705" for r in fold)
    loads = " and ".join(f"{r['meta']['loadavg_start'][0]:.2f}" for r in fold)
    nolog = [_ratio_row(r, "nolog", "safe / stock")["step_mean_s"] for r in fold]
    synced = [_ratio_row(r, "sync_dist", "safe / stock")["step_mean_s"]["of_medians"] for r in fold]
    assert (
        f"load averages of {loads}): safe/stock without logging {nolog[0]['of_medians']:.3f} and "
        f"{nolog[1]['of_medians']:.3f} (paired medians {nolog[0]['paired']['median']:.3f} and "
        f"{nolog[1]['paired']['median']:.3f}), with the `sync_dist` log {synced[0]:.3f} and {synced[1]:.3f}" in section
    )
    both = result("tiny_step-pooled-fold-2-runs-c0d3705")
    assert [s["run"] for s in both["pooled_from"]] == [f"tiny_step-fold-{n}-c0d3705" for n in (1, 2)]
    two = _ratio_row(both, "nolog", "safe / stock")["step_mean_s"]
    low, high = both["analysis"]["run_resampled_interval"]["nolog"]
    assert (
        f"20 rounds) {two['of_medians']:.3f} without logging (paired median {two['paired']['median']:.3f}, resampled "
        f"[{low:.3f}, {high:.3f}]) and "
        f"{_ratio_row(both, 'sync_dist', 'safe / stock')['step_mean_s']['of_medians']:.3f} with it" in section
    )
    assert (
        nolog[0]["of_medians"] <= 1.02 < nolog[1]["of_medians"]
        and nolog[1]["of_medians"] - 1.02 > row["of_medians"] - 1.02
    )
    # the fourth step_pauses run
    fits = result("step_pauses-fold-9d30435")["fits"]
    stock = {f["round"]: f["hook_gaps"] for f in fits if f["variant"] == "stock"}
    safe_fits = [f for f in fits if f["variant"] == "safe"]
    assert len(safe_fits) == 2 and all(_usage_row(4, f, stock[f["round"]]) in text for f in safe_fits)
    dumps = [d for f in safe_fits for d in f["dumps"]["all"] if d["during_training"]]
    stretch = max(f["background_holds"]["longest"]["cpu_s"] for f in safe_fits)
    calls = [f[kind]["MainThread"]["longest_cpu_s"] for f in safe_fits for kind in USAGE_KINDS]
    assert max(stretch, *calls, *(d["cpu_s"] for d in dumps)) < 1e-3
    assert (
        f"(the longest background stretch {stretch * 1e3:.3f} ms, the longest torch dump "
        f"{max(d['cpu_s'] for d in dumps) * 1e3:.3f} ms of CPU)" in section
    )
    slow = max(dumps, key=lambda d: d["wall_s"])
    assert slow["preempted"] == 1 and (
        f"one torch dump took {slow['wall_s'] * 1e3:.3f} ms of wall time for {slow['cpu_s'] * 1e3:.3f} ms of CPU, "
        "preempted once" in section
    )
    assert all(f["hook_gaps"]["p999_s"] < stock[f["round"]]["p999_s"] for f in safe_fits)
    longest = {(f["round"], f["variant"]): f["hook_gaps"] for f in fits}
    assert all(longest[(1, v)]["longest"]["after"] == "on_train_batch_start" for v in ("safe", "stock"))
    assert all(longest[(1, v)]["longest"]["before"] == "on_before_zero_grad" for v in ("safe", "stock"))
    assert longest[(2, "safe")]["longest"]["after"] == "on_before_backward"
    assert (
        f"{_ms(longest[(1, 'safe')], 'max_s')} ms against {_ms(longest[(1, 'stock')], 'max_s')}; round 2's safe one "
        f"in the backward" in section
    )
    assert f"{_ms(longest[(2, 'safe')], 'max_s')} ms against stock's {_ms(longest[(2, 'stock')], 'max_s')}" in section


def test_the_trainable_set_test_inside_training_steps_is_the_result_files():
    """bench/README.md's section on the trainable-set test timed inside training steps (bench/trainable_test.py)."""
    heading = "### The trainable-set test inside training steps"
    text = (ROOT / "bench/README.md").read_text().split(heading)[1].split("\n## ")[0]
    section = " ".join(text.split())
    runs = {run: result(f"trainable_test-8cb62f3-{run}")["models"] for run in (1, 2)}
    for run, models in runs.items():
        for name, row in models.items():
            calls = row["calls"]
            assert (
                f"| {run} | {name} | {row['tensors']} ({row['trainable']}) | {calls['package']['first_us']:.2f} | "
                f"{calls['python_reads']['first_us']:.2f} | {calls['empty']['first_us']:.2f} | "
                f"{row['package_over_python_reads']:.3f} |" in section
            )
    deep = [models[m]["calls"]["package"]["first_us"] for models in runs.values() for m in ("deep", "deep_frozen")]
    per_tensor = [us / 164 for us in deep]
    assert f"costs {min(per_tensor):.1f} to {max(per_tensor):.1f} us per parameter tensor" in section
    assert f"{min(deep):.0f} to {max(deep):.0f} us for 164 tensors" in section
    ratios = {m: [runs[r][m]["package_over_python_reads"] for r in runs] for m in ("tiny", "deep", "deep_frozen")}
    first = [runs[r][m]["package_over_python_reads_first"] for r in runs for m in ("deep", "deep_frozen")]
    deeper = ratios["deep"] + ratios["deep_frozen"]
    assert f"(package / python reads {min(deeper):.3f} to {max(deeper):.3f} over all steps" in section
    assert f"{min(first):.3f} to {max(first):.3f} first in the step)" in section
    assert f"on the tiny model ({ratios['tiny'][1]:.3f} and {ratios['tiny'][0]:.3f})" in section
    frozen = [f"{runs[r]['deep_frozen']['calls']['package']['first_us']:.2f}" for r in runs]
    python = [f"{runs[r]['deep']['calls']['package']['first_us']:.2f}" for r in runs]
    reads = f"{frozen[0]} and {frozen[1]} us; `deep`'s, which reads all 164 from Python: {python[0]} and {python[1]}"
    assert reads in section
    span = f"{min(deep):.0f} to {max(deep):.0f} us for 164"
    assert_on("README.md", f"{span} parameter tensors inside a training step")
    assert_on("docs/strategy.md", f"costs {min(per_tensor):.1f} to {max(per_tensor):.1f} us per parameter tensor")
    assert_on("docs/strategy.md", f"(`bench/trainable_test.py`: {span} tensors;")


def test_the_per_step_methods_timed_inside_training_steps_are_the_result_files():
    """bench/README.md's section on bench/step_hooks.py's run at c1b3ac5."""
    heading = "#### The strategy's per-step methods timed inside training steps"
    text = (ROOT / "bench/README.md").read_text().split(heading)[1].split("\n## ")[0]
    section = " ".join(text.split())
    parts = result("step_hooks-c1b3ac5")["analysis"]["parts"]
    names = {"on_train_batch_start": "`on_train_batch_start`", "post_backward": "`post_backward`"}
    names["optimizer_step less its closure"] = "`optimizer_step` less its closure"
    for part, shown in names.items():
        row = parts[part]
        low, high = row["added_range_us"]
        assert (
            f"| {shown} | {row['stock_us']:.2f} | {row['safe_us']:.2f} | {row['added_us']:+.2f} "
            f"[{low:+.2f}, {high:+.2f}] |" in section
        )
    start = parts["on_train_batch_start"]
    assert f"costs safe {start['added_us']:.1f} us more per step than stock's" in section
    assert f"({start['added_range_us'][0]:.1f} to {start['added_range_us'][1]:.1f})" in section
    assert f"**`post_backward` adds {parts['post_backward']['added_us']:.1f} us.**" in section
    rounds = result("step_hooks-c1b3ac5")["analysis"]["rounds"]
    own = [f[v]["optimizer_step less its closure"] for f in rounds for v in f]
    assert f"({min(own):.0f} to {max(own):.0f} us in these fits)" in section
    opcodes = result("call_count-opcodes")["modes"]["nolog"]["added_per_step"]
    hook = ("strategy.py:251(on_train_batch_start)", "lifecycle.py:168(note_step)", "heartbeat.py:206(note_step)")
    hook += ("weight_checks.py:72(on_train_batch_start)", "lightning.py:456(read)")
    hook += ("trainable.py:53(changed)", "lifecycle.py:179(raise_agreed_desync)")
    assert f"{sum(opcodes.get(k, 0) for k in hook):.0f} bytecode instructions per step" in section
    pool = result("tiny_step-pooled-ring8-6-runs-724a2e9")["analysis"]["rows"]
    stock = next(r for r in pool if r["variant"] == "stock")
    cpu = stock["cpu_step_s"]["median"]
    assert stock["mode"] == "nolog" and f"{start['added_us'] / (cpu * 1e6):.1%} of the {cpu * 1e3:.2f} ms" in section


def test_the_strategy_cost_workloads_have_the_parameter_tensors_the_trainable_test_section_gives(monkeypatch):
    """bench/README.md's trainable-set section counts the tensors of bench/strategy_cost.py's workloads."""
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    from bench.workloads.run import MLP, SyncedCIFAR10Classifier
    from bench.workloads.tiny import network

    counts = [len(list(m.parameters())) for m in (network(), MLP(), SyncedCIFAR10Classifier())]
    heading = "### The trainable-set test inside training steps"
    section = " ".join((ROOT / "bench/README.md").read_text().split(heading)[1].split("\n## ")[0].split())
    assert (
        f"have {counts[0]} (tiny), {counts[1]} (MLP) and {counts[2]} (the CIFAR-10 example's model) tensors" in section
    )


SIGTERM_SKIP_RUNS = ("tiny_step-sigterm-1-9d06bc5", "tiny_step-sigterm-2-9d06bc5")
SIGTERM_SKIP_POOL = "tiny_step-pooled-sigterm-2-runs-9d06bc5"
NO_SIGTERM_STOCK_RUN = "tiny_step-no-sigterm-stock-ae3b425"
SIGTERM_SKIP_HEADING = "#### Lightning's per-batch SIGTERM broadcast skipped: three tiny-step runs"


def test_the_tiny_step_runs_with_lightnings_sigterm_broadcast_skipped_are_the_result_files():
    """bench/README.md's section on the skipped per-batch SIGTERM broadcast, and README.md's tiny-model row."""
    section = _bench_section(SIGTERM_SKIP_HEADING)
    pool = result(SIGTERM_SKIP_POOL)
    assert [s["run"] for s in pool["pooled_from"]] == list(SIGTERM_SKIP_RUNS)
    names = (*SIGTERM_SKIP_RUNS, NO_SIGTERM_STOCK_RUN)
    nolog = {n: _ratio_row(result(n), "nolog", "safe / stock") for n in (*names, SIGTERM_SKIP_POOL)}
    synced = {n: _ratio_row(result(n), "sync_dist", "safe / stock") for n in (*names, SIGTERM_SKIP_POOL)}
    for name, row in nolog.items():  # the table's rows
        mean, paired = row["step_mean_s"]["of_medians"], row["step_mean_s"]["paired"]
        cells = (
            f"| {mean:.3f}, {paired['median']:.3f} [{paired['min']:.3f}, {paired['max']:.3f}] | "
            f"{row['cpu_step_s']['paired']['median']:.3f} | {synced[name]['step_mean_s']['of_medians']:.3f} | "
            f"{synced[name]['cpu_step_s']['paired']['median']:.3f} |"
        )
        assert cells in section, name
    # point 3: every round of every run at most 1.02, in both modes
    by_run = [nolog[n] for n in names] + [synced[n] for n in names]
    assert max(r["step_mean_s"]["paired"]["max"] for r in by_run) <= 1.02
    highest = max(nolog[n]["step_mean_s"]["paired"]["max"] for n in names)
    means = sorted(nolog[n]["step_mean_s"]["of_medians"] for n in names)
    logged = sorted(synced[n]["step_mean_s"]["of_medians"] for n in names)
    low, high = pool["analysis"]["run_resampled_interval"]["nolog"]
    pooled = nolog[SIGTERM_SKIP_POOL]["step_mean_s"]["of_medians"]
    assert (
        f"safe / stock {means[0]:.3f} to {means[-1]:.3f} without logging (pooled {pooled:.3f}; resampling runs, then "
        f"rounds within them, [{low:.3f}, {high:.3f}]) and {logged[0]:.3f} to {logged[-1]:.3f} with the `sync_dist` "
        f"log; no round's paired ratio above {highest:.3f}" in section
    )
    cpu = sorted(nolog[n]["cpu_step_s"]["paired"]["median"] for n in names)
    assert f"By the training thread's CPU, {cpu[0]:.3f} to {cpu[-1]:.3f} (paired medians)" in section
    # the decomposition: stock without the broadcast, and safe against it
    run = result(NO_SIGTERM_STOCK_RUN)
    skip = _ratio_row(run, "nolog", "stock_no_sigterm / stock")
    assert "0.737 by wall time without logging" in section and f"{skip['step_mean_s']['of_medians']:.3f}" == "0.737"
    assert round(-skip["cpu_step_s"]["paired_difference_s"]["median"] * 1e6) == 176
    (split,) = [
        r for r in run["analysis"]["step_breakdown"] if r["variant"] == "stock_no_sigterm" and r["mode"] == "nolog"
    ]
    asleep, waiting = (round(-split[k]["median"] * 1e6) for k in ("asleep_s_added", "runqueue_wait_s_added"))
    assert f"{asleep} us less asleep and {waiting} us less waiting for a core" in section
    own = _ratio_row(run, "nolog", "safe / stock_no_sigterm")
    wall, by_cpu = own["step_mean_s"], own["cpu_step_s"]
    assert (
        f"without logging {wall['of_medians']:.3f} by wall time (paired median {wall['paired']['median']:.3f} "
        f"[{wall['paired']['min']:.3f}, {wall['paired']['max']:.3f}], its 90% interval "
        f"[{wall['paired_interval'][0]:.3f}, {wall['paired_interval'][1]:.3f}]), by the training thread's CPU "
        f"{by_cpu['of_medians']:.3f} (paired median {by_cpu['paired']['median']:.3f} [{by_cpu['paired']['min']:.3f}, "
        f"{by_cpu['paired']['max']:.3f}]), +{by_cpu['paired_difference_s']['median'] * 1e6:.0f} us of CPU per step"
        in section
    )
    logged_own = _ratio_row(run, "sync_dist", "safe / stock_no_sigterm")["step_mean_s"]["of_medians"]
    assert f"With the `sync_dist` log {logged_own:.3f}" in section
    own_cpu = sorted(
        round(result(n)["analysis"]["own_cpu_per_step"]["nolog"]["total_s"]["median"] * 1e6) for n in names
    )
    assert f"(-{-own_cpu[-1]} to -{-own_cpu[0]} us without logging)" in section
    # README.md's tiny-model row
    row = next(line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("| a tiny model's"))
    assert (
        f"since 9d06bc5: without logging {means[0]:.3f} to {means[-1]:.3f} by run (every round at most "
        f"{highest:.3f}), {logged[0]:.3f} to {logged[-1]:.3f} with `self.log(..., sync_dist=True)` every step" in row
    )
    assert (
        f"against stock with that broadcast skipped too, {wall['of_medians']:.3f} (by the training thread's CPU "
        f"{by_cpu['of_medians']:.3f}, +{by_cpu['paired_difference_s']['median'] * 1e6:.0f} us per step" in row
    )


def test_the_step_pauses_runs_with_the_sigterm_broadcast_skipped_are_the_result_files():
    """bench/README.md's point-2 bullet of the section on the skipped SIGTERM broadcast: the two step_pauses runs."""
    section = _bench_section(SIGTERM_SKIP_HEADING)
    ms = _ms

    def training_thread_calls(fit: dict[str, Any]) -> list[float]:
        dumps = [d["cpu_s"] for d in fit["dumps"]["all"] if d["during_training"]]
        return dumps + [fit[kind]["MainThread"]["longest_cpu_s"] for kind in USAGE_KINDS]

    fits = result("step_pauses-sigterm-154a8c5")["fits"]
    safe = [f for f in fits if f["variant"] == "safe"]
    stock = {f["round"]: f for f in fits if f["variant"] == "stock"}
    assert len(safe) == 2 and all(f["background_holds"]["over_1ms"] == 0 for f in safe)
    assert max(max(training_thread_calls(f)) for f in safe) < 1e-3
    stretch = max(f["background_holds"]["longest"]["cpu_s"] for f in safe)
    dump = max(d["cpu_s"] for f in safe for d in f["dumps"]["all"] if d["during_training"])
    step_dump, beat = (max(f[k]["MainThread"]["longest_cpu_s"] for f in safe) for k in ("step_dumps", "beats"))
    assert (
        f"no background stretch over 1 ms (the longest {stretch * 1e3:.3f} ms of thread CPU) and no call of the "
        f"strategy's on the training thread over 1 ms of CPU: the longest a torch dump of {dump * 1e3:.3f} ms, an "
        f"audit's dump at a step of its own {step_dump * 1e3:.3f}, a beat {beat * 1e3:.3f}" in section
    )
    gaps = sorted(safe, key=lambda f: f["round"])
    assert all(f["hook_gaps"]["p999_s"] < stock[f["round"]]["hook_gaps"]["p999_s"] for f in gaps)
    assert (
        f"({ms(gaps[0]['hook_gaps'], 'p999_s')} and {ms(gaps[1]['hook_gaps'], 'p999_s')} ms against "
        f"{ms(stock[1]['hook_gaps'], 'p999_s')} and {ms(stock[2]['hook_gaps'], 'p999_s')})" in section
    )
    busy = [f for f in result("step_pauses-sigterm-beside-mypy-ae3b425")["fits"] if f["variant"] == "safe"]
    (quiet,) = [f for f in busy if max(training_thread_calls(f)) < 1e-3]
    (loaded,) = [f for f in busy if f is not quiet]
    assert loaded["round"] == 2 and loaded["background_holds"]["over_1ms"] == 0
    dumps = sorted(d["cpu_s"] for d in loaded["dumps"]["all"] if d["during_training"] and d["cpu_s"] > 1e-3)
    step_dumps = loaded["step_dumps"]["MainThread"]["longest_cpu_s"]
    assert len(dumps) == 3 and step_dumps > 1e-3 and loaded["beats"]["MainThread"]["longest_cpu_s"] < 1e-3
    long_calls = [d for d in loaded["dumps"]["all"] if d["cpu_s"] > 1e-3]
    assert (
        not any(d["preempted"] for d in long_calls)
        and not loaded["step_dumps"]["MainThread"]["longest_cpu_call"]["preempted"]
    )  # "none preempted"
    assert (
        f"three torch dumps ({dumps[0] * 1e3:.3f} to {dumps[-1] * 1e3:.3f} ms) and an audit's dump "
        f"({step_dumps * 1e3:.3f}), while its beats ({loaded['beats']['MainThread']['longest_cpu_s'] * 1e3:.3f}) "
        f"and unpickling ({loaded['step_unpickles']['MainThread']['longest_cpu_s'] * 1e3:.3f})" in section
    )


def test_point_1_remeasured_at_4d75014_is_the_result_files():
    """bench/README.md's table of point 1 at 4d75014: the tiny model's and the MLP's own CPU by part."""
    section = _bench_section("#### Point 1 re-measured at 4d75014 (2026-12-03)")
    rows = {}
    for workload in ("tiny", "mlp"):
        (row,) = result(f"strategy_cost-{workload}-options-4d75014")["workloads"]
        assert row["workload"] == workload
        rows[workload] = row
    tiny, mlp = rows["tiny"], rows["mlp"]

    def logged(row: dict[str, Any]) -> float:
        return (row["own_per_method_s"]["reduce"] + row["own_per_method_s"]["self.log wrapper"]) * 1e6

    def thread(row: dict[str, Any]) -> float:
        return row["threads_cpu_per_step_s"]["ddp_strategy-heartbeat-rank0"] * 1e6

    own = {name: row["own_cpu_per_step_s"] * 1e6 for name, row in rows.items()}
    value = {name: row["per_sync_dist_value_s"]["median"] * 1e6 for name, row in rows.items()}
    start = {name: row["own_per_method_s"]["on_train_batch_start"] * 1e6 for name, row in rows.items()}
    expected = [
        f"| step CPU (ms, median) | {tiny['step_cpu_median_s'] * 1e3:.1f} | {mlp['step_cpu_median_s'] * 1e3:.1f} |",
        f"| own CPU per step, in all | {own['tiny']:.0f} | {own['mlp']:.0f} |",
        f"| {logged(tiny):.1f} | {logged(mlp):.1f} |",
        f"| {thread(tiny):.1f} | {thread(mlp):.1f} |",
        f"once a second) | {start['tiny']:.1f} | {start['mlp']:.1f} |",
        f"| per `sync_dist` value: wrapper and `reduce`, median | {value['tiny']:.1f} | {value['mlp']:.1f} |",
        f"the tiny step's own CPU is {own['tiny'] - logged(tiny):.0f} us (50 allowed); the MLP's "
        f"{own['mlp'] - logged(mlp):.0f} us",
        f"A `sync_dist` value costs {value['tiny']:.1f} us on the tiny model and {value['mlp']:.1f} on the MLP",
    ]
    for text in expected:
        assert text in section, text


def test_the_instruments_floor_section_is_the_result_files():
    """bench/README.md's control runs at 842e1db, and the control-first runs that showed an oversized recorder."""
    section = _bench_section("#### The instrument's floor, and a process group the strategy did not make")

    def logged(row: dict[str, Any]) -> float:
        return (row["own_per_method_s"]["reduce"] + row["own_per_method_s"]["self.log wrapper"]) * 1e6

    nets: dict[str, list[float]] = {"tiny": [], "mlp": []}
    for workload in ("tiny", "mlp"):
        for run in (1, 2, 3):
            data = result(f"strategy_cost-control-{workload}-{run}-842e1db")
            (mine,), (control,) = data["workloads"], data["control_workloads"]
            assert mine["strategy"] == "safe" and control["strategy"] == "control" and mine["workload"] == workload
            own, floor = mine["own_cpu_per_step_s"] * 1e6, control["own_cpu_per_step_s"] * 1e6
            value = mine["per_sync_dist_value_s"]["median"] * 1e6
            value_floor = control["per_sync_dist_value_s"]["median"] * 1e6
            row = (
                f"| {workload} | {run} | {mine['step_cpu_median_s'] * 1e3:.1f} | {own:.0f} | {floor:.0f} | "
                f"{own - floor:.0f} | {value:.1f} | {value_floor:.1f} | {value - value_floor:.1f} |"
            )
            assert row in section, row
            nets[workload].append(own - logged(mine) - (floor - logged(control)))
    assert f"the tiny step's own CPU is {min(nets['tiny']):.0f}-{max(nets['tiny']):.0f} us" in section
    assert f"the MLP's {min(nets['mlp']):.0f}-{max(nets['mlp']):.0f} (not met" in section
    first = [
        result(f"strategy_cost-control-first-mlp-{run}-136ddf2")["workloads"][0]["own_per_method_s"]
        for run in (1, 2, 3)
    ]
    starts = sorted(m["on_train_batch_start"] * 1e6 for m in first)
    assert f"cost {starts[0]:.0f}-{starts[-1]:.0f} us per step instead of about 80" in section
    fixed = result("strategy_cost-control-first-mlp-fixed-842e1db")["workloads"][0]["own_per_method_s"]
    assert f"the same control-first run then read {fixed['on_train_batch_start'] * 1e6:.1f} us" in section


def test_the_per_value_ablations_and_the_mlps_beat_are_the_result_files():
    """bench/README.md's ablations of a `sync_dist` value's path at 6ab8daa, and the MLP's heartbeat by part."""
    section = _bench_section("#### What a `sync_dist` value's cost is made of, and what the MLP's beat costs")

    def nets(name: str) -> tuple[float, float, float]:
        data = result(f"strategy_cost-ablation-{name}-6ab8daa")
        (mine,), (control,) = data["workloads"], data["control_workloads"]
        assert mine["workload"] == "tiny" and mine["steps"] == 60 and control["strategy"] == "control"
        keys = [mine["own_per_method_s"][k] - control["own_per_method_s"][k] for k in ("reduce", "self.log wrapper")]
        value = mine["per_sync_dist_value_s"]["median"] - control["per_sync_dist_value_s"]["median"]
        return keys[0] * 1e6, keys[1] * 1e6, value * 1e6

    cells = [f"{v:.1f}" for v in nets("none")]
    assert f"| unchanged | {' | '.join(cells)} |" in section
    for label, name in (
        ("B: no ledger, note or texts", "B"),
        ("C: no uneven-evaluation check", "C"),
        ("D: no wrapper", "D"),
    ):
        runs = [nets(f"{name}-{run}") for run in (1, 2)]
        row = " | ".join(f"{runs[0][i]:.1f}, {runs[1][i]:.1f}" for i in range(3))
        assert f"| {label} | {row} |" in section, row

    floors = [
        result(f"strategy_cost-ablation-{name}-6ab8daa")["control_workloads"][0]["per_sync_dist_value_s"]["median"]
        * 1e6
        for name in ("none", "B-1", "B-2", "C-1", "C-2", "D-1", "D-2")
    ]
    assert f"the control's {min(floors):.0f}-{max(floors):.0f} us per value for code that does nothing" in section

    mlp = result("strategy_cost-heartbeat-parts-mlp-6ab8daa")["workloads"][0]
    parts, calls = mlp["heartbeat_parts"]["cpu_per_step_s"], mlp["heartbeat_parts"]["calls_in_window"]
    steps = mlp["steps"]

    def per_call(part: str) -> float:
        (key,) = [k for k in parts if part in k]
        return parts[key] * steps / calls[key] * 1e6

    beat = "training thread: the beat (`beat_if_due`)"
    assert f"a beat costs about {round(per_call(beat), -1):.0f} us ({parts[beat] * 1e6:.1f} us per step over" in section
    assert f"{per_call('the position'):.0f} us of it the position's publication" in section
    assert f"{per_call('the desync monitor' + chr(39) + 's beat'):.0f} the desync monitor's part" in section
    assert f"the look after it about {round(per_call('_look'), -1):.0f} us" in section
    assert f"{per_call('multi_get'):.0f} of it one" in section
    threads = [k for k in parts if k.startswith(("training thread: the beat", "heartbeat thread"))]
    total = sum(parts[k] for k in threads) * 1e6
    rate = 1 / mlp["step_cpu_median_s"]
    assert f"together come to {total:.0f} us per step of {mlp['step_cpu_median_s'] * 1e3:.0f} ms" in section
    assert f"({rate:.0f} steps a second); 50 us per step would leave {50 * rate:.0f} us" in section


RERUN_HEADING = "#### Points 2 and 3 re-run on the current code (2026-12-03, session 44)"


def test_points_2_and_3_rerun_on_the_current_code_are_the_result_files():
    """bench/README.md's re-run of points 2 and 3 after session 43's changes: the tiny-step and step_pauses runs."""
    section = _bench_section(RERUN_HEADING).split("####")[0]
    run = result("tiny_step-95e12eb")
    for mode, label in (("nolog", "without logging"), ("sync_dist", "with the `sync_dist` log")):
        row = _ratio_row(run, mode, "safe / stock")
        wall, paired = row["step_mean_s"]["of_medians"], row["step_mean_s"]["paired"]
        assert f"**{wall:.3f}** {label} (paired {paired['median']:.3f} [{paired['min']:.3f}, {paired['max']:.3f}]" in (
            section
        )
        assert paired["max"] <= 1.02  # "met in both modes, in every round"
    nolog, synced = (_ratio_row(run, mode, "safe / stock") for mode in ("nolog", "sync_dist"))
    low, high = nolog["step_mean_s"]["paired_interval"]
    assert f"its 90% interval [{low:.3f}, {high:.3f}]; by the training thread's CPU " in section
    assert f"CPU {nolog['cpu_step_s']['of_medians']:.3f}) and" in section
    assert f"CPU {synced['cpu_step_s']['of_medians']:.3f}): met" in section

    fits = result("step_pauses-58240dd")["fits"]
    safe = sorted((f for f in fits if f["variant"] == "safe"), key=lambda f: f["round"])
    stock = sorted((f for f in fits if f["variant"] == "stock"), key=lambda f: f["round"])
    assert len(safe) == 2 and all(f["background_holds"]["over_1ms"] == 0 for f in safe)
    stretches = " and ".join(_ms(f["background_holds"]["longest"], "cpu_s") for f in safe)
    assert f"no background stretch over 1 ms of CPU (the longest {stretches} ms, the heartbeat thread)" in section
    first = " and ".join(f"{f['dumps']['first']['cpu_s'] * 1e3:.2f}" for f in safe)
    assert not any(f["dumps"]["first"]["during_training"] for f in safe)
    assert f"the first recorder dump with stacks before training ({first} ms)" in section
    gaps = {k: [_ms(f["hook_gaps"], k) for f in (*safe, *stock)] for k in ("p999_s", "max_s")}
    assert all(s["hook_gaps"]["p999_s"] < t["hook_gaps"]["p999_s"] for s, t in zip(safe, stock, strict=True))
    p, m = gaps["p999_s"], gaps["max_s"]
    assert f"(99.9th percentile {p[0]} and {p[1]} ms against {p[2]} and {p[3]}; the longest {m[0]}" in section
    assert f"and {m[1]} against {m[2]} and {m[3]})" in section
    over = [f["dumps"]["training_thread_over_1ms_cpu"] for f in safe]
    assert over[0] == [] and len(over[1]) == 1 and over[1][0]["preempted"] == 0 and over[1][0]["minor_faults"] == 0
    assert f"in round 2 one torch dump of {_ms(over[1][0], 'cpu_s')} ms (no page fault, not preempted)" in section
    step_dump, beat = (max(f[k]["MainThread"]["longest_cpu_s"] for f in safe) for k in ("step_dumps", "beats"))
    assert step_dump < over[1][0]["cpu_s"]  # "by elimination" an epoch start's dump
    assert f"took at most {step_dump * 1e3:.3f} ms whole, beats at most {beat * 1e3:.3f})" in section


POINT_1_NOW_HEADING = "#### Point 1 on the current code (2026-12-03, session 44)"
POINT_1_NOW_RUNS = {
    "tiny": [f"strategy_cost-control-tiny-{run}-58240dd" for run in (1, 2, 3)],
    "mlp": [f"strategy_cost-control-mlp-{run}-58240dd" for run in (1, 2, 3, 4, 5)],
    "old": [f"strategy_cost-control-mlp-code-842e1db-{run}" for run in (1, 2)],
}


def test_point_1_on_the_current_code_is_the_result_files():
    """bench/README.md's point-1 table at 58240dd (and 842e1db's code beside it), and its bullets' ranges."""
    section = _bench_section(POINT_1_NOW_HEADING).split("####")[0]

    def logged(row: dict[str, Any]) -> float:
        return (row["own_per_method_s"]["reduce"] + row["own_per_method_s"]["self.log wrapper"]) * 1e6

    nets: dict[str, list[float]] = {}
    values: dict[str, list[float]] = {}
    floors: dict[str, list[float]] = {}
    beats: dict[str, list[float]] = {}
    for group, names in POINT_1_NOW_RUNS.items():
        for run, name in enumerate(names, start=1):
            data = result(name)
            (mine,), (control,) = data["workloads"], data["control_workloads"]
            assert mine["strategy"] == "safe" and control["strategy"] == "control"
            assert mine["steps"] == (600 if group == "tiny" else 120)
            own, floor = mine["own_cpu_per_step_s"] * 1e6, control["own_cpu_per_step_s"] * 1e6
            net = own - logged(mine) - (floor - logged(control))
            value, value_floor = (r["per_sync_dist_value_s"]["median"] * 1e6 for r in (mine, control))
            heartbeat = mine["threads_cpu_per_step_s"]["ddp_strategy-heartbeat-rank0"] * 1e6
            code = "842e1db" if group == "old" else "58240dd"
            row = (
                f"| {mine['workload']} | {code}, {run} | {mine['step_cpu_median_s'] * 1e3:.1f} | {own:.0f} | "
                f"{floor:.0f} | {own - floor:.0f} | {net:.0f} | {heartbeat:.1f} | {value:.1f} | {value_floor:.1f} | "
                f"{value - value_floor:.1f} |"
            )
            assert row in section, row
            nets.setdefault(group, []).append(round(net))
            values.setdefault(group, []).append(round(value - value_floor, 1))
            floors.setdefault(group, []).append(round(value_floor, 1))
            beats.setdefault(group, []).append(round(heartbeat))
    tiny, mlp = (sorted(nets[g]) for g in ("tiny", "mlp"))
    assert tiny[-1] <= 50  # "met"
    assert f"**Per step, the tiny model: {tiny[0]}-{tiny[-1]} us less the control without its value**" in section
    assert f"**Per step, the MLP: {mlp[0]}-{mlp[-1]} us** (not met)" in section
    alternating = [nets["mlp"][3], nets["mlp"][4]]  # runs 4 and 5, each right after a run of 842e1db's code
    assert f"read {nets['old'][0]} and {nets['old'][1]}, against {alternating[0]} and {alternating[1]}" in section
    assert f"moves from {min(beats['mlp'])} to {max(beats['mlp'])} us per step" in section
    value_text = (
        f"{min(values['tiny']):.1f}-{max(values['tiny']):.1f} us on the tiny model and "
        f"{min(values['mlp']):.1f}-{max(values['mlp']):.1f} on the MLP, less the control"
    )
    assert value_text in section and min(values["tiny"]) > 10
    floor_text = (
        f"{min(floors['tiny']):.1f}-{max(floors['tiny']):.1f} and {min(floors['mlp']):.1f}-{max(floors['mlp']):.1f}"
    )
    assert f"where the control itself reads {floor_text}" in section


def test_the_issue_30_summary_gives_the_figures_of_the_sections_it_names():
    """bench/README.md's table of where each point of issue 30 stands quotes the sections that decide them."""
    readme = page("bench/README.md")
    summary = readme.split("## Issue 30 (the cost per step): where each point stands")[1].split(" ## ")[0]
    point_1 = _bench_section(POINT_1_NOW_HEADING).split("####")[0]
    reruns = _bench_section(RERUN_HEADING).split("####")[0]
    for text, section in (
        ("41-47 us less the", point_1),
        ("206-294 us", point_1),
        ("13.4-20.2 us on the tiny model and 30.0-40.3 on the MLP", point_1),
        ("one torch dump of 1.034 ms", reruns),
        ("**0.848** without logging", reruns),
        ("**0.782** with the `sync_dist` log", reruns),
        ("[0.794, 0.952]", reruns),
        ("where the control itself reads 18.5-19.7 and 27.7-36.1", point_1),  # the summary's floor: 18.5-36.1
    ):
        assert text in section, text
    for text in (
        "41-47 us",
        "206-294 us",
        "13.4-20.2 us",
        "30.0-40.3",
        "(the floor itself 18.5-36.1)",
        "1.034 ms",
        "0.848 and 0.782",
        "0.952",
    ):
        assert text in summary, text
    for heading in (POINT_1_NOW_HEADING, RERUN_HEADING):
        assert heading.removeprefix("#### ") in summary
