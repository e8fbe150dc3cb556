"""The cost of desync detection per collective: ``self.log(..., sync_dist=True)`` calls, measured side by side.

    python bench/desync_cost.py                 # 5 repeats of every variant (about 4 minutes)
    python bench/desync_cost.py --repeats 3

Every job is one 2-rank ``fit`` on the CPU (gloo, Lightning's subprocess launcher) of a tiny MLP whose
``training_step`` logs ``--logs`` values with ``sync_dist=True``: each is a ``strategy.reduce``, which Lightning runs
as a barrier and an all-reduce (``SafeDDPStrategy`` since 12b4323: the all-reduce alone), so the step time is
dominated by these collectives. Variants, their order rotated
every repeat:

* ``stock``: Lightning's ``DDPStrategy``; torch's Flight Recorder at torch's default, which is on (2000 entries;
  this docstring said "off" until 2026-11-29, see bench/README.md);
* ``stock_traced``: the same with the recorder at 2048 entries: so not the recording's own cost, which both have;
* ``safe``: ``SafeDDPStrategy()`` (desync detection on, its default);
* ``safe_off``: ``SafeDDPStrategy(desync_detection=False)``.

Per job, rank 0's median step time after ``--warmup`` steps. Per variant the median over repeats. The added time per
``self.log(..., sync_dist=True)`` call is ``(safe - safe_off) / logs`` (everything detection adds, recording included),
and per collective the same (one collective per call); ``(stock_traced - stock) / collectives per step`` (two per
call) is the Flight Recorder's recording alone. Results: ``bench/results/desync_cost.{json,md}``.
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

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = ("stock", "stock_traced", "safe", "safe_off")
COLLECTIVES_PER_LOG = 2  # Lightning's _sync_ddp: a barrier, then the all-reduce
SAFE_COLLECTIVES_PER_LOG = 1  # SafeDDPStrategy.reduce: one collective (all_reduce_value; on gloo an all-gather)


def worker(args: argparse.Namespace) -> None:
    """One fit (this script re-run by Lightning's launcher on rank 1); rank 0 writes its step times."""
    if str(ROOT / "src") not in sys.path:
        sys.path.insert(0, str(ROOT / "src"))
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import Callback
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from ddp_strategy import SafeDDPStrategy

    logs = args.logs

    class Logged(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x).squeeze(-1), y)
            for i in range(logs):
                self.log(f"m{i}", loss.detach(), sync_dist=True)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Steps(Callback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_train_batch_end(self, *_: Any) -> None:
            self.ends.append(time.perf_counter())

    g = torch.Generator().manual_seed(0)
    samples = 4 * 2 * (args.steps + 1)
    data = TensorDataset(torch.randn(samples, 16, generator=g), torch.randn(samples, generator=g))
    strategy: Any = {
        "stock": "ddp",
        "stock_traced": "ddp",
        "safe": SafeDDPStrategy(),
        "safe_off": SafeDDPStrategy(desync_detection=False),
    }[args.variant]
    steps = Steps()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[steps],
    )
    trainer.fit(Logged(), DataLoader(data, batch_size=4))
    if trainer.global_rank == 0:
        gaps = [b - a for a, b in zip(steps.ends, steps.ends[1:], strict=False)][args.warmup :]
        Path(args.out).write_text(json.dumps({"median_step_s": statistics.median(gaps), "steps": len(gaps)}))


def run_job(variant: str, args: argparse.Namespace, tmp: Path, index: int) -> float:
    out = tmp / f"{variant}-{index}.json"
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}", "OMP_NUM_THREADS": "1"}
    env.pop("TORCH_FR_BUFFER_SIZE", None)
    if variant == "stock_traced":
        env["TORCH_FR_BUFFER_SIZE"] = "2048"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--variant", variant, "--out", str(out)]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--logs", str(args.logs)]
    done = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=600, start_new_session=True)
    if done.returncode != 0 or not out.exists():
        raise SystemExit(f"{variant} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return float(json.loads(out.read_text())["median_step_s"])


def resolved(result: dict[str, Any], a: str, b: str) -> bool:
    """Whether the medians of ``a`` and ``b`` differ by more than the larger spread of their per-repeat medians."""
    v = result["variants"]
    spread = max(max(v[n]["runs_s"]) - min(v[n]["runs_s"]) for n in (a, b))
    return abs(v[a]["median_s"] - v[b]["median_s"]) > spread


def markdown(result: dict[str, Any]) -> str:
    v = result["variants"]

    def verdict(value: float, a: str, b: str) -> str:
        if resolved(result, a, b):
            return f"**{value:.1f} us**"
        return f"{value:.1f} us: within the between-job noise (the medians differ by less than the spread)"

    lines = [
        "| variant | median step (ms) | per-repeat medians (ms) |",
        "|---|---|---|",
        *(
            f"| {name} | {v[name]['median_s'] * 1e3:.2f} | {', '.join(f'{x * 1e3:.2f}' for x in v[name]['runs_s'])} |"
            for name in VARIANTS
        ),
        "",
        f"{result['logs']} `self.log(..., sync_dist=True)` calls per step, {COLLECTIVES_PER_LOG} collectives each "
        f"with stock, {SAFE_COLLECTIVES_PER_LOG} with safe; 2 CPU ranks (gloo).",
        "",
        "- added per `self.log(..., sync_dist=True)` call (safe - safe_off): "
        + verdict(result["added_per_log_us"], "safe", "safe_off"),
        "- the Flight Recorder's recording alone, per collective (stock_traced - stock): "
        + verdict(result["recording_per_collective_us"], "stock_traced", "stock"),
        f"- safe / stock step time: {result['safe_over_stock']:.3f}",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--warmup", type=int, default=15)
    parser.add_argument("--logs", type=int, default=16, help="self.log(..., sync_dist=True) calls per step")
    parser.add_argument("--results-dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    runs: dict[str, list[float]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="desync-cost-") as tmp:
        for repeat in range(args.repeats):
            order = VARIANTS[repeat % len(VARIANTS) :] + VARIANTS[: repeat % len(VARIANTS)]
            for variant in order:
                runs[variant].append(run_job(variant, args, Path(tmp), repeat))
                print(f"repeat {repeat + 1}/{args.repeats} {variant}: {runs[variant][-1] * 1e3:.2f} ms", flush=True)
    med = {name: statistics.median(values) for name, values in runs.items()}
    per_step = args.logs * COLLECTIVES_PER_LOG
    safe_per_step = args.logs * SAFE_COLLECTIVES_PER_LOG
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "logs": args.logs,
        "repeats": args.repeats,
        "steps": args.steps,
        "warmup": args.warmup,
        "variants": {name: {"median_s": med[name], "runs_s": runs[name]} for name in VARIANTS},
        "added_per_log_us": (med["safe"] - med["safe_off"]) / args.logs * 1e6,
        "added_per_collective_us": (med["safe"] - med["safe_off"]) / safe_per_step * 1e6,
        "recording_per_collective_us": (med["stock_traced"] - med["stock"]) / per_step * 1e6,
        "safe_over_stock": med["safe"] / med["stock"],
    }
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / "desync_cost.json").write_text(json.dumps(result, indent=2) + "\n")
    text = markdown(result)
    (args.results_dir / "desync_cost.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
