"""A standalone training script for the SLURM tests (``tests/test_slurm.py``): ``srun`` starts it once per rank.

Usage (in an sbatch script with ``--nodes=1 --ntasks-per-node=2``)::

    srun python slurm_train.py --progress-dir DIR [--strategy safe_ddp|ddp] [--devices 2] [--max-epochs N]
        [--train-size N] [--step-sleep S] [--pause-at-step N --pause S] [--ckpt-dir DIR --every-n-train-steps N]
        [--save-weights FILE]

Lightning finds its ``SLURMEnvironment`` from SLURM's variables (the job name must not be ``bash``/``interactive``),
and ``Trainer(devices=..., num_nodes=...)`` must match the job's ``--ntasks-per-node`` and ``--nodes``. The model
and its seeds are ``scenario.py``'s ``TinyModel`` (dropout, so the resumed RNG state matters); the training data is
``--train-size`` random samples in batches of 8, shuffled by Lightning's ``DistributedSampler``.

Each rank writes ``DIR/rank<r>.pid`` (its PID) at the start, one line about its cluster environment to the job
output, and after every training step ``DIR/rank<r>.step`` (``<global step> <time> running|paused``), then sleeps
``--step-sleep`` seconds, so that a signal lands mid-epoch and the test knows the step the job had reached. At
``--pause-at-step`` both ranks sleep ``--pause`` seconds in that step's ``on_train_batch_end`` and say ``paused``:
a signal sent then reaches both ranks at one step boundary (Lightning's SLURM auto-requeue handler saves its HPC
checkpoint from inside the signal handler, which is consistent only there).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch
from lightning_namespace import ModelCheckpoint, SafeDDPStrategy, pl
from scenario import TinyModel
from torch.utils.data import DataLoader, TensorDataset


class Progress(pl.Callback):
    """Write this rank's PID and, after every training step, its global step; sleep to pace the steps."""

    def __init__(self, directory: str, step_sleep: float, pause_at_step: int, pause: float) -> None:
        self.directory, self.step_sleep = directory, step_sleep
        self.pause_at_step, self.pause = pause_at_step, pause

    def _write(self, name: str, text: str) -> None:
        path = os.path.join(self.directory, name)
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        os.makedirs(self.directory, exist_ok=True)
        rank = trainer.global_rank
        self._write(f"rank{rank}.pid", str(os.getpid()))
        environment = type(trainer.strategy.cluster_environment).__name__
        print(
            f"slurm_train: rank {rank} of {trainer.world_size} (local rank {trainer.local_rank}, node "
            f"{trainer.node_rank}), pid {os.getpid()}, cluster environment {environment}, SLURM_PROCID="
            f"{os.environ.get('SLURM_PROCID')}, SLURM_JOB_ID={os.environ.get('SLURM_JOB_ID')}, "
            f"SLURM_RESTART_COUNT={os.environ.get('SLURM_RESTART_COUNT', '0')}, "
            f"strategy {type(trainer.strategy).__name__}",
            flush=True,
        )

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        name, step = f"rank{trainer.global_rank}.step", trainer.global_step
        if step == self.pause_at_step:
            self._write(name, f"{step} {time.time():.3f} paused")
            time.sleep(self.pause)
        self._write(name, f"{step} {time.time():.3f} running")
        time.sleep(self.step_sleep)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--progress-dir", required=True, help="rank<r>.pid and rank<r>.step go here")
    parser.add_argument("--strategy", default="safe_ddp", choices=["safe_ddp", "ddp"])
    parser.add_argument("--devices", type=int, default=2, help="= the job's --ntasks-per-node")
    parser.add_argument("--num-nodes", type=int, default=1, help="= the job's --nodes")
    parser.add_argument("--max-epochs", type=int, default=2)
    parser.add_argument("--train-size", type=int, default=256, help="training samples (batches of 8)")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds each rank sleeps after every step")
    parser.add_argument("--pause-at-step", type=int, default=-1, help="both ranks pause after this global step")
    parser.add_argument("--pause", type=float, default=0.0, help="... for this many seconds")
    parser.add_argument("--ckpt-dir", help="ModelCheckpoint(dirpath=..., save_last=True)")
    parser.add_argument("--every-n-train-steps", type=int, default=0, help="... every N steps (default: per epoch)")
    parser.add_argument("--barrier-timeout", type=float, default=60.0, help="SafeDDPStrategy(barrier_timeout=...)")
    parser.add_argument("--save-weights", help="rank 0 saves the final state_dict here")
    args = parser.parse_args()

    pl.seed_everything(1234)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.train_size, 8, generator=g)
    data = TensorDataset(x, (x[:, 0] > 0).long())
    train = DataLoader(data, batch_size=8, shuffle=True)
    val = DataLoader(TensorDataset(x[:32], (x[:32, 0] > 0).long()), batch_size=8)

    callbacks: list[Any] = [Progress(args.progress_dir, args.step_sleep, args.pause_at_step, args.pause)]
    if args.ckpt_dir:
        every = args.every_n_train_steps or None
        callbacks.append(
            ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=every, save_top_k=-1, save_last=True)
        )
    strategy: Any = (
        SafeDDPStrategy(barrier_timeout=args.barrier_timeout, heartbeat_interval=0.2)
        if args.strategy == "safe_ddp"
        else "ddp"
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=strategy,
        max_epochs=args.max_epochs,
        logger=False,
        enable_checkpointing=args.ckpt_dir is not None,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = TinyModel("fit_ok")
    # ckpt_path=None: under SLURM, Lightning resumes from the newest hpc_ckpt_<n>.ckpt in default_root_dir (the
    # job's working directory), which its SIGUSR1 handler wrote before it requeued the job
    trainer.fit(model, train, val)
    if trainer.is_global_zero and args.save_weights:
        torch.save(model.state_dict(), args.save_weights)
    print(f"slurm_train: rank {trainer.global_rank} finished at step {trainer.global_step}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
