"""One "node" of a multi-node run whose rendezvous the tests watch (tests/test_rendezvous.py).

Usage: NODE_RANK=.. MASTER_ADDR=.. MASTER_PORT=.. python rendezvous.py --num-nodes N --devices D
       [--strategy safe_ddp|ddp] [--interval S] [--timeout S] [--out RESULT.json] [--exit-on-rank R]

Lightning's launcher starts the node's other local ranks (devices > 1); under torchrun the environment says who is
who. A short fit of scenario.py's model; rank 0 writes --out when it ends. ``NODE_STRATEGY_OPTIONS`` (JSON, optional)
holds keyword arguments for the strategy read from the node's environment, as a per-node job config would give
them (``{"bucket_cap_mb": 1}``; for ``--strategy ddp`` a ``DDPStrategy`` is built with them). With ``--then-validate``
a second Trainer validates the fitted model in the same processes (the process group exists: no rendezvous), its
strategy built with ``NODE_VALIDATE_OPTIONS`` (JSON) from the node's environment.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from lightning_namespace import SafeDDPStrategy, ddp_strategy, pl
from scenario import TinyModel, loaders


def count_rendezvous_store_ops() -> None:
    """Count the store operations of this rank's rendezvous (``rendezvous.join``'s store); print them after it."""
    module = ddp_strategy.rendezvous
    original = module.join

    class Counting:
        def __init__(self, inner: Any) -> None:
            self.inner, self.ops = inner, 0

        def __getattr__(self, name: str) -> Any:
            method = getattr(self.inner, name)

            def counted(*args: Any, **kwargs: Any) -> Any:
                self.ops += 1
                return method(*args, **kwargs)

            return counted

    def join(store: Any, me: Any, **kwargs: Any) -> None:
        counting = Counting(store)
        original(counting, me, **kwargs)
        print(f"script: rank {me.rank} rendezvous store ops: {counting.ops}", flush=True)

    module.join = join


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-nodes", type=int, required=True)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--strategy", default="safe_ddp", choices=["safe_ddp", "ddp"])
    parser.add_argument("--interval", type=float, default=30.0, help="SafeDDPStrategy(rendezvous_report_interval=)")
    parser.add_argument("--timeout", type=float, default=None, help="SafeDDPStrategy(rendezvous_timeout=)")
    parser.add_argument("--count-store-ops", action="store_true", help="print the rendezvous' store operations")
    parser.add_argument("--out")
    parser.add_argument("--exit-on-rank", type=int, help="this global rank (SLURM_PROCID) exits with 3 before fit")
    parser.add_argument("--then-validate", action="store_true", help="validate with a second Trainer after fit")
    args = parser.parse_args()
    if args.exit_on_rank is not None and os.environ.get("SLURM_PROCID") == str(args.exit_on_rank):
        print(f"script: rank {args.exit_on_rank} fails before fit", flush=True)  # as a task that crashed early
        raise SystemExit(3)
    print(f"script: rank process {os.getpid()} imports ddp_strategy from {ddp_strategy.__file__}", flush=True)
    if args.count_store_ops:
        count_rendezvous_store_ops()
    node_options = json.loads(os.environ.get("NODE_STRATEGY_OPTIONS", "{}"))  # this node's own config
    strategy: object = pl.strategies.DDPStrategy(**node_options) if node_options else "ddp"
    if args.strategy == "safe_ddp":
        strategy = SafeDDPStrategy(
            rendezvous_report_interval=args.interval, rendezvous_timeout=args.timeout, **node_options
        )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=strategy,
        max_epochs=1,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    train, val = loaders()
    started = time.time()
    print(f"script: fit starts at {started:.3f}", flush=True)
    model = TinyModel()
    trainer.fit(model, train, val)
    if args.then_validate:
        validate_options = json.loads(os.environ.get("NODE_VALIDATE_OPTIONS", "{}"))  # this node's own config
        validator = pl.Trainer(
            accelerator="cpu",
            devices=args.devices,
            num_nodes=args.num_nodes,
            strategy=SafeDDPStrategy(**validate_options),
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        print("script: validate starts", flush=True)
        validator.validate(model, val)
    if trainer.is_global_zero and args.out:
        with open(args.out, "w") as f:
            json.dump({"world_size": trainer.world_size, "global_step": trainer.global_step, "started": started}, f)


if __name__ == "__main__":
    main()
