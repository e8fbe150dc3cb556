"""How the strategy and its feature objects see each other.

``StrategyHost``: what the feature objects read from the strategy they serve. ``Delegated``: a strategy attribute
that shows one of theirs.
"""

from __future__ import annotations

from typing import Any, Generic, Protocol, TypeVar

import torch

__all__ = ["Delegated", "StrategyHost"]

T = TypeVar("T")


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

    @property
    def agreed_options(self) -> dict[str, str]:
        """The options every rank must be given alike, as text (``{name: value}``)."""


class Delegated(Generic[T]):
    """A read-only attribute of the strategy that shows an attribute of one of its feature objects.

    Setting it raises ``AttributeError`` (the feature objects were built from the options).

    In the class body, ``last_handshake_seconds = Delegated[float | None]("_handshakes", "last_seconds")`` makes
    ``strategy.last_handshake_seconds`` read ``strategy._handshakes.last_seconds``; without ``name``, the attribute
    of the same name (``barrier_timeout = Delegated[timedelta]("options")``).

    Args:
        holder: the strategy's attribute holding the feature object.
        name: the feature object's attribute shown (default: the name this attribute is given).

    """

    def __init__(self, holder: str, name: str | None = None) -> None:
        self.holder = holder
        self.name = name

    def __set_name__(self, owner: type, name: str) -> None:
        if self.name is None:
            self.name = name

    def __set__(self, instance: Any, value: object) -> None:
        raise AttributeError(
            f"`{self.name}` is read-only: it shows `{self.holder}.{self.name}`; pass it to the constructor instead."
        )

    def __get__(self, instance: Any, owner: type | None = None) -> T:
        if instance is None:
            return self  # type: ignore[return-value]  # the class's own attribute: the descriptor, for docs tools
        value: T = getattr(getattr(instance, self.holder), self.name or "")
        return value
