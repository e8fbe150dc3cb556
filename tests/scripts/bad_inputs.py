"""Resume from bad ``ckpt_path`` values, one ``trainer.fit`` each, in one multi-process launch.

Usage: python bad_inputs.py --out DIR [--devices N] CASE=PATH[@other] ...

Every rank runs every case and writes DIR/rank<r>.json: ``{case: {"type": ..., "message": ...}}`` (``type`` is
``None`` when the fit succeeded). ``@other`` loads into a model with other parameter names.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import lightning.pytorch as pl
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from scenario import TinyModel, loaders

from ddp_strategy import SafeDDPStrategy


class OtherModel(TinyModel):
    """Same sizes as TinyModel, other attribute names: its checkpoint keys are missing/unexpected for TinyModel."""

    def __init__(self) -> None:
        super().__init__()
        del self.net
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.head = nn.Linear(16, 2)
        self.net = nn.Sequential(self.encoder, self.head)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("cases", nargs="+")
    args = parser.parse_args()
    results: dict[str, dict[str, str | None]] = {}
    trainer = None
    for case in args.cases:
        name, spec = case.split("=", 1)
        path, _, kind = spec.partition("@")
        pl.seed_everything(1234)
        model = OtherModel() if kind == "other" else TinyModel()
        train, val = loaders()
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=args.devices,
            strategy=SafeDDPStrategy(barrier_timeout=60, heartbeat_interval=0.2),
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        try:
            trainer.fit(model, train, val, ckpt_path=path)
            results[name] = {"type": None, "message": None}
        except Exception as err:  # every case is expected to fail the same way on every rank
            results[name] = {"type": type(err).__name__, "message": str(err)}
    assert trainer is not None
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
