"""Cost of SafeDDPStrategy's start-up handshake at world sizes 2 and 4 (CPU, gloo).

Driver:  python bench/handshake.py [--repeats 3] [--world-sizes 2 4]
Worker:  python bench/handshake.py --worker --devices N --model small|large --out FILE  (re-run per rank)

The handshake is one monitored barrier plus one all_gather_object on the gloo control plane, carrying each
rank's facts and two integers per parameter/buffer. The table reports its wall time on rank 0 (median, min, max
over repeats, runs interleaved) next to the whole `trainer.fit` start-up, for a small model and a 25M-parameter
MLP (fingerprinting cost grows with the parameter count).
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
MODELS = {"small": (32, 64, 2), "large": (2048, 4096, 3)}  # (in/out width, hidden width, hidden layers)


def build_model(kind: str):  # type: ignore[no-untyped-def]
    import lightning.pytorch as pl
    import torch
    from torch import nn

    width, hidden, layers = MODELS[kind]

    class MLP(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            mods: list[nn.Module] = [nn.Linear(width, hidden), nn.ReLU()]
            for _ in range(layers - 1):
                mods += [nn.Linear(hidden, hidden), nn.ReLU()]
            mods.append(nn.Linear(hidden, width))
            self.net = nn.Sequential(*mods)

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            (x,) = batch
            return (self.net(x) - x).pow(2).mean()

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    return MLP(), width


def worker(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from ddp_strategy import SafeDDPStrategy

    pl.seed_everything(0)
    model, width = build_model(args.model)
    data = DataLoader(TensorDataset(torch.randn(16, width)), batch_size=4)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=SafeDDPStrategy(),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    start = time.perf_counter()
    trainer.fit(model, data)
    fit_seconds = time.perf_counter() - start
    if trainer.is_global_zero:
        n_params = sum(p.numel() for p in model.parameters())
        Path(args.out).write_text(
            json.dumps(
                {
                    "handshake_seconds": trainer.strategy.last_handshake_seconds,
                    "fit_seconds": fit_seconds,
                    "params": n_params,
                }
            )
        )


def driver(args: argparse.Namespace) -> None:
    rows: dict[tuple[int, str], list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for ws in args.world_sizes:
                for kind in ("small", "large"):
                    out = Path(tmp) / f"{ws}-{kind}-{repeat}.json"
                    cmd = [sys.executable, __file__, "--worker", "--devices", str(ws), "--model", kind]
                    subprocess.run([*cmd, "--out", str(out)], check=True, cwd=ROOT, capture_output=True, timeout=600)
                    rows.setdefault((ws, kind), []).append(json.loads(out.read_text()))
                    print(f"repeat {repeat}: world size {ws}, {kind}: {rows[(ws, kind)][-1]}", flush=True)
    lines = [
        "| world size | model | parameters | handshake median (s) | min | max | trainer.fit start-to-end (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    table = []
    for (ws, kind), runs in sorted(rows.items()):
        hs = [r["handshake_seconds"] for r in runs]
        fit = statistics.median(r["fit_seconds"] for r in runs)
        lines.append(
            f"| {ws} | {kind} MLP | {runs[0]['params']:,} | {statistics.median(hs):.4f} | {min(hs):.4f} | "
            f"{max(hs):.4f} | {fit:.2f} |"
        )
        table.append({"world_size": ws, "model": kind, "params": runs[0]["params"], "handshake_seconds": hs})
    import lightning
    import torch

    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "repeats": args.repeats,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "handshake.json").write_text(json.dumps({"meta": meta, "rows": table}, indent=2))
    text = "\n".join(lines)
    (RESULTS / "handshake.md").write_text(
        f"Measured {meta['date']} on {meta['machine']}, torch {meta['torch']}, "
        f"lightning {meta['lightning']}, {args.repeats} repeats.\n\n{text}\n"
    )
    print(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--model", choices=sorted(MODELS), default="small")
    parser.add_argument("--out")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    worker(args) if args.worker else driver(args)


if __name__ == "__main__":
    main()
