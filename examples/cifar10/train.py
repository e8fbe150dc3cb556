"""Train the small CIFAR-10 ResNet with the ``safe_ddp`` strategy (or plain ``ddp`` for comparison).

Run from the repository root, for example::

    python examples/cifar10/train.py                      # 2 CPU processes, safe_ddp, 3 epochs
    python examples/cifar10/train.py --strategy ddp       # Lightning's stock DDP, for comparison
    python examples/cifar10/train.py --resume             # continue from <ckpt-dir>/last.ckpt
    python examples/cifar10/train.py --no-archive --data-dir /tmp/empty   # force the synthetic data set

Only global rank 0 prints: one ``epoch {e}: val_acc=... val_loss=...`` line per epoch, the data source, and
the final ``test_acc=...`` of the best checkpoint. :func:`main` returns the final metrics, so tests can call
it in-process (use ``devices=1`` there: with more devices Lightning re-launches ``sys.argv`` as workers).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

_REPO_ROOT = Path(__file__).resolve().parents[2]

if __name__ == "__main__" and not __package__:
    # Run as ``python examples/cifar10/train.py``: make the relative imports below resolve to the
    # ``examples.cifar10`` package of this checkout (PEP 366), without installing anything.
    if str(_REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(_REPO_ROOT))
    __package__ = "examples.cifar10"

try:  # importing ddp_strategy registers "safe_ddp" in Lightning's StrategyRegistry
    import ddp_strategy
except ImportError:  # a checkout that was not pip-installed: use its src/ folder
    if not (_REPO_ROOT / "src" / "ddp_strategy").is_dir():
        raise
    sys.path.insert(0, str(_REPO_ROOT / "src"))
    import ddp_strategy  # noqa: F401

from .data import DEFAULT_DATA_DIR, CIFAR10DataModule  # noqa: E402
from .model import CIFAR10Classifier  # noqa: E402
from .progress import EpochSummary  # noqa: E402

__all__ = ["DEFAULT_CKPT_DIR", "RESULTS_FILE", "build_parser", "main"]

DEFAULT_CKPT_DIR = _REPO_ROOT / "checkpoints" / "cifar10"
#: Written by rank 0 into the checkpoint folder: the final metrics and the tested checkpoint (read by evaluate.py).
RESULTS_FILE = "results.json"


def build_parser() -> argparse.ArgumentParser:
    """Create the command-line parser of the training script.

    Returns:
        The argument parser.

    """
    parser = argparse.ArgumentParser(
        description="Train a small ResNet on CIFAR-10 with the safe_ddp strategy (CPU by default).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--devices", type=int, default=2, help="processes (CPU) or GPUs per node")
    parser.add_argument("--num-nodes", type=int, default=1, help="number of nodes (torchrun, SLURM)")
    parser.add_argument("--accelerator", default="cpu", help="Lightning accelerator: cpu, gpu, auto, ...")
    parser.add_argument("--strategy", default="safe_ddp", help="safe_ddp, or ddp for comparison")
    parser.add_argument("--max-epochs", type=int, default=3)
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR, help="data folder (never in git)")
    parser.add_argument("--ckpt-dir", type=Path, default=DEFAULT_CKPT_DIR, help="checkpoint and log folder")
    parser.add_argument("--resume", action="store_true", help="resume from <ckpt-dir>/last.ckpt if it exists")
    parser.add_argument("--download", action="store_true", help="download CIFAR-10 with torchvision")
    parser.add_argument(
        "--no-archive",
        action="store_true",
        help="ignore cifar10-jpg.tar.gz archives (like CIFAR10_NO_ARCHIVE=1), e.g. to force synthetic data",
    )
    parser.add_argument("--batch-size", type=int, default=64, help="batch size per process")
    parser.add_argument("--num-workers", type=int, default=0, help="data loader workers per process")
    parser.add_argument("--train-samples", type=int, default=5000, help="train subset (<= 0: all 50,000)")
    parser.add_argument("--val-samples", type=int, default=1000, help="val/test subset (<= 0: all 10,000)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate [3e-3 adamw, 0.1 sgd]")
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    parser.add_argument("--width", type=int, default=32, help="base channel width of the ResNet")
    parser.add_argument("--dropout", type=float, default=0.0, help="dropout before the classifier head")
    return parser


def _metrics_to_floats(metrics: dict[str, object]) -> dict[str, float]:
    result: dict[str, float] = {}
    for key, value in metrics.items():
        try:
            result[key] = float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            continue
    return result


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Train, validate every epoch, then test the best checkpoint.

    Args:
        argv: Command-line arguments (without the program name); ``None`` reads ``sys.argv``.

    Returns:
        Final metrics on every rank: ``val_acc``/``val_loss`` of the last epoch, ``best_val_acc``, and
        ``test_acc``/``test_loss`` of the best (or else the last) checkpoint.

    """
    args = build_parser().parse_args(argv)
    # num_workers=0 is deliberate on small CPU machines; Lightning's hint about it is noise here.
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")

    seed_everything(args.seed, workers=True)
    datamodule = CIFAR10DataModule(
        data_dir=args.data_dir,
        batch_size=args.batch_size,
        num_workers=args.num_workers,
        download=args.download,
        train_samples=args.train_samples if args.train_samples > 0 else None,
        val_samples=args.val_samples if args.val_samples > 0 else None,
        seed=args.seed,
        use_archive=not args.no_archive,
    )
    model = CIFAR10Classifier(lr=args.lr, width=args.width, dropout=args.dropout, optimizer=args.optimizer)

    ckpt_dir: Path = args.ckpt_dir
    checkpoint = ModelCheckpoint(
        dirpath=ckpt_dir,
        filename="best-{epoch:02d}-{val_acc:.4f}",
        monitor="val_acc",
        mode="max",
        save_top_k=1,
        save_last=True,
        enable_version_counter=False,  # keep a single last.ckpt, which --resume looks for
    )
    summary = EpochSummary()
    trainer = Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=args.strategy,
        max_epochs=args.max_epochs,
        callbacks=[checkpoint, summary],
        logger=CSVLogger(save_dir=ckpt_dir.parent, name=f"{ckpt_dir.name}-logs"),
        default_root_dir=ckpt_dir,
        enable_progress_bar=False,
        log_every_n_steps=5,
        deterministic=True,
    )

    ckpt_path: str | None = None
    if args.resume:
        last = ckpt_dir / f"{ModelCheckpoint.CHECKPOINT_NAME_LAST}{ModelCheckpoint.FILE_EXTENSION}"
        if last.is_file():
            ckpt_path = "last"
            message = f"Resuming from {last}"
        else:
            message = f"--resume: no {last.name} in {ckpt_dir}; starting fresh"
        if trainer.is_global_zero:
            print(message, flush=True)

    start = time.perf_counter()
    trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
    fit_seconds = time.perf_counter() - start
    results = _metrics_to_floats(dict(trainer.callback_metrics))
    final: dict[str, float] = {key: results[key] for key in ("val_acc", "val_loss") if key in results}
    if checkpoint.best_model_score is not None:
        final["best_val_acc"] = float(checkpoint.best_model_score)

    if trainer.is_global_zero:
        print(f"data source: {datamodule.source} ({datamodule.describe_source()})", flush=True)

    test_ckpt = "best" if checkpoint.best_model_path else ("last" if checkpoint.last_model_path else None)
    test_results = trainer.test(model, datamodule=datamodule, ckpt_path=test_ckpt, verbose=False)
    if test_results:
        final.update(_metrics_to_floats(dict(test_results[0])))
    final["fit_seconds"] = fit_seconds

    if trainer.is_global_zero:
        tested = checkpoint.best_model_path or checkpoint.last_model_path or "final weights"
        test_acc = final.get("test_acc", float("nan"))
        test_loss = final.get("test_loss", float("nan"))
        samples = int(final.get("test_samples", 0))
        print(
            f"test_acc={test_acc:.4f} test_loss={test_loss:.4f} on {samples} images "
            f"({trainer.world_size} process(es); checkpoint: {tested})",
            flush=True,
        )
        print(f"fit took {fit_seconds:.1f}s", flush=True)
        record = {**final, "test_checkpoint": tested, "world_size": trainer.world_size, "argv": sys.argv[1:]}
        (ckpt_dir / RESULTS_FILE).write_text(json.dumps(record, indent=2))
    return final


if __name__ == "__main__":
    main()
