"""Re-evaluate the checkpoint a ``train.py`` run tested, on one device, and compare with the distributed result.

Run from the repository root after ``train.py`` (``make demo`` does both)::

    python examples/cifar10/evaluate.py                       # reads checkpoints/cifar10/results.json
    python examples/cifar10/evaluate.py --ckpt-dir /tmp/run   # another run's folder

It rebuilds the same data and model from the training run's arguments, runs ``trainer.test`` with
``devices=1`` on the checkpoint the run tested, prints both results, and exits non-zero if the test accuracy or
the number of test images differ: with ``SafeDDPStrategy`` every image is evaluated exactly once on whichever
rank it lands, so the multi-process answer is the single-device answer.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

from lightning.pytorch import Trainer

_REPO_ROOT = Path(__file__).resolve().parents[2]

if __name__ == "__main__" and not __package__:
    if str(_REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(_REPO_ROOT))
    __package__ = "examples.cifar10"

from .train import DEFAULT_CKPT_DIR, RESULTS_FILE, build_parser  # noqa: E402  (also makes ddp_strategy importable)

from ddp_strategy.checkpoint.io import SafeCheckpointIO  # noqa: E402  isort: skip

from .data import CIFAR10DataModule  # noqa: E402
from .model import CIFAR10Classifier  # noqa: E402

__all__ = ["main"]

#: Losses are sums of floats added in another order on several ranks; accuracies and counts must match exactly.
LOSS_TOLERANCE = 1e-5


def main(argv: list[str] | None = None) -> int:
    """Evaluate on one device and compare; returns the process exit code (0: identical results)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt-dir", type=Path, default=DEFAULT_CKPT_DIR, help="the training run's folder")
    args = parser.parse_args(argv)
    results_path = args.ckpt_dir / RESULTS_FILE
    if not results_path.is_file():
        print(f"No {RESULTS_FILE} in {args.ckpt_dir}: run examples/cifar10/train.py first.", file=sys.stderr)
        return 2
    recorded = json.loads(results_path.read_text())
    train_args = build_parser().parse_args(recorded["argv"])
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")

    datamodule = CIFAR10DataModule(
        data_dir=train_args.data_dir,
        batch_size=train_args.batch_size,
        num_workers=0,
        download=False,
        train_samples=train_args.train_samples if train_args.train_samples > 0 else None,
        val_samples=train_args.val_samples if train_args.val_samples > 0 else None,
        seed=train_args.seed,
        use_archive=not train_args.no_archive,
    )
    model = CIFAR10Classifier(
        lr=train_args.lr, width=train_args.width, dropout=train_args.dropout, optimizer=train_args.optimizer
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        plugins=[SafeCheckpointIO()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    checkpoint = recorded["test_checkpoint"]
    tested = trainer.test(model, datamodule=datamodule, ckpt_path=checkpoint, verbose=False)
    single = {key: float(value) for key, value in tested[0].items()}
    world = recorded["world_size"]
    print(f"checkpoint: {checkpoint}")
    for key in ("test_acc", "test_samples", "test_loss"):
        print(f"  {key:<12} {world} process(es): {recorded.get(key, float('nan')):.6f}   1 device: {single[key]:.6f}")
    same = (
        recorded.get("test_acc") == single["test_acc"]
        and recorded.get("test_samples") == single["test_samples"]
        and abs(recorded.get("test_loss", float("inf")) - single["test_loss"]) <= LOSS_TOLERANCE
    )
    print("identical to the single-device evaluation" if same else "MISMATCH with the single-device evaluation")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
