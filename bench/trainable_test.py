"""The trainable-set test inside training steps: the package's against one Python read per parameter tensor.

Usage: python bench/trainable_test.py [--steps N] [--results-dir DIR]

``SafeDDPStrategy`` tests before every training step whether a parameter's ``requires_grad`` changed since DDP was
built (``TrainableSetWatcher.changed``). Timed in a loop with warm caches, a Python read of ``requires_grad`` costs
about 0.1 us per tensor; inside a training step, where the step's own work has taken the caches, it costs several
times that. So the test is timed where it runs: in a 2-rank fit (Lightning's launcher, gloo, CPU, one thread per
rank) of ``bench/tiny_step.py``'s model with a deeper body, for each model below, a callback's
``on_train_batch_start`` times three calls in every training step after a warm-up, in an order drawn anew at every
step (the first call of a step pays for the caches):

* ``package``: ``TrainableSetWatcher.changed()`` of this checkout, tracking the fit's DDP wrapper;
* ``python_reads``: the test as it was up to 2026-12-02: one Python read of ``requires_grad`` per tracked tensor and a
  comparison with the flags DDP was built with;
* ``empty``: a call that does nothing, timed the same way: the timing's own cost, not subtracted.

Models (parameter tensors): ``tiny`` (4, all trainable), ``deep`` (164, all trainable), ``deep_frozen`` (the same,
all but the last layer frozen before the fit: a fine-tuned head on a frozen backbone). Reported per model and call:
the median over the timed steps of the call's wall time when it came first in its step, and over all steps; and the
package's median against ``python_reads``' in the same steps. Writes ``trainable_test.{json,md}`` into
``--results-dir`` (default ``bench/results``). Figures of one run on a shared machine; the ratio is what compares.
"""

from __future__ import annotations

import argparse
import json
import operator
import random
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
#: the models: (hidden layers of 16 units between the tiny model's input and output layers, freeze all but the last)
MODELS = {"tiny": (0, False), "deep": (80, False), "deep_frozen": (80, True)}
CALLS = ("package", "python_reads", "empty")


def network(hidden: int) -> Any:
    """The tiny model's layers (``hidden == 0``), or with ``hidden`` layers of 16 units between its input and output."""
    from torch import nn

    from bench.workloads.tiny import SHAPE
    from bench.workloads.tiny import network as tiny_network

    if hidden == 0:
        return tiny_network()
    layers: list[nn.Module] = [nn.Linear(SHAPE[0], 16), nn.ReLU()]
    for _ in range(hidden):
        layers += [nn.Linear(16, 16), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(16, SHAPE[2]))


def python_reads(params: list[Any], flags: list[bool]) -> Callable[[], bool]:
    """The test as it was: every tracked tensor's ``requires_grad`` read from Python, compared with the built flags."""
    read = operator.attrgetter("requires_grad")

    def test() -> bool:
        return list(map(read, params)) != flags

    return test


def _empty() -> None:
    return None


def worker(model: str, steps: int, out: str) -> None:
    """One fit (Lightning's launcher starts rank 1 by re-running this command); rank 0 writes its timings to ``out``."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader, TensorDataset

    from bench.workloads.tiny import SHAPE, tiny_module
    from ddp_strategy import SafeDDPStrategy
    from ddp_strategy.trainable import TrainableSetWatcher

    hidden, frozen_backbone = MODELS[model]
    clock = time.perf_counter_ns

    class Timer(Callback):
        def __init__(self) -> None:
            self.calls: dict[str, Callable[[], object]] = {}
            self.times: dict[str, list[tuple[int, bool]]] = {name: [] for name in CALLS}  # (ns, came first)
            self.order = random.Random(0)

        def on_train_start(self, trainer: pl.Trainer, module: Any) -> None:
            wrapper: Any = trainer.strategy.model  # the DDP wrapper, as the strategy tracks it
            watcher = TrainableSetWatcher()
            watcher.track(wrapper)
            params = [p for _, p in wrapper.module.named_parameters()]
            flags = [bool(p.requires_grad) for p in params]
            self.calls = {"package": watcher.changed, "python_reads": python_reads(params, flags), "empty": _empty}

        def on_train_batch_start(self, trainer: pl.Trainer, module: Any, batch: Any, index: int) -> None:
            if index < WARMUP:
                return
            names = list(CALLS)
            self.order.shuffle(names)
            for position, name in enumerate(names):
                call = self.calls[name]
                start = clock()
                call()
                self.times[name].append((clock() - start, position == 0))
            if index == WARMUP + steps - 1 and trainer.global_rank == 0:
                wrapper: Any = trainer.strategy.model
                tracked = [p.requires_grad for p in wrapper.module.parameters()]
                Path(out).write_text(
                    json.dumps({"times": self.times, "tensors": len(tracked), "trainable": sum(tracked)})
                )

    torch.set_num_threads(1)
    lightning_module = tiny_module(sync_dist=False)
    lightning_module.net = network(hidden)
    if frozen_backbone:
        lightning_module.net[:-1].requires_grad_(False)
    samples = 32 * 2 * (WARMUP + steps + 1)
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(samples, SHAPE[0], generator=generator), torch.randint(0, SHAPE[2], (samples,), generator=generator)
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=SafeDDPStrategy(),
        max_steps=WARMUP + steps,
        max_epochs=1,
        callbacks=[Timer()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(Path(out).parent),
    )
    trainer.fit(lightning_module, DataLoader(data, batch_size=32))


def run_fit(model: str, steps: int, scratch: Path) -> dict[str, Any]:
    out = scratch / f"{model}.json"
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", model, "--steps", str(steps)]
    command += ["--out", str(out)]
    run = subprocess.run(command, timeout=600, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if run.returncode != 0 or not out.exists():
        raise subprocess.CalledProcessError(run.returncode, command)
    return dict(json.loads(out.read_text()))


def analyse(fit: dict[str, Any]) -> dict[str, Any]:
    """Per call: the median wall time (us) when first in its step and over all steps; the package's against the reads.

    Args:
        fit: a worker's record: per call a list of ``(nanoseconds, came first)``, and the model's tensor counts.

    """
    calls: dict[str, dict[str, float]] = {}
    for name, timed in fit["times"].items():
        first = [ns for ns, came_first in timed if came_first]
        calls[name] = {
            "first_us": statistics.median(first) / 1e3 if first else float("nan"),
            "all_us": statistics.median(ns for ns, _ in timed) / 1e3,
            "steps": len(timed),
        }
    return {
        "tensors": fit["tensors"],
        "trainable": fit["trainable"],
        "calls": calls,
        "package_over_python_reads": calls["package"]["all_us"] / calls["python_reads"]["all_us"],
        "package_over_python_reads_first": calls["package"]["first_us"] / calls["python_reads"]["first_us"],
    }


def render(result: dict[str, Any]) -> list[str]:
    machine = result["machine"]
    lines = [
        f"Measured {result['date']} on {machine['platform']}, torch {machine['torch']}, Lightning "
        f"{machine['lightning']}: a 2-rank fit of `SafeDDPStrategy()` per model (Lightning's launcher, gloo, CPU), "
        f"rank 0's training thread, {result['steps']} training steps after {result['warmup']} warm-up steps; each "
        "call's wall time in the callback's `on_train_batch_start`, in an order drawn at every step.",
        "",
        "| model | parameter tensors (trainable) | package, first in its step (us) | python reads, first (us) | "
        "empty call, first (us) | package, all steps (us) | python reads, all steps (us) | package / python reads |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, row in result["models"].items():
        calls = row["calls"]
        lines.append(
            f"| {name} | {row['tensors']} ({row['trainable']}) | {calls['package']['first_us']:.2f} | "
            f"{calls['python_reads']['first_us']:.2f} | {calls['empty']['first_us']:.2f} | "
            f"{calls['package']['all_us']:.2f} | {calls['python_reads']['all_us']:.2f} | "
            f"{row['package_over_python_reads']:.3f} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--results-dir", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--name", default="trainable_test", help="the results' file name, without suffix")
    parser.add_argument("--worker", choices=tuple(MODELS), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, steps=args.steps, out=args.out)
        return
    from bench.results_io import machine, write

    with tempfile.TemporaryDirectory(prefix="trainable-test-") as scratch:
        models = {model: analyse(run_fit(model, args.steps, Path(scratch))) for model in MODELS}
    result = {"steps": args.steps, "warmup": WARMUP, "models": models, **machine()}
    write(args.results_dir, args.name, result, render(result))


if __name__ == "__main__":
    main()
