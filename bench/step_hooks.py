"""The strategy's per-step hooks timed where they run: inside training steps, ``SafeDDPStrategy()`` against stock.

Usage: python bench/step_hooks.py [--steps N] [--rounds R] [--results-dir DIR] [--name NAME]

A strategy method Lightning calls at every training step costs far more inside a step, where the step's own work has
taken the caches, than in a loop (``bench/trainable_test.py``: several times as much per parameter read). End-to-end
ratios (``bench/tiny_step.py``) move by more than a few microseconds between runs on this machine, so this times
the hooks themselves: in a 2-rank fit of ``bench/tiny_step.py``'s model (Lightning's launcher, gloo, CPU, one thread
per rank) with stock ``DDPStrategy()`` and with ``SafeDDPStrategy()``, alternating, each of the three methods every
training step goes through (``on_train_batch_start``, ``post_backward``, ``optimizer_step``) is replaced on the
strategy instance by a timer around the class's method, and ``optimizer_step``'s closure (forward and backward) is
timed apart. Per fit and method: the median wall time per call over the steps after a warm-up (``optimizer_step``
less its closure). A timer's own cost is in both variants' figures alike; safe less stock is the strategy's.

Writes ``step_hooks.{json,md}`` (or ``--name``) into ``--results-dir`` (default ``bench/results``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WARMUP = 50
VARIANTS = ("stock", "safe")
HOOKS = ("on_train_batch_start", "post_backward", "optimizer_step")
#: ``optimizer_step`` less the closure it runs (the forward and backward), per call
OWN_STEP = "optimizer_step less its closure"
PARTS = ("on_train_batch_start", "post_backward", OWN_STEP)


def timed(method: Callable[..., Any], record: list[int]) -> Callable[..., Any]:
    """``method`` with each call's wall time (ns) appended to ``record``."""
    clock = time.perf_counter_ns

    def timer(*args: Any, **kwargs: Any) -> Any:
        start = clock()
        try:
            return method(*args, **kwargs)
        finally:
            record.append(clock() - start)

    return timer


def worker(variant: str, steps: int, out: str) -> None:
    """One fit (Lightning's launcher starts rank 1 by re-running this command); rank 0 writes its timings to ``out``."""
    from lightning.pytorch.callbacks import Callback

    from bench.workloads.tiny import fit_with_window

    times: dict[str, list[int]] = {name: [] for name in (*HOOKS, "closure")}

    class Timers(Callback):
        def on_train_start(self, trainer: Any, module: Any) -> None:
            strategy = trainer.strategy
            for name in ("on_train_batch_start", "post_backward"):
                setattr(strategy, name, timed(getattr(type(strategy), name).__get__(strategy), times[name]))
            step = getattr(type(strategy), "optimizer_step").__get__(strategy)  # noqa: B009

            def optimizer_step(optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
                return step(optimizer, timed(closure, times["closure"]), model, **kwargs)

            strategy.optimizer_step = timed(optimizer_step, times["optimizer_step"])

    def start() -> None:
        for record in times.values():
            record.clear()

    def stop(trainer: Any) -> None:
        if trainer.global_rank == 0:
            Path(out).write_text(json.dumps(times))

    fit_with_window(
        variant, "nolog", warmup=WARMUP, steps=steps, start=start, stop=stop, root=str(Path(out).parent),
        callbacks=[Timers()],
    )  # fmt: skip


def run_fit(variant: str, steps: int, scratch: Path) -> dict[str, list[int]]:
    out = scratch / f"{variant}.json"
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", variant, "--steps", str(steps)]
    command += ["--out", str(out)]
    run = subprocess.run(command, timeout=600, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if not out.exists():  # stock may abort at interpreter exit after writing (see bench/call_count.py)
        raise subprocess.CalledProcessError(run.returncode, command)
    return dict(json.loads(out.read_text()))


def per_call(times: dict[str, list[int]]) -> dict[str, float]:
    """Median microseconds per call of each part; ``optimizer_step`` less its closure is taken call by call."""
    own_step = [total - inner for total, inner in zip(times["optimizer_step"], times["closure"], strict=True)]
    medians = {name: statistics.median(times[name]) / 1e3 for name in ("on_train_batch_start", "post_backward")}
    medians[OWN_STEP] = statistics.median(own_step) / 1e3
    return medians


def analyse(rounds: list[dict[str, dict[str, list[int]]]]) -> dict[str, Any]:
    """Per part: each variant's median per call over rounds, and safe less stock (paired by round): median, range."""
    figures = [{variant: per_call(fit) for variant, fit in fits.items()} for fits in rounds]
    parts: dict[str, Any] = {}
    for part in (*PARTS, "all three"):
        value = (lambda f, v: sum(f[v].values())) if part == "all three" else (lambda f, v, p=part: f[v][p])
        added = [value(f, "safe") - value(f, "stock") for f in figures]
        parts[part] = {
            "stock_us": statistics.median(value(f, "stock") for f in figures),
            "safe_us": statistics.median(value(f, "safe") for f in figures),
            "added_us": statistics.median(added),
            "added_range_us": [min(added), max(added)],
        }
    return {"rounds": figures, "parts": parts}


def render(result: dict[str, Any]) -> list[str]:
    machine = result["machine"]
    lines = [
        f"Measured {result['date']} on {machine['platform']}, torch {machine['torch']}, Lightning "
        f"{machine['lightning']}: `bench/tiny_step.py`'s model, a 2-rank fit per variant and round (Lightning's "
        f"launcher, gloo, CPU), {len(result['analysis']['rounds'])} round(s) alternating stock and safe, rank 0's "
        f"training thread, {result['steps']} training steps after {result['warmup']} warm-up steps; median wall time "
        "per call of each strategy method a step goes through, a timer around each (its cost in both columns).",
        "",
        "| per call (us) | stock `DDPStrategy()` | `SafeDDPStrategy()` | safe less stock: median [range] over rounds |",
        "|---|---|---|---|",
    ]
    for part, row in result["analysis"]["parts"].items():
        low, high = row["added_range_us"]
        added = f"{row['added_us']:+.2f} [{low:+.2f}, {high:+.2f}]"
        lines.append(f"| {part} | {row['stock_us']:.2f} | {row['safe_us']:.2f} | {added} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--results-dir", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--name", default="step_hooks", help="the results' file name, without suffix")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, steps=args.steps, out=args.out)
        return
    from bench.results_io import machine, write

    rounds = []
    with tempfile.TemporaryDirectory(prefix="step-hooks-") as scratch:
        for index in range(args.rounds):
            order = VARIANTS if index % 2 == 0 else tuple(reversed(VARIANTS))
            rounds.append({variant: run_fit(variant, args.steps, Path(scratch)) for variant in order})
    result = {"steps": args.steps, "warmup": WARMUP, "analysis": analyse(rounds), **machine()}
    write(args.results_dir, args.name, result, render(result))


if __name__ == "__main__":
    main()
