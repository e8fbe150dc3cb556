"""What torch's Flight Recorder costs the thread that makes a collective (issue 30: the cost per step).

    python bench/flight_recorder_cost.py              # 6 rounds: bench/results/flight_recorder_cost.{json,md}
    python bench/flight_recorder_cost.py --rounds 10

torch runs the recorder by default (2000 entries, stock Lightning included); ``SafeDDPStrategy`` sets its size
(``TORCH_FR_BUFFER_SIZE``, ``collective_record.TRACE_ENTRIES`` entries) when it creates the default process group: its
desync audit reads the recorded calls. "off" here is ``TORCH_FR_BUFFER_SIZE=0``. The recorder then
records every collective of the process, with the Python stack of the call, on the thread that makes it: DDP's
gradient all-reduce (one per bucket and step), every ``sync_dist`` value, the user's own collectives.

Each *round* starts two fresh processes one after the other, in alternating order, the recorder off and on; each makes
a 1-rank gloo group (a file rendezvous), all-reduces one value ``--warmup`` times, then ``--calls`` times from
``--depth`` Python frames deep (a training step's stack under Lightning is about as deep), and reports the calling
thread's CPU time per call (``time.thread_time``). Per setting: the median over rounds; the recorder's cost per
collective is the paired difference, on - off, per round (median [min, max]). A 1-rank group keeps the network out
of it: what is left is torch's work on the calling thread, which the recorder adds to. The exit code is 0 whatever
the result (a measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

from suite import metadata  # noqa: E402  (bench/suite.py: the machine and versions)

SETTINGS = ("off", "on")


def worker(args: argparse.Namespace) -> None:
    """One process: the all-reduces, then one JSON line with the calling thread's CPU seconds per call."""
    import torch
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1)
        value = torch.ones(1)
        for _ in range(args.warmup):
            dist.all_reduce(value)

        def deep(frames: int) -> float:
            if frames > 0:
                return deep(frames - 1)
            start = time.thread_time()
            for _ in range(args.calls):
                dist.all_reduce(value)
            return (time.thread_time() - start) / args.calls

        per_call = deep(args.depth)
        dist.destroy_process_group()
    print(json.dumps({"cpu_per_call_s": per_call}), flush=True)


def run_one(setting: str, args: argparse.Namespace, entries: int) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")}
    env["TORCH_FR_BUFFER_SIZE"] = str(entries if setting == "on" else 0)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker"]
    cmd += ["--calls", str(args.calls), "--warmup", str(args.warmup), "--depth", str(args.depth)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=True).stdout
    return float(json.loads(out.strip().splitlines()[-1])["cpu_per_call_s"])


def spread(values: list[float]) -> dict[str, float]:
    return {"median": float(statistics.median(values)), "min": min(values), "max": max(values)}


def analyse(rounds: list[dict[str, float]]) -> dict[str, Any]:
    """Per setting the median [min, max] over rounds; the recorder's cost per call, on - off paired per round."""
    return {
        "per_setting_s": {s: spread([r[s] for r in rounds]) for s in SETTINGS},
        "added_per_call_s": spread([r["on"] - r["off"] for r in rounds]),
    }


def markdown(result: dict[str, Any]) -> str:
    meta, config, analysis = result["meta"], result["config"], result["analysis"]
    us = lambda s: f"{s['median'] * 1e6:.1f} [{s['min'] * 1e6:.1f}, {s['max'] * 1e6:.1f}]"  # noqa: E731
    return "\n".join(
        [
            f"Measured {meta['date']} on {meta['machine']}; Python {meta['python']}, torch {meta['torch']} "
            f"({meta['git']}).",
            "",
            f"{config['rounds']} rounds, each a fresh process per setting (alternating order): a 1-rank gloo group, "
            f"{config['warmup']} all-reduces of one value to warm up, then {config['calls']} from {config['depth']} "
            f"Python frames deep; the calling thread's CPU time per all-reduce. Recorder on: "
            f"`TORCH_FR_BUFFER_SIZE={config['entries']}` (the strategy's `TRACE_ENTRIES`).",
            "",
            "| recorder | CPU per all-reduce (us), median [min, max] over rounds |",
            "|---|---|",
            *(f"| {s} | {us(analysis['per_setting_s'][s])} |" for s in SETTINGS),
            "",
            f"The recorder's cost per collective on the calling thread, on - off paired per round: "
            f"**{us(analysis['added_per_call_s'])} us**.",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--warmup", type=int, default=2000)
    parser.add_argument("--depth", type=int, default=60, help="Python frames above the calls (default 60)")
    parser.add_argument("--out", type=Path, default=RESULTS / "flight_recorder_cost")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    from ddp_strategy.collective_record import TRACE_ENTRIES

    started = time.monotonic()
    rounds = []
    for r in range(args.rounds):
        order = SETTINGS if r % 2 == 0 else tuple(reversed(SETTINGS))
        rounds.append({s: run_one(s, args, TRACE_ENTRIES) for s in order})
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{s} {v * 1e6:.1f} us" for s, v in rounds[-1].items()))
    config = {k: getattr(args, k) for k in ("rounds", "calls", "warmup", "depth")} | {"entries": TRACE_ENTRIES}
    result = {"meta": metadata(), "config": config, "rounds": rounds, "analysis": analyse(rounds)}
    result["meta"]["wall_seconds"] = time.monotonic() - started
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    text = markdown(result)
    args.out.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
