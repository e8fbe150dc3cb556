"""Exact evaluation vs. stock Lightning evaluation: ``trainer.test`` time on the same data and ranks.

Driver:  python bench/exact_eval.py [--repeats 5] [--samples 2001] [--quick]
Worker:  python bench/exact_eval.py --worker --strategy ddp|safe_ddp --samples N --out FILE  (re-run per rank)

Both variants test the CIFAR-10 example model (real CIFAR-10 test images from ../shared/data when present, else
synthetic images) on 2 CPU processes with gloo. Stock ``DDPStrategy`` gives each rank a padded
``DistributedSampler`` share; ``SafeDDPStrategy`` deals whole batches and evaluates every image once, and also
runs its start-up handshake and the epoch-end key agreement. Each worker runs ``trainer.test`` ``--calls`` times
in one process (the first is a warm-up) and reports rank 0's wall time per call and the number of images the
result covers. Workers of the two variants alternate (A B A B ...). Target: exact evaluation is no slower.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
ARCHIVE = ROOT.parent / "shared" / "data" / "cifar10-jpg.tar.gz"
VARIANTS = ("ddp", "safe_ddp")


def worker(args: argparse.Namespace) -> None:
    import warnings

    import lightning.pytorch as pl

    sys.path.insert(0, str(ROOT))
    import ddp_strategy  # noqa: F401  (registers safe_ddp)
    from examples.cifar10.data import CIFAR10DataModule
    from examples.cifar10.model import CIFAR10Classifier

    class EpochTimer(pl.Callback):
        """Wall time from the first test batch's epoch start to the epoch end (metric sync included)."""

        def __init__(self) -> None:
            self.seconds: list[float] = []

        def on_test_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.start = time.perf_counter()

        def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.seconds.append(time.perf_counter() - self.start)

    warnings.filterwarnings("ignore")
    pl.seed_everything(0, verbose=False)
    timer = EpochTimer()
    datamodule = CIFAR10DataModule(
        data_dir=ROOT / "data",
        batch_size=64,
        num_workers=0,
        val_samples=args.samples,
        train_samples=64,
        seed=0,
        use_archive=ARCHIVE.exists(),
    )
    model = CIFAR10Classifier()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=args.strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
    )
    seconds, samples = [], []
    for _ in range(args.calls):
        start = time.perf_counter()
        results = trainer.test(model, datamodule=datamodule, verbose=False)
        seconds.append(time.perf_counter() - start)
        samples.append(float(results[0]["test_samples"]))
    if trainer.is_global_zero:
        out = {
            "strategy": args.strategy,
            "seconds": seconds[1:],
            "epoch_seconds": timer.seconds[1:],
            "samples": samples,
            "source": datamodule.source,
        }
        Path(args.out).write_text(json.dumps(out))


def driver(args: argparse.Namespace) -> int:
    runs: dict[str, list[float]] = {v: [] for v in VARIANTS}
    epochs: dict[str, list[float]] = {v: [] for v in VARIANTS}
    samples: dict[str, float] = {}
    source = "?"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    env.pop("LOCAL_RANK", None)
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            order = VARIANTS if repeat % 2 == 0 else VARIANTS[::-1]
            for variant in order:
                out = Path(tmp) / f"{variant}-{repeat}.json"
                cmd = [sys.executable, __file__, "--worker", "--strategy", variant, "--samples", str(args.samples)]
                cmd += ["--calls", str(args.calls), "--out", str(out)]
                subprocess.run(cmd, check=True, cwd=ROOT, env=env, capture_output=True, timeout=900)
                result = json.loads(out.read_text())
                runs[variant].extend(result["seconds"])
                epochs[variant].extend(result["epoch_seconds"])
                samples[variant] = result["samples"][-1]
                source = result["source"]
                print(f"repeat {repeat} {variant}: {[round(s, 3) for s in result['seconds']]}", flush=True)
    median = {v: statistics.median(runs[v]) for v in VARIANTS}
    epoch_median = {v: statistics.median(epochs[v]) for v in VARIANTS}
    ratio = median["safe_ddp"] / median["ddp"]
    epoch_ratio = epoch_median["safe_ddp"] / epoch_median["ddp"]
    rows = [
        f"| {v} | {samples[v]:.0f} | {median[v]:.3f} | {min(runs[v]):.3f} | {max(runs[v]):.3f} "
        f"| {epoch_median[v]:.3f} | {min(epochs[v]):.3f} | {max(epochs[v]):.3f} | {len(runs[v])} |"
        for v in VARIANTS
    ]
    table = "\n".join(
        [
            f"Data: {source}, {args.samples} test images, batch size 64, 2 CPU processes (gloo).",
            "",
            "| strategy | images counted | trainer.test median (s) | min | max | test epoch median (s) | min | max "
            "| calls |",
            "|---|---|---|---|---|---|---|---|---|",
            *rows,
            "",
            f"SafeDDPStrategy (exact) / stock DDPStrategy, median test epoch time (batches + metric sync): "
            f"**{epoch_ratio:.3f}** (target <= 1.0)",
            f"Same ratio for the whole `trainer.test` call (adds per-call set-up: control plane, handshake, "
            f"teardown): {ratio:.3f}",
        ]
    )
    print(table)
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "python": platform.python_version(),
    }
    if not args.quick:
        RESULTS.mkdir(exist_ok=True)
        payload = {
            "meta": meta,
            "samples": args.samples,
            "runs": runs,
            "epochs": epochs,
            "counted": samples,
            "ratio_test_call": ratio,
            "ratio_epoch": epoch_ratio,
        }
        (RESULTS / "exact_eval.json").write_text(json.dumps(payload, indent=2))
        (RESULTS / "exact_eval.md").write_text(f"# Exact evaluation vs. stock ({meta['date']})\n\n{table}\n")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--strategy", choices=VARIANTS, default="safe_ddp")
    parser.add_argument("--samples", type=int, default=2001)
    parser.add_argument("--calls", type=int, default=4, help="trainer.test calls per worker (the first is warm-up)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="")
    parser.add_argument("--quick", action="store_true", help="2 repeats, results not written")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    if args.quick:
        args.repeats = 2
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
