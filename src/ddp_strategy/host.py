"""``StrategyHost``: what the strategy's feature objects read from the strategy they serve."""

from __future__ import annotations

from typing import Any, Protocol

import torch

__all__ = ["StrategyHost"]


class StrategyHost(Protocol):
    """The Lightning ``Strategy`` attributes that the feature objects of :class:`~ddp_strategy.SafeDDPStrategy` read.

    They are read when needed, not copied: ranks, devices and the model are known only once the run set them up.
    """

    @property
    def global_rank(self) -> int:
        """This process's rank among all ranks."""

    @property
    def local_rank(self) -> int:
        """This process's rank on its node."""

    @property
    def node_rank(self) -> int:
        """The node's rank."""

    @property
    def world_size(self) -> int:
        """The number of ranks."""

    @property
    def is_global_zero(self) -> bool:
        """Whether this is global rank 0."""

    @property
    def root_device(self) -> torch.device:
        """This rank's device."""

    @property
    def model(self) -> Any:
        """The model, the DDP wrapper once set up (``None`` before)."""

    @property
    def lightning_module(self) -> Any:
        """The LightningModule (``None`` before the strategy is connected)."""

    @property
    def checkpoint_io(self) -> Any:
        """The checkpoint IO plugin that reads and writes files."""

    @property
    def precision_plugin(self) -> Any:
        """The precision plugin (its step context managers)."""
