"""What one dump of torch's Flight Recorder costs by ring size, with and without stacks, caches cold (issue 30).

    python bench/recorder_dump_cost.py                   # bench/results/recorder_dump_cost.{json,md}
    python bench/recorder_dump_cost.py --entries 8 16 32 --dumps 200

The desync audit's training-thread dump (``collective_dump_pickled``) is one C++ call that keeps the GIL: its
longest decides whether a step that makes it pauses past 1 ms (point 2). Per ring size a fresh process (the recorder
reads its size when the first process group is created) imports Lightning (as a fit has), makes a 1-rank gloo group,
fills the ring with all-reduces made ``--depth`` Python frames deep (a training step's stack under Lightning is about
as deep), dumps once with stacks (the process's first such dump is reported apart), then ``--dumps`` times: writes
``--evict-mb`` of memory (caches cold, as after a training step's backward), dumps with stacks, evicts again, dumps
without; and unpickles the last dump with stacks. The calling thread's CPU per call (``time.thread_time``): median,
99th percentile and longest. The exit code is 0 whatever the result (a measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
if str(BENCH.parent) not in sys.path:
    sys.path.insert(0, str(BENCH.parent))


def _summary(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    return {
        "median_s": statistics.median(ordered),
        "p99_s": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        "max_s": ordered[-1],
    }


def worker(args: argparse.Namespace) -> None:
    """One process, one ring size: the dumps, then one JSON line of their CPU seconds."""
    import lightning.pytorch  # noqa: F401  (as in a fit: without it the first dump with stacks took about 1 s)
    import torch
    import torch.distributed as dist

    dump = torch._C._distributed_c10d._dump_fr_trace
    junk = bytearray(args.evict_mb << 20)

    def evict(mark: int) -> None:
        for at in range(0, len(junk), 64):
            junk[at] = mark & 255

    def timed(stacks: bool) -> tuple[float, bytes]:
        start = time.thread_time()
        pickled = dump(includeStackTraces=stacks)
        return time.thread_time() - start, pickled

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1)
        value = torch.ones(1)

        def deep(frames: int) -> None:
            if frames > 0:
                deep(frames - 1)
                return
            for _ in range(2 * args.worker_entries):
                dist.all_reduce(value)

        deep(args.depth)
        first = timed(True)[0]  # the process's first dump with stacks symbolises them for the first time (~1 s)
        with_stacks: list[float] = []
        without: list[float] = []
        pickled = b""
        for i in range(args.dumps):
            evict(i)
            took, pickled = timed(True)
            with_stacks.append(took)
            evict(i + 1)
            without.append(timed(False)[0])
        start = time.thread_time()
        entries = len(pickle.loads(pickled).get("entries", []))
        unpickle = time.thread_time() - start
        dist.destroy_process_group()
    row = {
        "entries": args.worker_entries,
        "entries_dumped": entries,
        "with_stacks": _summary(with_stacks),
        "without_stacks": _summary(without),
        "first_with_stacks_s": first,
        "unpickle_s": unpickle,
        "pickle_bytes": len(pickled),
    }
    print(json.dumps(row))


def render(result: dict[str, Any]) -> list[str]:
    lines = [
        f"Measured {result['date']} on {result['machine']['platform']}, torch {result['machine']['torch']}: a 1-rank "
        f"gloo group, all-reduces {result['depth']} frames deep, {result['dumps']} dumps per setting, "
        f"{result['evict_mb']} MB written before each (caches cold). CPU ms per dump (median / 99th percentile / "
        "longest):",
        "",
        "| ring size | entries dumped | with stacks | without stacks | unpickling (one, ms) | the first dump with "
        "stacks (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        cells = [
            " / ".join(f"{row[kind][stat] * 1e3:.3f}" for stat in ("median_s", "p99_s", "max_s"))
            for kind in ("with_stacks", "without_stacks")
        ]
        lines.append(
            f"| {row['entries']} | {row['entries_dumped']} | {cells[0]} | {cells[1]} | {row['unpickle_s'] * 1e3:.3f} | "
            f"{row['first_with_stacks_s'] * 1e3:.1f} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--dumps", type=int, default=200)
    parser.add_argument("--depth", type=int, default=60)
    parser.add_argument("--evict-mb", type=int, default=32)
    parser.add_argument("--results-dir", default=str(BENCH / "results"))
    parser.add_argument("--name", default="recorder_dump_cost")
    parser.add_argument("--worker-entries", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker_entries is not None:
        worker(args)
        return
    rows = []
    for entries in args.entries:
        env = {k: v for k, v in os.environ.items() if k != "TORCH_NCCL_TRACE_BUFFER_SIZE"}
        env["TORCH_FR_BUFFER_SIZE"] = str(entries)
        command = [sys.executable, __file__, "--worker-entries", str(entries), "--dumps", str(args.dumps)]
        command += ["--depth", str(args.depth), "--evict-mb", str(args.evict_mb)]
        run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=True)
        rows.append(json.loads(run.stdout.strip().splitlines()[-1]))
    from bench.results_io import machine, write

    result = {"dumps": args.dumps, "depth": args.depth, "evict_mb": args.evict_mb, "rows": rows, **machine()}
    write(args.results_dir, args.name, result, render(result))


if __name__ == "__main__":
    main()
