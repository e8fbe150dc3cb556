"""Which Lightning the test scripts run on: ``DDP_TEST_NAMESPACE=pytorch_lightning`` selects the standalone package.

The variable is inherited by the ranks Lightning's launcher starts, so every rank uses the same namespace. Scripts
import Lightning and ``ddp_strategy`` from here, as a user of that namespace would import them.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

NAMESPACE = os.environ.get("DDP_TEST_NAMESPACE", "lightning")

if NAMESPACE == "pytorch_lightning" and not TYPE_CHECKING:
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import ModelCheckpoint
    from pytorch_lightning.loggers import CSVLogger

    import ddp_strategy.pytorch_lightning as ddp_strategy
    from ddp_strategy.pytorch_lightning import SafeDDPStrategy, callbacks, testing
elif NAMESPACE == "lightning" or TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    import ddp_strategy
    from ddp_strategy import SafeDDPStrategy, callbacks, testing
else:
    raise SystemExit(f"DDP_TEST_NAMESPACE must be 'lightning' or 'pytorch_lightning', got {NAMESPACE!r}")

__all__ = ["NAMESPACE", "CSVLogger", "ModelCheckpoint", "SafeDDPStrategy", "callbacks", "ddp_strategy", "pl", "testing"]
