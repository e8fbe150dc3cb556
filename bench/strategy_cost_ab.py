"""``bench/strategy_cost.py`` at two commits, alternating in one run: what a change did to the strategy's own CPU.

Usage: python bench/strategy_cost_ab.py --base REV [--rounds N] [--steps N] [--workloads mlp tiny]
                                        [--results-dir DIR] [--name NAME]

The strategy's own CPU per step moves by tens of percent between runs on this shared VM (the CPU it charges for
waking a thread doubles from one hour to the next), so two commits measured an hour apart cannot be compared. This
script checks ``--base`` out into a worktree (``build/ab/<commit>``) and runs ``strategy_cost.py`` of the base and of
this checkout alternately, ``--rounds`` times each, every run in fresh processes with its own ``src`` first on the
path; it pairs the two runs of each round and reports per workload the paired ratios (this checkout / base) of the
own CPU per step in all, of the training thread's part and of the strategy's Python threads' part: their median and
range. The two runs of a round go base first in odd rounds (the first, third...) and checkout first in even ones
(since 2026-11-30; each run records which went first). Each run's figures are kept in the result, the threads by
name (the base's thread names show that its code ran).

Writes ``strategy_cost_ab.json`` and ``.md`` (``--name``: another name) into ``--results-dir`` (default
``bench/results``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.results_io import machine, write  # noqa: E402

PARTS = ("own", "training thread", "Python threads")


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


def checkout(rev: str) -> tuple[str, Path]:
    """``rev``'s commit and a worktree of it under ``build/ab`` (made once, reused)."""
    commit = _git("rev-parse", "--verify", f"{rev}^{{commit}}")
    tree = ROOT / "build" / "ab" / commit[:12]
    if not (tree / "bench" / "strategy_cost.py").exists():
        _git("worktree", "add", "--detach", "--force", str(tree), commit)
    return commit, tree


def run_once(tree: Path, args: argparse.Namespace, out: Path, name: str) -> dict[str, Any]:
    """One ``strategy_cost.py`` run of ``tree``'s code; its result."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tree / "src"), os.environ.get("PYTHONPATH")])))
    command = [sys.executable, str(tree / "bench" / "strategy_cost.py"), "--steps", str(args.steps)]
    command += ["--workloads", *args.workloads, "--results-dir", str(out), "--name", name]
    subprocess.run(command, env=env, check=True, timeout=args.timeout, stdout=subprocess.DEVNULL)
    return dict(json.loads((out / f"{name}.json").read_text()))


def figures(workload: dict[str, Any]) -> dict[str, Any]:
    """One workload of one run: own CPU per step in all, its training-thread and Python-thread parts (us)."""
    threads = {k: v * 1e6 for k, v in workload["threads_cpu_per_step_s"].items() if k.startswith("ddp_strategy-")}
    return {
        "own": workload["own_cpu_per_step_s"] * 1e6,
        "training thread": sum(workload["own_per_method_s"].values()) * 1e6,
        "Python threads": sum(threads.values()),
        "threads": threads,
        "step_cpu_ms": workload["step_cpu_median_s"] * 1e3,
        "idle_thread": workload["idle_thread_per_step_s"] * 1e6,
    }


def analyse(runs: list[dict[str, Any]], workloads: list[str]) -> dict[str, Any]:
    """Per workload and part: the paired ratios (this checkout / base) of the rounds, their median and range."""
    result: dict[str, Any] = {}
    for workload in workloads:
        parts = {}
        for part in PARTS:
            ratios = [r["head"][workload][part] / r["base"][workload][part] for r in runs if r["base"][workload][part]]
            parts[part] = {"ratios": ratios, "median": statistics.median(ratios), "range": [min(ratios), max(ratios)]}
        result[workload] = parts
    return result


def render(result: dict[str, Any]) -> list[str]:
    meta = result["machine"]
    lines = [
        f"Measured {result['date']} on {meta['platform']}, torch {meta['torch']}, Lightning {meta.get('lightning')}: "
        f"`bench/strategy_cost.py --steps {result['steps']}` of base {result['base'][:12]} and of this checkout "
        f"{result['head'][:12]}{' (with uncommitted changes)' if result['dirty'] else ''}, alternating, "
        f"{len(result['runs'])} round(s), each in fresh processes; rank 0's figures (us per training step).",
        "",
        "| workload | part | base, per round | this checkout, per round | paired ratio: median [range] |",
        "|---|---|---|---|---|",
    ]
    for workload, parts in result["analysis"].items():
        for part, stats in parts.items():
            base = ", ".join(f"{r['base'][workload][part]:.1f}" for r in result["runs"])
            head = ", ".join(f"{r['head'][workload][part]:.1f}" for r in result["runs"])
            low, high = stats["range"]
            lines.append(f"| {workload} | {part} | {base} | {head} | {stats['median']:.3f} [{low:.3f}, {high:.3f}] |")
    lines += ["", "Threads per run (us per step; a waiting thread's CPU for reference):", ""]
    for i, run in enumerate(result["runs"], 1):
        for side in ("base", "head"):
            for workload, f in run[side].items():
                threads = ", ".join(f"`{k}` {v:.1f}" for k, v in f["threads"].items())
                lines.append(f"- round {i} {side} {workload}: {threads}; waiting thread {f['idle_thread']:.1f}")
    return lines


def sides(round_index: int) -> tuple[str, str]:
    """The order of the two runs of round ``round_index`` (from 0): the base first in even rounds, last in odd ones.

    Alternating removes a bias from a drift of the machine within a round (every round base first made any such
    drift count against the checkout).
    """
    return ("base", "head") if round_index % 2 == 0 else ("head", "base")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the commit to compare with (any git revision)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--workloads", nargs="+", default=["mlp", "tiny"], choices=["mlp", "cifar", "tiny"])
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds one run may take")
    parser.add_argument("--results-dir", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--name", default="strategy_cost_ab")
    args = parser.parse_args()
    # the checkout's commit and state as the runs start (a commit made while they run would otherwise name them)
    head = _git("rev-parse", "HEAD")
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no", "--", "src", "bench"))
    base, tree = checkout(args.base)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            pair: dict[str, Any] = {"first": sides(i)[0]}
            for side in sides(i):
                code = tree if side == "base" else ROOT
                result = run_once(code, args, Path(tmp), f"{side}-{i}")
                pair[side] = {w["workload"]: figures(w) for w in result["workloads"]}
                print(f"round {i + 1} {side}: " + ", ".join(f"{k} own {v['own']:.1f}" for k, v in pair[side].items()))
            runs.append(pair)
    result = {
        "base": base,
        "head": head,
        "dirty": dirty,
        "steps": args.steps,
        "runs": runs,
        "analysis": analyse(runs, args.workloads),
        **machine(),
    }
    write(str(args.results_dir), args.name, result, render(result))


if __name__ == "__main__":
    main()
