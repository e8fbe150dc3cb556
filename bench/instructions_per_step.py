"""Instructions per training step: stock ``DDPStrategy`` and ``SafeDDPStrategy()`` on the tiny model, counted.

Usage: python bench/instructions_per_step.py [--steps N] [--seeds N] [--variants V ...] [--modes M ...]
       [--cache-sim] [--results-dir DIR] [--name NAME]

Times on this shared machine move by more than the strategy's cost per step (``bench/tiny_step.py``); the number of
machine instructions a step executes does not, to within a few thousand per step. For each strategy and logging mode
(``nolog``; ``sync_dist``: ``self.log("loss", loss, sync_dist=True)`` in every step), a 2-rank fit of the tiny model
(Lightning's launcher, gloo, CPU) runs with rank 0 under valgrind's callgrind and rank 1 natively. Callgrind counts
only from the start of training step 40 to the start of step ``40 + --steps``: the window is switched on and off by
callgrind's client requests, from a three-line C shim this script builds with gcc and loads with ``ctypes``.

The counts still depend a little on hashes and addresses (CPython's method cache), so every fit runs under
``setarch -R`` (no address randomisation), once per ``PYTHONHASHSEED`` in ``0 .. --seeds - 1``, and the report gives
the median and the range over seeds: for the training thread (callgrind's thread 1) and for all of rank 0's other
threads together (gloo, autograd, the strategy's heartbeat and watch threads).

Callgrind counts instructions run in user space only: a thread's waits, wake-ups and system calls are not in the
counts. And it slows rank 0 down many times over (the window's wall time is in the results): the other threads,
which wake by the clock (the heartbeat's beats once a second), do many times more of their work per step than in a
native run. Their figures compare the two strategies under the same slowdown; ``bench/strategy_cost.py`` measures
them natively.

Where the instructions go: torch (2.13 and 2.14) runs its Flight Recorder by default, 2000 entries, so stock records
every collective with its Python stack too; ``SafeDDPStrategy()`` sets the size to ``TRACE_ENTRIES`` (16) unless
the user set one. ``--variants`` adds, beside ``stock`` and ``safe``, ``stock_recorder`` (stock with the recorder at the
strategy's size) and ``safe_no_recorder`` (``SafeDDPStrategy()`` with the recorder off by ``TORCH_FR_BUFFER_SIZE=0``,
and with it the strategy's desync monitor, which it builds only when the recorder records). With
``callgrind_annotate`` on the machine, each fit's training thread is also split: the instructions inside the
recorder's ``record`` call (its inclusive count: the entry and the Python stack it captures for every collective,
:data:`RECORDER_RECORD`) and the rest, and the report pairs each variant with ``stock`` on both.

``--cache-sim`` runs callgrind's cache simulation as well (``--cache-sim=yes``: a model of this machine's first-level
and last-level caches, fed with every access of the simulated run) and reports the training thread's simulated
misses per step, first level (instruction and data) and last level. A simulation, not the hardware's counters (this
VM has none): it tells how much more memory a strategy's step touches outside the caches, not what a miss costs.

Without valgrind, callgrind's header, gcc or setarch, it says which is missing and exits with status 0, writing
nothing. Writes ``<name>.json`` and ``<name>.md`` (default ``instructions_per_step``) into ``--results-dir``
(default ``bench/results``).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WARMUP = 40
VARIANTS = ("stock", "safe")
#: every variant ``--variants`` may name, and the environment each fit runs with (what it changes for torch)
ALL_VARIANTS = ("stock", "stock_recorder", "safe", "safe_no_recorder")
RECORDER_SIZE_ENV = "TORCH_FR_BUFFER_SIZE"
MODES = ("nolog", "sync_dist")
#: torch's Flight Recorder's entry point for one collective (torch 2.14: ``recordWithResetEnabled``), as callgrind
#: names it; its inclusive count is the recorder's work per collective, the stack it captures included
RECORDER_RECORD = re.compile(r"FlightRecorder<[^>]*>::record\w*\(")
#: a function line of ``callgrind_annotate --inclusive=yes``: its count, then its file and name
ANNOTATED = re.compile(r"^\s*([\d,]+) \([^)]*\)\s+(.*)$", re.MULTILINE)
HEADER = Path("/usr/include/valgrind/callgrind.h")
SHIM = """#include <valgrind/callgrind.h>
void window_start(void) { CALLGRIND_START_INSTRUMENTATION; }
void window_stop(void) { CALLGRIND_STOP_INSTRUMENTATION; }
"""
TOTALS = re.compile(r"^totals:\s+(\d+)", re.MULTILINE)
#: callgrind's event names (``events:`` line) and their totals (``totals:`` line) in one thread's file
EVENTS = re.compile(r"^events:\s+(.+)$", re.MULTILINE)
ALL_TOTALS = re.compile(r"^totals:\s+([\d ]+)$", re.MULTILINE)
#: the simulated misses per kind: first level (instructions, data read, data write) and last level
MISSES = {"l1_misses": ("I1mr", "D1mr", "D1mw"), "ll_misses": ("ILmr", "DLmr", "DLmw")}


def missing_tools() -> list[str]:
    """What this benchmark needs and the machine lacks (empty when it can run)."""
    missing = [tool for tool in ("valgrind", "gcc", "setarch") if shutil.which(tool) is None]
    if not HEADER.exists():
        missing.append(f"{HEADER} (valgrind's development header)")
    return missing


def build_shim(directory: Path) -> Path:
    """Compiles the window's start and stop (callgrind client requests; no-ops outside valgrind) into a library."""
    source, library = directory / "window.c", directory / "libwindow.so"
    source.write_text(SHIM)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(library), str(source)], check=True, timeout=120)
    return library


def variant_environment(variant: str) -> dict[str, str]:
    """The environment variables a fit of ``variant`` runs with, over the caller's (the recorder's size)."""
    if variant == "stock_recorder":
        from ddp_strategy.collective_record import TRACE_ENTRIES

        return {RECORDER_SIZE_ENV: str(TRACE_ENTRIES)}
    if variant == "safe_no_recorder":
        return {RECORDER_SIZE_ENV: "0"}
    if variant in ("stock", "safe"):
        return {}
    raise ValueError(f"unknown variant {variant!r}; choose from {', '.join(ALL_VARIANTS)}")


def recorder_instructions(thread_file: Path) -> int | None:
    """Instructions inside the Flight Recorder's ``record`` calls of one thread's callgrind file, inclusive.

    ``None`` without ``callgrind_annotate``. Nested matches (a ``record`` that calls another) count once: the
    largest inclusive count is the outermost call's.
    """
    if shutil.which("callgrind_annotate") is None:
        return None
    annotated = subprocess.run(
        ["callgrind_annotate", "--inclusive=yes", "--threshold=100", "--show=Ir", str(thread_file)],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    ).stdout
    return max(
        (int(count.replace(",", "")) for count, name in ANNOTATED.findall(annotated) if RECORDER_RECORD.search(name)),
        default=0,
    )


def worker(variant: str, mode: str, steps: int, library: str, root: str) -> None:
    """One fit; every rank opens and closes the window, and only the rank under callgrind counts."""
    from bench.workloads.tiny import fit_with_window

    shim = ctypes.CDLL(library)
    opened = [0.0]

    def start() -> None:
        gc.collect()
        gc.freeze()  # the warm-up's objects are never scanned in the window: fewer collections to differ by
        opened[0] = time.monotonic()
        shim.window_start()

    def stop(trainer: Any) -> None:
        shim.window_stop()
        if trainer.global_rank == 0:
            Path(root).mkdir(parents=True, exist_ok=True)
            (Path(root) / "window_s").write_text(str(time.monotonic() - opened[0]))

    fit_with_window(variant, mode, warmup=WARMUP, steps=steps, start=start, stop=stop, root=root, shuffle=False)


def thread_totals(prefix: Path) -> dict[int, int]:
    """Instructions per thread from callgrind's files ``<prefix>.<pid>-<thread>`` (one process: rank 0)."""
    totals = {}
    for path in sorted(prefix.parent.glob(f"{prefix.name}.*-*")):
        found = TOTALS.search(path.read_text(errors="replace"))
        if found is None:
            raise RuntimeError(f"{path} has no 'totals:' line: callgrind did not finish it")
        totals[int(path.name.rsplit("-", 1)[1])] = int(found.group(1))
    if 1 not in totals:
        raise RuntimeError(f"no callgrind file for thread 1 under {prefix}.*: the fit did not run under callgrind")
    return totals


def thread_misses(thread_file: Path) -> dict[str, int]:
    """The simulated cache misses of one thread's callgrind file, by :data:`MISSES` kind (empty without the sim)."""
    text = thread_file.read_text(errors="replace")
    events, totals = EVENTS.search(text), ALL_TOTALS.search(text)
    if events is None or totals is None:
        return {}
    counts = dict(zip(events.group(1).split(), map(int, totals.group(1).split()), strict=False))
    if not all(name in counts for names in MISSES.values() for name in names):
        return {}
    return {kind: sum(counts[name] for name in names) for kind, names in MISSES.items()}


def run_fit(
    variant: str, mode: str, steps: int, seed: int, library: Path, scratch: Path, *, cache_sim: bool = False
) -> dict[str, Any]:
    """One fit with rank 0 under callgrind; its instructions per step, training thread and other threads."""
    prefix = scratch / f"{variant}-{mode}-{seed}"
    base = "safe" if variant.startswith("safe") else "stock"
    callgrind = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--separate-threads=yes"]
    callgrind += ["--cache-sim=yes"] if cache_sim else []
    callgrind += [f"--callgrind-out-file={prefix}.%p"]
    worker_command = [sys.executable, str(Path(__file__).resolve()), "--worker", base, mode]
    worker_command += ["--steps", str(steps), "--library", str(library), "--root", str(scratch / "root")]
    command = ["setarch", platform.machine(), "-R", *callgrind, *worker_command]
    env = {**os.environ, "PYTHONHASHSEED": str(seed), **variant_environment(variant)}
    if variant in ("stock", "safe"):
        env.pop(RECORDER_SIZE_ENV, None)  # the recorder as each strategy sets it, whatever the caller's environment
    log = prefix.with_suffix(".log")
    with log.open("wb") as out:
        finished = subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=1800)
    if finished.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{variant} {mode} seed {seed} exited with {finished.returncode}:\n{tail}")
    totals = thread_totals(prefix)
    training = totals.pop(1)
    window_s = float((scratch / "root" / "window_s").read_text())
    fit = {"training": training / steps, "other_threads": sum(totals.values()) / steps, "window_s": window_s}
    training_file = next(prefix.parent.glob(f"{prefix.name}.*-01"))
    fit.update({kind: count / steps for kind, count in thread_misses(training_file).items()})
    recorder = recorder_instructions(training_file)
    if recorder is not None:
        fit["recorder"] = recorder / steps
        fit["training_less_recorder"] = (training - recorder) / steps
    return fit


def spread(values: list[float]) -> dict[str, float]:
    """Median, minimum and maximum."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


#: the thread kinds of a fit, in the report's order, with their labels (the recorder's split only with its counts)
KINDS = {
    "training": "training thread",
    "recorder": "of it, the recorder's `record`",
    "training_less_recorder": "of it, the rest",
    "other_threads": "other threads",
    "l1_misses": "training thread's first-level cache misses (simulated)",
    "ll_misses": "training thread's last-level cache misses (simulated)",
}
LABELS = {
    "stock": "stock `DDPStrategy()`",
    "stock_recorder": "stock, strategy's ring",
    "safe": "`SafeDDPStrategy()`",
    "safe_no_recorder": "safe, recorder off",
}


def analyse(fits: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """Per mode and thread kind: each variant's instructions per step over seeds, and what each adds to stock's.

    ``fits`` maps ``"<variant>-<mode>"`` to that variant's fits (one per seed); ``stock`` must be among the variants.
    A kind counted in only some fits (the recorder's split, without ``callgrind_annotate``) is left out.

    Returns:
        Per mode, per kind: each variant's median and range; ``added`` and ``ratio`` (safe against stock, when safe
        ran) and ``vs_stock``: each other variant's median less stock's.

    """
    modes: dict[str, list[str]] = {}
    for key in fits:
        variant, mode = key.rsplit("-", 1)
        modes.setdefault(mode, []).append(variant)
    result: dict[str, Any] = {}
    for mode, found in modes.items():
        variants = [v for v in ALL_VARIANTS if v in found]
        if "stock" not in variants:
            raise ValueError(f"mode {mode!r} has no stock fits to compare with (variants: {', '.join(variants)})")
        row: dict[str, Any] = {}
        for kind in KINDS:
            if not all(kind in fit for v in variants for fit in fits[f"{v}-{mode}"]):
                continue
            per_variant = {v: spread([fit[kind] for fit in fits[f"{v}-{mode}"]]) for v in variants}
            stock = per_variant["stock"]["median"]
            row[kind] = {**per_variant, "vs_stock": {v: per_variant[v]["median"] - stock for v in variants[1:]}}
            if "safe" in per_variant:
                safe = per_variant["safe"]["median"]
                row[kind].update(added=safe - stock, ratio=safe / stock if stock else float("nan"))
        result[mode] = row
    return result


def _thousands(value: float) -> str:
    return f"{value / 1000:,.1f}k"


def render(result: dict[str, Any]) -> list[str]:
    """The report: one table of instructions per step, medians with their range over seeds, each paired with stock."""
    windows = [fit["window_s"] for fits in result["fits"].values() for fit in fits]
    variants = [v for v in ALL_VARIANTS if any(key.startswith(f"{v}-") for key in result["fits"])]
    others = variants[1:]
    lines = [
        f"Measured {result['date']} on {result['machine']['platform']}, torch {result['machine']['torch']}, "
        f"Lightning {result['machine']['lightning']}: a 2-rank fit per strategy, mode and seed (Lightning's launcher, "
        f"gloo, CPU) of the tiny model, rank 0 under callgrind for {result['steps']} training steps after "
        f"{result['warmup']} warm-up steps, under `setarch -R`, once per `PYTHONHASHSEED` in "
        f"{', '.join(map(str, result['seeds']))}. Instructions per training step: median over seeds [min - max]; "
        "'added' is a variant's median less stock's. Callgrind counts user space only (no waits, wake-ups or system "
        f"calls), and slowed rank 0 down: a window lasted {min(windows):.0f} to {max(windows):.0f} s, so the other "
        "threads, which wake by the clock, did many times more of their work per step than natively.",
    ]
    ring = result.get("trace_entries", 32)  # the strategy's ring (32 until 2026-11-29, when runs did not record it)
    if "stock_recorder" in variants or "safe_no_recorder" in variants:
        lines[0] += (
            f" Stock runs torch's Flight Recorder at torch's default size, 2000 entries, and `SafeDDPStrategy()` at "
            f"{ring}. Variants: stock with the recorder at {ring} entries (`stock, strategy's ring`), "
            "`SafeDDPStrategy()` with it off by `TORCH_FR_BUFFER_SIZE=0`, its desync monitor with it (`safe, "
            "recorder off`)."
        )
    if any("recorder" in row for row in result["modes"].values()):
        lines[0] += (
            " The training thread is split into the recorder's `record` calls (inclusive: the entry and the Python "
            "stack it captures per collective) and the rest."
        )
    if any(kind in row for row in result["modes"].values() for kind in MISSES):
        lines[0] += (
            " Callgrind's cache simulation ran too (`--cache-sim=yes`): the rows of cache misses count the training "
            "thread's simulated misses per step (first level: instruction and data; last level), not instructions."
        )
    header = ["mode", "threads", *(LABELS[v] for v in variants)]
    for v in others:
        header += [f"added by {LABELS[v]}", f"{v}/stock"]
    lines += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for mode, row in result["modes"].items():
        for kind, label in KINDS.items():
            if kind not in row:
                continue
            cells = [
                f"{_thousands(row[kind][v]['median'])} [{_thousands(row[kind][v]['min'])} - "
                f"{_thousands(row[kind][v]['max'])}]"
                for v in variants
            ]
            stock = row[kind]["stock"]["median"]
            for v in others:
                ratio = f"{row[kind][v]['median'] / stock:.4f}" if stock else "-"
                cells += [f"{row[kind]['vs_stock'][v] / 1000:+,.1f}k", ratio]
            lines.append(f"| {mode} | {label} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seeds", type=int, default=3, help="PYTHONHASHSEED values 0 .. N-1, one fit each")
    parser.add_argument(
        "--variants", nargs="+", default=list(VARIANTS), choices=ALL_VARIANTS, help="stock is always run"
    )
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument(
        "--cache-sim", action="store_true", help="callgrind's cache simulation too: the training thread's misses"
    )
    parser.add_argument("--results-dir", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--name", default="instructions_per_step", help="results file name, no suffix")
    parser.add_argument("--worker", nargs=2, metavar=("VARIANT", "MODE"), help=argparse.SUPPRESS)
    parser.add_argument("--library", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker, steps=args.steps, library=args.library, root=args.root)
        return
    missing = missing_tools()
    if missing:
        print(f"skipped: this benchmark needs {', '.join(missing)}; install valgrind and gcc to run it")
        return
    from bench.results_io import machine, write

    fits: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="instructions-") as scratch:
        library = build_shim(Path(scratch))
        variants = [v for v in ALL_VARIANTS if v == "stock" or v in args.variants]
        for seed in range(args.seeds):
            for mode in [m for m in MODES if m in args.modes]:
                for variant in variants:
                    fit = run_fit(variant, mode, args.steps, seed, library, Path(scratch), cache_sim=args.cache_sim)
                    fits.setdefault(f"{variant}-{mode}", []).append(fit)
                    print(f"seed {seed} {variant} {mode}: {fit['training']:,.0f} per step", flush=True)
    seeds = list(range(args.seeds))
    from ddp_strategy.collective_record import TRACE_ENTRIES

    result = {"steps": args.steps, "warmup": WARMUP, "seeds": seeds, "fits": fits, "modes": analyse(fits)}
    result.update(trace_entries=TRACE_ENTRIES, **machine())
    write(args.results_dir, args.name, result, render(result))


if __name__ == "__main__":
    main()
