"""The CPU time SafeDDPStrategy's own code adds to a training step, measured directly by instrumentation.

Usage: python bench/strategy_cost.py [--devices N] [--steps N] [--results-dir DIR]

``bench/suite.py`` compares whole steps of interleaved fits of stock ``DDPStrategy`` and ``SafeDDPStrategy()``. On
this shared 2-core machine the same configuration's step time moves by 2-6% between fits and rounds (where the
25.6M-parameter MLP's memory lands, what the other processes do), so a ratio target of <= 1.01 cannot be read off
it with a handful of rounds. This script measures the difference itself: in fits of the suite's two workloads with
``SafeDDPStrategy()`` at its defaults (Lightning's own launcher, gloo, one thread per rank), every method that
``SafeDDPStrategy`` overrides is wrapped with a thread-CPU-time counter, and so is the ``DDPStrategy``
implementation it calls through ``super()``; the strategy's *own* time of a method is the first minus the second.
The hooks of the callback the strategy adds (the epoch-end weight agreement) count whole, and the strategy's
background threads (the control plane's heartbeat) count by their thread CPU clocks. The window is ``--steps``
training steps after a warm-up; the epoch-end weight agreement, once per epoch, is reported on its own.

Writes ``strategy_cost.json`` and ``strategy_cost.md`` into ``--results-dir`` (default ``bench/results``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "workloads"))
sys.path.insert(0, str(ROOT))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from run import MLP, MLP_SHAPE, SyncedCIFAR10Classifier  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from ddp_strategy import SafeDDPStrategy  # noqa: E402

WARMUP = 5
BATCH = {"mlp": 8, "cifar": 16}  # per rank, as in bench/suite.py


class Counters:
    """Thread CPU seconds and calls per key: ``outer`` (SafeDDPStrategy's methods, callbacks' hooks), ``inner``."""

    def __init__(self) -> None:
        self.outer: dict[str, float] = {}
        self.inner: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        #: per call, inside the window: the own CPU seconds of the strategy's collectives (PER_CALL)
        self.per_call: dict[str, list[float]] = {}
        self.recording = False

    def snapshot(self) -> tuple[dict[str, float], dict[str, float], dict[str, int]]:
        return dict(self.outer), dict(self.inner), dict(self.calls)


def _timed(method: Callable[..., Any], key: str, into: dict[str, float], calls: dict[str, int] | None) -> Any:
    @functools.wraps(method)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.thread_time()
        try:
            return method(*args, **kwargs)
        finally:
            into[key] = into.get(key, 0.0) + time.thread_time() - start
            if calls is not None:
                calls[key] = calls.get(key, 0) + 1

    return timed


#: the strategy's collectives, whose own time is also kept per call (for a median per call)
PER_CALL = ("reduce", "all_gather", "broadcast")


def _timed_per_call(method: Callable[..., Any], key: str, counters: Counters) -> Any:
    """As :func:`_timed` into ``counters.outer``, and each call's own time (minus the ``super()`` part) kept."""

    @functools.wraps(method)
    def timed(*args: Any, **kwargs: Any) -> Any:
        inner_before = counters.inner.get(key, 0.0)
        start = time.thread_time()
        try:
            return method(*args, **kwargs)
        finally:
            took = time.thread_time() - start
            counters.outer[key] = counters.outer.get(key, 0.0) + took
            counters.calls[key] = counters.calls.get(key, 0) + 1
            if counters.recording:
                own = took - (counters.inner.get(key, 0.0) - inner_before)
                counters.per_call.setdefault(key, []).append(own)

    return timed


def instrument_strategy(counters: Counters) -> Callable[[], None]:
    """Wrap every method SafeDDPStrategy defines and its ``super()`` target; returns the function that undoes it."""
    undo: list[Callable[[], None]] = []
    for name, attr in list(vars(SafeDDPStrategy).items()):
        if name.startswith("__") or not callable(attr) or isinstance(attr, (staticmethod, classmethod, type)):
            continue
        wrapped = (
            _timed_per_call(attr, name, counters)
            if name in PER_CALL
            else _timed(attr, name, counters.outer, counters.calls)
        )
        setattr(SafeDDPStrategy, name, wrapped)
        undo.append(functools.partial(setattr, SafeDDPStrategy, name, attr))
        parent = getattr(DDPStrategy, name, None)
        if callable(parent):  # what super().<name>() reaches: only SafeDDPStrategy's methods call it in this script
            had_own = name in vars(DDPStrategy)
            setattr(DDPStrategy, name, _timed(parent, name, counters.inner, None))
            undo.append(
                functools.partial(setattr, DDPStrategy, name, parent)
                if had_own
                else functools.partial(delattr, DDPStrategy, name)
            )

    def restore() -> None:
        for action in reversed(undo):
            action()

    return restore


def instrument_callback(callback: Callback, counters: Counters) -> None:
    """Wrap the ``on_*`` hooks of a callback the strategy added (they count whole: all of it is the strategy's)."""
    for attr in dir(callback):
        if attr.startswith("on_"):
            key = f"{type(callback).__name__}.{attr}"
            setattr(callback, attr, _timed(getattr(callback, attr), key, counters.outer, counters.calls))


def strategy_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("ddp_strategy-")]


def thread_cpu(thread: threading.Thread) -> float:
    assert thread.ident is not None
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except (OSError, ProcessLookupError):  # the thread has ended
        return 0.0


class Window(Callback):
    """Snapshots at the start of step ``WARMUP`` and of step ``WARMUP + steps``, and the training thread's CPU."""

    def __init__(self, counters: Counters, steps: int) -> None:
        self.counters, self.steps = counters, steps
        self.start: Any = None
        self.end: Any = None
        self.step_cpu: list[float] = []
        self._begin = 0.0
        self._instrumented: set[int] = set()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        for cb in trainer.callbacks:  # type: ignore[attr-defined]
            if type(cb).__module__.startswith("ddp_strategy") and id(cb) not in self._instrumented:
                instrument_callback(cb, self.counters)  # added by the strategy in its setup
                self._instrumented.add(id(cb))
        if idx in (WARMUP, WARMUP + self.steps):
            threads = {t.name: thread_cpu(t) for t in strategy_threads()}
            mark = (self.counters.snapshot(), threads)
            if idx == WARMUP:
                self.start = mark
            else:
                self.end = mark
            self.counters.recording = idx == WARMUP
        self._begin = time.thread_time()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        if WARMUP <= idx < WARMUP + self.steps:
            self.step_cpu.append(time.thread_time() - self._begin)


def own_per_step(window: Window) -> tuple[dict[str, float], dict[str, int], dict[str, float]]:
    (outer0, inner0, calls0), threads0 = window.start
    (outer1, inner1, calls1), threads1 = window.end
    steps = window.steps
    own = {
        key: ((outer1.get(key, 0.0) - outer0.get(key, 0.0)) - (inner1.get(key, 0.0) - inner0.get(key, 0.0))) / steps
        for key in outer1
    }
    calls = {key: calls1.get(key, 0) - calls0.get(key, 0) for key in calls1}
    own = {k: v for k, v in own.items() if calls.get(k, 0) > 0}
    threads = {name: (threads1.get(name, 0.0) - cpu) / steps for name, cpu in threads0.items()}
    return own, {k: v for k, v in calls.items() if v > 0}, threads


def fit(workload: str, devices: int, steps: int, root: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model: pl.LightningModule
    if workload == "mlp":
        model = MLP()
        data = TensorDataset(torch.randn(BATCH["mlp"] * devices * (WARMUP + steps + 1), MLP_SHAPE[0]))
    else:
        model = SyncedCIFAR10Classifier()  # the suite's workload: one sync_dist value logged per step
        count = BATCH["cifar"] * devices * (WARMUP + steps + 1)
        data = TensorDataset(torch.randn(count, 3, 32, 32), torch.randint(0, 10, (count,)))
    counters = Counters()
    window = Window(counters, steps)
    restore = instrument_strategy(counters)
    try:
        trainer = pl.Trainer(
            default_root_dir=root,
            accelerator="cpu",
            devices=devices,
            # DDP_STRATEGY_BENCH_NO_DESYNC=1: the same without desync detection, for a side-by-side figure
            strategy=SafeDDPStrategy(desync_detection=os.environ.get("DDP_STRATEGY_BENCH_NO_DESYNC") != "1"),
            max_epochs=1,  # one epoch of WARMUP + steps + 1 steps: the epoch-end check runs once, after the window
            callbacks=[window],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
        )
        trainer.fit(model, DataLoader(data, batch_size=BATCH[workload], shuffle=True))
    finally:
        restore()
    own, calls, threads = own_per_step(window)
    epoch_end = {k: v for k, v in counters.outer.items() if k.endswith("on_train_epoch_end")}
    per_step_total = sum(own.values()) + sum(threads.values())
    step_cpu = statistics.median(window.step_cpu)
    return {
        "workload": workload,
        "parameters": sum(p.numel() for p in model.parameters()),
        "steps": steps,
        "step_cpu_median_s": step_cpu,
        "own_cpu_per_step_s": per_step_total,
        "fraction_of_step": per_step_total / step_cpu,
        "own_per_method_s": dict(sorted(own.items(), key=lambda kv: -kv[1])),
        "calls_in_window": calls,
        "threads_cpu_per_step_s": threads,
        "epoch_end_check_s": epoch_end,
        # own CPU per call of the strategy's collectives in the window: median, 10th and 90th percentile
        "own_per_call_s": {
            key: {"median": statistics.median(v), "p10": quantile(v, 0.1), "p90": quantile(v, 0.9), "calls": len(v)}
            for key, v in sorted(counters.per_call.items())
            if v
        },
    }


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def render(result: dict[str, Any]) -> list[str]:
    lines = [
        f"Measured {result['date']} on {result['machine']['platform']}, torch {result['machine']['torch']}, "
        f"Lightning {result['machine']['lightning']}: `SafeDDPStrategy()` at its defaults, {result['devices']} "
        f"rank(s) (Lightning's launcher, gloo, one thread per rank), rank 0's figures, {WARMUP} warm-up steps then "
        "a window of the steps below. Own time = CPU time inside `SafeDDPStrategy`'s methods minus the "
        "`DDPStrategy` code they call, plus the hooks of the callback it adds and its background threads. It "
        "includes the instrumentation's own clock reads (about 1 us per call).",
        "",
        "| workload | parameters | steps | step CPU (ms, median) | own CPU per step (us) | share of the step | "
        "implied safe/stock | epoch-end weight agreement (ms, once per epoch) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in result["workloads"]:
        epoch_end = sum(row["epoch_end_check_s"].values())
        lines.append(
            f"| {row['workload']} | {row['parameters']:,} | {row['steps']} | {row['step_cpu_median_s'] * 1e3:.1f} | "
            f"{row['own_cpu_per_step_s'] * 1e6:.0f} | {row['fraction_of_step']:.3%} | "
            f"{1 + row['fraction_of_step']:.4f} | {epoch_end * 1e3:.1f} |"
        )
    lines += ["", "Own CPU time per step by method (us; calls in the window in brackets):", ""]
    for row in result["workloads"]:
        parts = [
            f"`{k}` {v * 1e6:.1f} ({row['calls_in_window'].get(k, 0)})" for k, v in row["own_per_method_s"].items()
        ]
        parts += [f"thread `{k}` {v * 1e6:.1f}" for k, v in row["threads_cpu_per_step_s"].items()]
        lines.append(f"- {row['workload']}: " + ", ".join(parts))
    head = "Own CPU time per call of the strategy's collectives (us, median [10th, 90th percentile], calls):"
    lines += ["", head, ""]
    for row in result["workloads"]:
        parts = [
            f"`{k}` {v['median'] * 1e6:.1f} [{v['p10'] * 1e6:.1f}, {v['p90'] * 1e6:.1f}] ({v['calls']})"
            for k, v in row.get("own_per_call_s", {}).items()
        ]
        lines.append(f"- {row['workload']}: " + (", ".join(parts) or "none"))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--workloads", nargs="+", default=["mlp", "cifar"], choices=["mlp", "cifar"])
    parser.add_argument("--results-dir", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    scratch = tempfile.mkdtemp(prefix="strategy-cost-")
    rows = [fit(w, args.devices, args.steps, scratch) for w in args.workloads]
    if int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return
    result = {
        "devices": args.devices,
        "workloads": rows,
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "lightning": pl.__version__,
        },
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    lines = render(result)
    out = Path(args.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "strategy_cost.json").write_text(json.dumps(result, indent=2))
    (out / "strategy_cost.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
