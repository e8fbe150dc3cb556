"""Python calls per training step: stock ``DDPStrategy`` and ``SafeDDPStrategy()`` on the tiny model, counted.

Usage: python bench/call_count.py [--steps N] [--count calls|opcodes] [--results-dir DIR]

Times on this shared machine move by more than the strategy's cost per step (``bench/tiny_step.py``); the number of
Python calls a step makes does not. For each strategy and logging mode (``nolog``; ``sync_dist``:
``self.log("loss", loss, sync_dist=True)`` in every step), a 2-rank fit of ``bench/tiny_step.py``'s model (Lightning's
launcher, gloo, CPU) runs under ``cProfile`` on rank 0 for ``--steps`` training steps after a warm-up, from one
``on_train_batch_start`` to another: every Python function and built-in call of the training thread is counted. The
report gives the calls per step of each fit and, per function, what ``SafeDDPStrategy()`` adds (or saves) per step.

``--count opcodes`` counts the Python bytecode instructions each function runs instead (``sys.settrace`` with opcode
events, on the training thread only): where a call count cannot see it, in the loop of a Lightning function that
turns over the strategy's callbacks, say. Built-ins run no bytecode and are not in these counts.

Writes ``call_count.json`` and ``call_count.md`` (``call_count-opcodes.*`` with ``--count opcodes``) into
``--results-dir`` (default ``bench/results``).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import re
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WARMUP = 50
VARIANTS = ("stock", "safe")
MODES = ("nolog", "sync_dist")
TOP = 40  # functions listed per mode in the report
#: what ``--count`` counts: its words in the report
COUNTS = {"calls": "calls", "opcodes": "bytecode instructions"}


def _function_name(key: tuple[str, int, str]) -> str:
    path, line, name = key
    if path == "~":  # a built-in, or a Python function cProfile names by its repr: without its address
        return re.sub(r" at 0x[0-9a-f]+", "", name)
    return f"{Path(path).name}:{line}({name})"


def _code_name(code: Any) -> str:
    return f"{Path(code.co_filename).name}:{code.co_firstlineno}({code.co_name})"


class OpcodeCounter:
    """Counts the bytecode instructions each Python function runs on the thread that starts it (``sys.settrace``)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def _global(self, frame: FrameType, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        name, counts = _code_name(frame.f_code), self.counts

        def local(frame: FrameType, event: str, arg: Any) -> Any:
            if event == "opcode":
                counts[name] += 1
            return local

        return local

    def start(self) -> None:
        sys.settrace(self._global)

    def stop(self) -> None:
        sys.settrace(None)


def worker(variant: str, mode: str, steps: int, out: str, count: str = "calls") -> None:
    """One fit (Lightning's launcher starts rank 1 by re-running this command); rank 0 writes its counts to ``out``."""
    from bench.workloads.tiny import fit_with_window

    if count == "opcodes":
        counter = OpcodeCounter()
        start, finish = counter.start, counter.stop

        def counted() -> dict[str, int]:
            return dict(counter.counts)

    else:
        profile = cProfile.Profile()
        start, finish = profile.enable, profile.disable

        def counted() -> dict[str, int]:
            stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
            return {_function_name(key): row[1] for key, row in stats.items()}

    def stop(trainer: Any) -> None:
        finish()
        if trainer.global_rank == 0:
            Path(out).write_text(json.dumps({"steps": steps, "calls": counted()}))

    fit_with_window(variant, mode, warmup=WARMUP, steps=steps, start=start, stop=stop, root=str(Path(out).parent))


def fit_finished(variant: str, returncode: int, wrote: bool) -> bool:
    """Whether a fit's process ended as a finished fit: exit 0, or stock's abort at exit after writing its counts.

    Stock Lightning leaves a gloo process group to interpreter exit, where a rank sometimes aborts (SIGABRT,
    "terminate called without an active exception"; see ``tests/proc.py``'s ``stock_fit_finished``): its counts were
    written before that.
    """
    return returncode == 0 or (variant == "stock" and returncode == -signal.SIGABRT and wrote)


def run_fit(variant: str, mode: str, steps: int, scratch: Path, count: str = "calls") -> dict[str, Any]:
    out = scratch / f"{variant}-{mode}.json"
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", variant, mode, "--steps", str(steps)]
    command += ["--out", str(out), "--count", count]
    run = subprocess.run(command, timeout=600, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if not fit_finished(variant, run.returncode, out.exists()):
        raise subprocess.CalledProcessError(run.returncode, command)
    return dict(json.loads(out.read_text()))


def analyse(fits: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per mode: calls per step of each strategy, and per function safe's calls per step less stock's."""
    modes = {}
    for mode in MODES:
        stock, safe = (fits[f"{variant}-{mode}"] for variant in VARIANTS)
        per_step = {
            v: {k: n / f["steps"] for k, n in f["calls"].items()} for v, f in (("stock", stock), ("safe", safe))
        }
        names = set(per_step["stock"]) | set(per_step["safe"])
        added = {k: per_step["safe"].get(k, 0.0) - per_step["stock"].get(k, 0.0) for k in names}
        added = {k: v for k, v in added.items() if abs(v) >= 0.01}
        modes[mode] = {
            "calls_per_step": {v: sum(per_step[v].values()) for v in VARIANTS},
            "added_per_step": dict(sorted(added.items(), key=lambda kv: (-abs(kv[1]), kv[0]))),
        }
    return modes


def render(result: dict[str, Any]) -> list[str]:
    count = result.get("count", "calls")
    counted = (
        "under `cProfile`",
        "Counts are per training step (Python functions and built-ins).",
    )
    if count == "opcodes":
        counted = (
            "traced (`sys.settrace`, opcode events)",
            "Counts are Python bytecode instructions per training step, by the function that ran them (built-ins "
            "run none).",
        )
    what = COUNTS[count]
    lines = [
        f"Measured {result['date']} on {result['machine']['platform']}, torch {result['machine']['torch']}, "
        f"Lightning {result['machine']['lightning']}: a 2-rank fit per strategy and mode (Lightning's launcher, gloo, "
        f"CPU), `bench/tiny_step.py`'s model, rank 0's training thread {counted[0]} for {result['steps']} steps "
        f"after {WARMUP} warm-up steps. {counted[1]}",
        "",
        "| mode | stock `DDPStrategy()` | `SafeDDPStrategy()` | added by safe |",
        "|---|---|---|---|",
    ]
    for mode, row in result["modes"].items():
        stock, safe = row["calls_per_step"]["stock"], row["calls_per_step"]["safe"]
        lines.append(f"| {mode} | {stock:.0f} | {safe:.0f} | {safe - stock:+.0f} |")
    for mode, row in result["modes"].items():
        lines += [
            "",
            f"{what.capitalize()} per step added by safe, {mode} (largest {TOP}; negative: fewer than stock):",
            "",
        ]
        listed = list(row["added_per_step"].items())[:TOP]
        lines += [f"- `{name}` {count:+.2f}" for name, count in listed]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--count", choices=tuple(COUNTS), default="calls", help="what is counted per function")
    parser.add_argument("--results-dir", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--worker", nargs=2, metavar=("VARIANT", "MODE"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        variant, mode = args.worker
        worker(variant, mode, steps=args.steps, out=args.out, count=args.count)
        return
    from bench.results_io import machine, write

    with tempfile.TemporaryDirectory(prefix="call-count-") as scratch:
        fits = {f"{v}-{m}": run_fit(v, m, args.steps, Path(scratch), args.count) for m in MODES for v in VARIANTS}
    result = {"steps": args.steps, "warmup": WARMUP, "count": args.count, "modes": analyse(fits), **machine()}
    name = "call_count" if args.count == "calls" else f"call_count-{args.count}"
    write(args.results_dir, name, result, render(result))


if __name__ == "__main__":
    main()
