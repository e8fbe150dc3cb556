"""Tiny-model step: a raw DDP loop, stock ``DDPStrategy`` and ``SafeDDPStrategy()`` side by side (issue 30, point 3).

    python bench/tiny_step.py              # full run: JSON + Markdown in bench/results/tiny_step.{json,md}
    python bench/tiny_step.py --quick      # smoke run (2 rounds of shorter fits): bench/results/tiny_step-quick.*
    python bench/tiny_step.py --report bench/results/tiny_step.json    # only re-render the Markdown of a JSON

On a tiny model the step is almost all framework: that is how a fast GPU step looks to the CPU, and where a
strategy's per-step Python work shows. The model is a 2-layer MLP (32 -> 64 -> 10, cross-entropy, SGD) on small
random tensors, batch 32 per rank, 2 ranks on CPU over gloo. Variants:

* ``raw``: a plain PyTorch loop (``DistributedDataParallel``, ``DistributedSampler``, no Lightning);
* ``stock``: Lightning's ``DDPStrategy()``;
* ``safe``: ``SafeDDPStrategy()`` at its defaults;

each in two logging modes: ``nolog``, and ``sync_dist``: ``self.log("loss", loss, sync_dist=True)`` in every
training step (for ``raw``, what that does in Lightning's ``_sync_ddp``: a barrier and an all-reduce of the loss).

Every fit runs in its own pair of processes started by ``torchrun`` (``--standalone``, 2 ranks, one thread each), so
each strategy creates the default process group as it does for a user (``SafeDDPStrategy`` turns torch's Flight
Recorder on for it first; a shared process would give that to every later fit, or take it from ``safe``). A round
runs each of the 6 (variant, mode) fits once, in a new seeded order every round; ``--rounds`` rounds (default 10).
Nothing of the launch is timed: per rank, a callback (the raw loop: the loop itself) notes the time at the start of
every training step (after the batch is fetched); a step's time is the interval to the next step's start, so it
holds the data fetch, forward, backward with the gradient all-reduce, optimizer step and every hook. The first
``warmup`` steps are untimed; per fit the figures are over the next ``timed`` intervals: the mean (total / steps),
the median step, the training thread's CPU time per step (``time.thread_time``) and the whole process's
(``time.process_time``: also gloo's and the strategy's background threads).

Report: per (mode, variant) the median over rounds [min, max] of rank 0's figures (rank 1's mean too); per mode the
ratios safe/stock, stock/raw and safe/raw as the ratio of the medians and the per-round (paired) ratios' median
[min, max]; and the target safe/stock <= 1.02 per mode, judged on the wall-clock mean step and separately on CPU.
The exit code is 0 whatever the result (this is a measurement, not a gate).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

IMPORT_START = time.time()
BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESULTS = BENCH / "results"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

from suite import job_processes, metadata, tail  # noqa: E402  (bench/suite.py: same process handling)

VARIANTS = ("raw", "stock", "safe")
MODES = ("nolog", "sync_dist")
LABELS = {"raw": "raw PyTorch DDP loop", "stock": "Lightning DDPStrategy()", "safe": "SafeDDPStrategy()"}
MODE_LABELS = {"nolog": "no logging", "sync_dist": '`self.log("loss", loss, sync_dist=True)` every step'}
RATIOS = (("safe", "stock"), ("stock", "raw"), ("safe", "raw"))
TARGET = ("safe", "stock", 1.02)  # issue 30, point 3: safe / stock at most 1.02 in both modes
WORLD_SIZE = 2
SHAPE = (32, 64, 10)  # inputs, hidden units, classes


# ---------------------------------------------------------------------------------------------------- plan
def config_for(quick: bool, rounds: int | None) -> dict[str, Any]:
    if quick:
        return {"rounds": rounds or 2, "warmup": 20, "timed": 100, "batch_size": 32, "seed": 1234}
    return {"rounds": rounds or 10, "warmup": 30, "timed": 270, "batch_size": 32, "seed": 1234}


def plan(config: dict[str, Any]) -> list[dict[str, Any]]:
    """Every round runs every (variant, mode) fit once, in a new seeded order."""
    fits = []
    cells = [(v, m) for m in MODES for v in VARIANTS]
    for r in range(config["rounds"]):
        order = list(cells)
        random.Random(config["seed"] * 1000 + r).shuffle(order)
        fits += [{"round": r, "position": i, "variant": v, "mode": m} for i, (v, m) in enumerate(order)]
    return fits


# ---------------------------------------------------------------------------------------------------- one fit
def run_fit(fit: dict[str, Any], config: dict[str, Any], tmp: Path, index: int, timeout: float) -> dict[str, Any]:
    """One fit in a fresh ``torchrun`` job of 2 ranks; returns ``fit`` with both ranks' figures."""
    out, log = tmp / f"fit{index}", tmp / f"fit{index}.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD_SIZE}"]
    cmd += [str(Path(__file__).resolve()), "--worker", "--variant", fit["variant"], "--mode", fit["mode"]]
    cmd += ["--warmup", str(config["warmup"]), "--timed", str(config["timed"])]
    cmd += ["--batch-size", str(config["batch_size"]), "--seed", str(config["seed"]), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env["PYTHONWARNINGS"] = "ignore"
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
        env.pop(key, None)  # never inherit a rank from an outer launcher
    load = os.getloadavg()[0]
    start = time.monotonic()
    with open(log, "w") as log_file:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):  # torchrun stops its workers on SIGTERM
                os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=20)
            raise RuntimeError(f"fit {index} timed out after {timeout:.0f} s; log: {log}\n{tail(log)}") from None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            for pid in job_processes(out):  # torchrun's workers, by this fit's unique --out path
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    if proc.returncode != 0:
        raise RuntimeError(f"fit {index} failed with exit code {proc.returncode}; log: {log}\n{tail(log)}")
    ranks = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    return {**fit, "seconds": time.monotonic() - start, "loadavg_at_launch": load, "ranks": ranks}


def window_figures(marks: list[tuple[float, float, float]], warmup: int, timed: int) -> dict[str, Any]:
    """Per-step figures from the (wall, thread CPU, process CPU) marks taken at the start of every step.

    Step ``k``'s time is ``marks[k + 1] - marks[k]``; the window is steps ``warmup .. warmup + timed - 1``.
    """
    if len(marks) < warmup + timed + 1:
        raise RuntimeError(f"only {len(marks)} step starts noted, expected {warmup + timed + 1}")
    first, last = marks[warmup], marks[warmup + timed]
    walls = [marks[k + 1][0] - marks[k][0] for k in range(warmup, warmup + timed)]
    return {
        "step_mean_s": (last[0] - first[0]) / timed,
        "step_median_s": float(statistics.median(walls)),
        "step_max_s": max(walls),
        "cpu_step_s": (last[1] - first[1]) / timed,
        "process_cpu_step_s": (last[2] - first[2]) / timed,
        "window_s": last[0] - first[0],
        "steps_us": [round(w * 1e6, 1) for w in walls],
    }


def worker(args: argparse.Namespace) -> None:
    """One rank of one fit (under torchrun): train, and write this rank's figures to ``OUT.rank<R>.json``."""
    import threading

    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import DDPStrategy
    from torch import Tensor, nn
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from ddp_strategy import SafeDDPStrategy

    imported = time.time()
    variant, sync = args.variant, args.mode == "sync_dist"
    steps = args.warmup + args.timed + 1  # one more step start closes the last timed step
    marks: list[tuple[float, float, float]] = []
    threads_in_window: list[int] = []

    def mark() -> None:
        marks.append((time.perf_counter(), time.thread_time(), time.process_time()))
        if len(marks) == args.warmup + 1:
            threads_in_window.append(threading.active_count())

    def network() -> nn.Sequential:
        return nn.Sequential(nn.Linear(SHAPE[0], SHAPE[1]), nn.ReLU(), nn.Linear(SHAPE[1], SHAPE[2]))

    class TinyModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = network()

        def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            if sync:
                self.log("loss", loss, sync_dist=True)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    class StepMarks(Callback):
        def on_train_batch_start(self, *_: Any) -> None:
            mark()

    generator = torch.Generator().manual_seed(args.seed)
    samples = steps * args.batch_size * WORLD_SIZE  # one epoch holds every step: no epoch end in the window
    dataset = TensorDataset(
        torch.randn(samples, SHAPE[0], generator=generator), torch.randint(0, SHAPE[2], (samples,), generator=generator)
    )
    fit_start = time.perf_counter()
    handshake = None
    if variant == "raw":
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(args.seed)
        model = network()
        ddp = DistributedDataParallel(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
        loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
        model.train()
        for done, (x, y) in enumerate(loader, start=1):
            mark()
            loss = F.cross_entropy(ddp(x), y)
            if sync:  # Lightning's _sync_ddp for a step-level sync_dist log: barrier, all-reduce (sum), mean
                value = loss.detach().clone()
                dist.barrier()
                dist.all_reduce(value)
                value /= world
            optimizer.zero_grad(set_to_none=True)  # Lightning's order: forward, zero_grad, backward, step
            loss.backward()
            optimizer.step()
            if done >= steps:
                break
        threads_after = threading.active_count()
    else:
        pl.seed_everything(args.seed, verbose=False)
        strategy: DDPStrategy = DDPStrategy() if variant == "stock" else SafeDDPStrategy()
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=WORLD_SIZE,
            strategy=strategy,
            max_steps=steps,
            max_epochs=1,
            callbacks=[StepMarks()],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tempfile.mkdtemp(prefix="tiny-step-"),
        )
        trainer.fit(TinyModule(), DataLoader(dataset, batch_size=args.batch_size, shuffle=True))
        handshake = getattr(trainer.strategy, "last_handshake_seconds", None)
        threads_after = threading.active_count()
        rank = trainer.global_rank
    payload = {
        "rank": rank,
        "variant": variant,
        "mode": args.mode,
        "threads_per_rank": torch.get_num_threads(),
        "import_seconds": imported - IMPORT_START,
        "fit_to_first_step_s": marks[0][0] - fit_start if marks else None,
        "handshake_s": handshake,
        "threads_in_window": threads_in_window[0] if threads_in_window else None,
        "threads_after_fit": threads_after,
        **window_figures(marks, args.warmup, args.timed),
    }
    out = Path(f"{args.out}.rank{rank}.json")
    out.with_suffix(".tmp").write_text(json.dumps(payload))
    out.with_suffix(".tmp").replace(out)
    if dist.is_initialized():  # a gloo group left to the interpreter's exit may abort the process
        dist.barrier()
        dist.destroy_process_group()



# ---------------------------------------------------------------------------------------------------- analysis
FIGURES = ("step_mean_s", "step_median_s", "cpu_step_s", "process_cpu_step_s")


def spread(values: list[float]) -> dict[str, float]:
    return {"median": float(statistics.median(values)), "min": min(values), "max": max(values)}


def cells(fits: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """Per (mode, variant): one record per round with rank 0's figures (``rank1_step_mean_s``: rank 1's mean)."""
    out: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for fit in fits:
        rank0, rank1 = fit["ranks"][0], fit["ranks"][1]
        record = {"round": fit["round"], **{k: rank0[k] for k in FIGURES}, "rank1_step_mean_s": rank1["step_mean_s"]}
        out.setdefault((fit["mode"], fit["variant"]), []).append(record)
    return out


def summary(by_cell: dict[tuple[str, str], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    rows = []
    for mode in MODES:
        for variant in VARIANTS:
            records = by_cell.get((mode, variant))
            if not records:
                continue
            row: dict[str, Any] = {"mode": mode, "variant": variant, "rounds": len(records)}
            for key in (*FIGURES, "rank1_step_mean_s"):
                row[key] = spread([r[key] for r in records])
            rows.append(row)
    return rows


def ratio(num: list[dict[str, Any]], den: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """Ratio of the medians over rounds, and the per-round (paired) ratios' median [min, max]."""
    of_medians = statistics.median(r[key] for r in num) / statistics.median(r[key] for r in den)
    by_round = {r["round"]: r[key] for r in den}
    paired = [r[key] / by_round[r["round"]] for r in num if r["round"] in by_round]
    return {"of_medians": of_medians, "paired": spread(paired) if paired else None}


def ratios(by_cell: dict[tuple[str, str], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    out = []
    for mode in MODES:
        for a, b in RATIOS:
            num, den = by_cell.get((mode, a)), by_cell.get((mode, b))
            if not num or not den:
                continue
            row: dict[str, Any] = {"mode": mode, "ratio": f"{a} / {b}"}
            for key in (*FIGURES, "rank1_step_mean_s"):
                row[key] = ratio(num, den, key)
            out.append(row)
    return out


def targets(ratio_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``safe / stock <= 1.02`` per mode, on the wall-clock mean step (the target) and on thread CPU."""
    a, b, limit = TARGET
    out = []
    for row in ratio_rows:
        if row["ratio"] != f"{a} / {b}":
            continue
        wall, cpu = row["step_mean_s"], row["cpu_step_s"]
        out.append(
            {
                "mode": row["mode"],
                "target": f"{a} / {b} <= {limit:.2f}",
                "limit": limit,
                "wall": wall["of_medians"],
                "wall_paired_median": wall["paired"]["median"] if wall["paired"] else None,
                "median_step": row["step_median_s"]["of_medians"],
                "cpu": cpu["of_medians"],
                "process_cpu": row["process_cpu_step_s"]["of_medians"],
                "met": wall["of_medians"] <= limit,
                "met_by_cpu": cpu["of_medians"] <= limit,
            }
        )
    return out


def analyse(result: dict[str, Any]) -> dict[str, Any]:
    by_cell = cells(result["fits"])
    ratio_rows = ratios(by_cell)
    return {"rows": summary(by_cell), "ratios": ratio_rows, "targets": targets(ratio_rows)}


# ---------------------------------------------------------------------------------------------------- report
def us(value: float) -> str:
    return f"{value * 1e6:.0f}"


def us_spread(s: dict[str, float]) -> str:
    return f"{us(s['median'])} [{us(s['min'])}, {us(s['max'])}]"


def ratio_cell(r: dict[str, Any]) -> str:
    p = r["paired"]
    paired = f"{p['median']:.3f} [{p['min']:.3f}, {p['max']:.3f}]" if p else "-"
    return f"{r['of_medians']:.3f} | {paired}"


def markdown(result: dict[str, Any], analysis: dict[str, Any]) -> str:
    meta, config = result["meta"], result["config"]
    seconds = [f["seconds"] for f in result["fits"]]
    lines = [
        f"Measured {meta['date']} ({result['mode']} mode, {meta['wall_seconds']:.0f} s) on {meta['machine']}; "
        f"Python {meta['python']}, torch {meta['torch']}, lightning {meta['lightning']}, ddp_strategy "
        f"{meta['ddp_strategy']} ({meta['git']}); load average {meta['loadavg_start'][0]:.2f} at the start, "
        f"{meta['loadavg_end'][0]:.2f} at the end.",
        "",
        f"{config['rounds']} rounds, each running the 6 fits in a new seeded order; every fit its own `torchrun` "
        f"job (2 ranks, gloo, CPU, one thread per rank; {statistics.median(seconds):.1f} s per job with start-up, "
        f"untimed); per fit {config['warmup']} untimed warm-up steps, then {config['timed']} timed steps, batch "
        f"{config['batch_size']} per rank, MLP {SHAPE[0]}-{SHAPE[1]}-{SHAPE[2]}.",
        "",
        "Per fit, rank 0: *mean* = timed window / steps, *median* = median step (start of a step to the start of "
        "the next), *CPU* = training thread CPU time per step, *process CPU* = all threads of the process per step; "
        "*rank 1 mean* = rank 1's mean. Cells: median over rounds [min, max], in microseconds.",
        "",
        "| mode | variant | mean (us) | median (us) | CPU (us) | process CPU (us) | rank 1 mean (us) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in analysis["rows"]:
        lines.append(
            f"| {row['mode']} | {LABELS[row['variant']]} | {us_spread(row['step_mean_s'])} | "
            f"{us_spread(row['step_median_s'])} | {us_spread(row['cpu_step_s'])} | "
            f"{us_spread(row['process_cpu_step_s'])} | {us(row['rank1_step_mean_s']['median'])} |"
        )
    lines += [
        "",
        "Ratios: *of medians* = median of one variant / median of the other over the rounds; *paired* = median "
        "[min, max] of the per-round ratios (the two fits of a round ran a few seconds apart).",
        "",
        "| mode | ratio | mean: of medians | mean: paired | median step: of medians | median step: paired "
        "| CPU: of medians | CPU: paired | process CPU | rank 1 mean |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in analysis["ratios"]:
        lines.append(
            f"| {r['mode']} | {r['ratio']} | {ratio_cell(r['step_mean_s'])} | {ratio_cell(r['step_median_s'])} | "
            f"{ratio_cell(r['cpu_step_s'])} | {r['process_cpu_step_s']['of_medians']:.3f} | "
            f"{r['rank1_step_mean_s']['of_medians']:.3f} |"
        )
    lines += [
        "",
        "Target (issue 30, point 3), judged on the wall-clock mean step (ratio of medians), and again on the "
        "training thread's CPU time:",
        "",
        "| mode | target | wall (mean) | paired | median step | CPU | process CPU | result | result by CPU |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for t in analysis["targets"]:
        paired = f"{t['wall_paired_median']:.3f}" if t["wall_paired_median"] is not None else "-"
        lines.append(
            f"| {t['mode']} | {t['target']} | {t['wall']:.3f} | {paired} | {t['median_step']:.3f} | {t['cpu']:.3f} | "
            f"{t['process_cpu']:.3f} | {'met' if t['met'] else '**missed**'} | "
            f"{'met' if t['met_by_cpu'] else '**missed**'} |"
        )
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 rounds of 20 + 100 steps")
    parser.add_argument("--rounds", type=int, help="rounds (default 10, quick 2)")
    parser.add_argument("--out", type=Path, help="results path without suffix (default bench/results/tiny_step[-quick])")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per fit before it is killed")
    parser.add_argument("--report", type=Path, help="only re-render the Markdown of this results JSON")
    worker_args = parser.add_argument_group("worker (one rank of one fit, under torchrun)")
    worker_args.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    worker_args.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    worker_args.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    worker_args.add_argument("--warmup", type=int, help=argparse.SUPPRESS)
    worker_args.add_argument("--timed", type=int, help=argparse.SUPPRESS)
    worker_args.add_argument("--batch-size", type=int, help=argparse.SUPPRESS)
    worker_args.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.report is not None:
        result = json.loads(args.report.read_text())
        args.report.with_suffix(".md").write_text(markdown(result, analyse(result)))
        return 0
    config = config_for(args.quick, args.rounds)
    out = args.out or RESULTS / ("tiny_step-quick" if args.quick else "tiny_step")
    started = time.monotonic()
    meta = metadata()
    fits = plan(config)
    done = []
    with tempfile.TemporaryDirectory(prefix="bench-tiny-step-") as tmp:
        for index, fit in enumerate(fits):
            print(
                f"[{time.monotonic() - started:5.0f} s] fit {index + 1}/{len(fits)}: round {fit['round']} "
                f"{fit['variant']} {fit['mode']}",
                flush=True,
            )
            done.append(run_fit(fit, config, Path(tmp), index, args.timeout))
    meta["loadavg_end"] = list(os.getloadavg())
    meta["wall_seconds"] = time.monotonic() - started
    result: dict[str, Any] = {
        "mode": "quick" if args.quick else "full",
        "meta": meta,
        "config": {**config, "world_size": WORLD_SIZE, "model": list(SHAPE), "launcher": "torchrun --standalone"},
        "fits": done,
    }
    analysis = analyse(result)
    result["analysis"] = analysis
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    text = markdown(result, analysis)
    out.with_suffix(".md").write_text(text)
    print(text)
    print(f"Wrote {out}.json, .md in {meta['wall_seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
