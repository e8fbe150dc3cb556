"""What SafeDDPStrategy's default weight agreement and trainable-set watcher cost, measured directly (one process).

Usage: python bench/consistency_cost.py [--repeats N] [--results-dir DIR]

* **Fingerprint** (the per-rank work of every weight check: before each checkpoint save, at each epoch end, every N
  steps with ``WeightSyncCheck``): :class:`~ddp_strategy.consistency.Comparison` ``.digests()`` of the tensors the
  default check selects (parameters; buffers are re-broadcast by DDP's default ``broadcast_buffers=True``), for a
  ResNet-18-sized and a ResNet-50-sized model (torchvision's, random weights), on the CPU and, when CUDA is present,
  on the GPU (on-device fingerprints, two integers per tensor reach the host). Also one whole check at world size 1
  (tensor selection, fingerprints, comparison; the control-plane gather of 2 ranks adds a few ms, measured by
  ``bench/suite.py``'s periodic checks).
* **Trainable-set test** (``TrainableSetWatcher.changed()``, run by the strategy before every training step): one
  ``requires_grad`` read per parameter and a list comparison, for 62 (ResNet-18), 161 (ResNet-50) and 1000
  parameters, in microseconds per call (``timeit``, best and median of the repeats).

Writes ``consistency_cost.json`` and ``consistency_cost.md`` into ``--results-dir`` (default ``bench/results``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import timeit
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torchvision  # noqa: E402
from torch import nn  # noqa: E402

from ddp_strategy.consistency import WeightAgreement  # noqa: E402
from ddp_strategy.control import ControlPlane  # noqa: E402
from ddp_strategy.trainable import TrainableSetWatcher  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def models() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    many = nn.Sequential(*[nn.Linear(4, 4) for _ in range(500)])  # 1000 parameter tensors
    return {
        "resnet18": torchvision.models.resnet18(weights=None),
        "resnet50": torchvision.models.resnet50(weights=None),
        "1000 tensors": many,
    }


def fingerprint_seconds(model: nn.Module, repeats: int, device: str) -> dict[str, Any]:
    model = model.to(device)
    comparison = WeightAgreement(norm_statistics=False).comparison(model, when="", name="bench")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    comparison.digests()  # warm-up (on the GPU: kernels, the weights of the positional sum)
    samples = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        comparison.digests()
        sync()
        samples.append(time.perf_counter() - start)
    nbytes = sum(t.numel() * t.element_size() for _, _, t in comparison.tensors)
    median = statistics.median(samples)
    return {
        "device": device,
        "tensors": len(comparison.tensors),
        "parameters": sum(t.numel() for _, _, t in comparison.tensors),
        "megabytes": nbytes / 1e6,
        "median_s": median,
        "min_s": min(samples),
        "max_s": max(samples),
        "gb_per_s": nbytes / median / 1e9,
    }


def whole_check_seconds(model: nn.Module, repeats: int) -> float:
    plane = ControlPlane(
        rank=0, world_size=1, store=dist.HashStore(), group=None, timeout=timedelta(seconds=30), heartbeat_interval=0
    )
    agreement = WeightAgreement(norm_statistics=False)
    samples = []
    for step in range(repeats):
        start = time.perf_counter()
        error = agreement.check(plane, model, step=step, name=f"bench-{step}")
        samples.append(time.perf_counter() - start)
        assert error is None
    plane.close()
    return statistics.median(samples)


def watcher_microseconds(model: nn.Module, repeats: int) -> dict[str, Any]:
    watcher = TrainableSetWatcher()
    watcher.track(SimpleNamespace(module=model, parameters_to_ignore=set()))  # type: ignore[arg-type]
    assert not watcher.changed()
    number = 20_000
    times = timeit.repeat(watcher.changed, number=number, repeat=max(repeats, 5))
    per_call = [t / number * 1e6 for t in times]
    return {
        "parameters": len(list(model.parameters())),
        "best_us": min(per_call),
        "median_us": statistics.median(per_call),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--results-dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as one rank of the benchmark suite (one thread and one core per rank)

    found: dict[str, Any] = {"fingerprint": {}, "whole_check_s": {}, "trainable_set_check": {}}
    for name, model in models().items():
        found["trainable_set_check"][name] = watcher_microseconds(model, args.repeats)
        if name == "1000 tensors":
            continue
        found["fingerprint"][f"{name} cpu"] = fingerprint_seconds(model, args.repeats, "cpu")
        found["whole_check_s"][name] = whole_check_seconds(model, args.repeats)
        if torch.cuda.is_available():
            found["fingerprint"][f"{name} cuda"] = fingerprint_seconds(model, args.repeats, "cuda")
    import lightning

    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "repeats": args.repeats,
        "load_average": os.getloadavg()[0],
        "cuda": torch.cuda.is_available(),
    }
    lines = [
        f"Measured {meta['date']} on {meta['machine']} (load average {meta['load_average']:.1f}), torch "
        f"{meta['torch']}, one thread, {args.repeats} repeats.",
        "",
        "| fingerprint (per rank and check) | tensors | parameters | MB | median (ms) | min | max | GB/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, row in found["fingerprint"].items():
        lines.append(
            f"| {name} | {row['tensors']} | {row['parameters']:,} | {row['megabytes']:.1f} | "
            f"{row['median_s'] * 1e3:.1f} | {row['min_s'] * 1e3:.1f} | {row['max_s'] * 1e3:.1f} | "
            f"{row['gb_per_s']:.2f} |"
        )
    if not meta["cuda"]:
        lines.append("| (GPU path: not run, no CUDA device on this machine) | | | | | | | |")
    lines += ["", "| whole check at world size 1 (selection, fingerprints, comparison) | median (ms) |", "|---|---|"]
    lines += [f"| {name} | {seconds * 1e3:.1f} |" for name, seconds in found["whole_check_s"].items()]
    lines += [
        "",
        "| trainable-set test before each training step | parameter tensors | best (us) | median (us) |",
        "|---|---|---|---|",
    ]
    for name, row in found["trainable_set_check"].items():
        lines.append(f"| {name} | {row['parameters']} | {row['best_us']:.2f} | {row['median_us']:.2f} |")
    text = "\n".join(lines)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / "consistency_cost.json").write_text(json.dumps({"meta": meta, **found}, indent=2))
    (args.results_dir / "consistency_cost.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
