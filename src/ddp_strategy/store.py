"""The subset of the rendezvous store the package uses, as a protocol (the bottom layer: it imports nothing)."""

from __future__ import annotations

from datetime import timedelta
from typing import Protocol

__all__ = ["LastingKey", "Store", "get_if_set"]


class Store(Protocol):
    """The subset of :class:`torch.distributed.Store` the control plane uses (a fake one is used in tests)."""

    def set(self, key: str, value: str) -> None:
        """Store ``value`` under ``key``."""

    def get(self, key: str) -> bytes:
        """Return the value of ``key``, waiting for it to be set."""

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """Return the values of ``keys`` in one round trip."""

    def check(self, keys: list[str]) -> bool:
        """Return whether every key in ``keys`` is set, without waiting."""

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        """Wait until every key in ``keys`` is set, or raise after ``timeout``."""

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; return whether it existed."""

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the counter ``key`` (created at 0) and return its new value."""

    def append(self, key: str, value: str) -> None:
        """Append ``value`` to the value of ``key`` (created empty)."""

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected`` (or is absent and ``expected`` is ``""``).

        Returns the value of ``key`` afterwards.
        """


#: A value no key of the package ever holds (see :func:`get_if_set`).
_ABSENT = "\x00ddp_strategy:absent"


def get_if_set(store: Store, key: str) -> bytes | None:
    """The value of ``key``, or ``None`` when it is not set: one round trip, never waiting.

    ``get`` waits for a missing key (up to the store's timeout), so a read that must not wait was ``check`` then
    ``get``: two round trips. ``compare_set(key, ABSENT, ABSENT)`` with a value no key holds returns the key's
    value when it is set, and ``ABSENT`` without setting anything when it is not (torch's ``TCPStore``, libuv or
    not, ``HashStore`` and ``PrefixStore`` alike).

    Never use it on a key that any client waits for (a barrier's ``done``, the preemption notice): torch's libuv
    ``TCPStore`` server wakes every waiter of a key on a ``compare_set`` of it even when it sets nothing (seen with
    torch 2.14.1), so the waiters would return before the key exists (``tests/test_control_scale.py``).
    """
    value = store.compare_set(key, _ABSENT, _ABSENT)
    return None if value == _ABSENT.encode() else value


class LastingKey:
    """A key that stays once set (the next rank's position or audit): a ``check`` per look until it is seen.

    From then on it is taken as set without a round trip: such keys are deleted only at the run's close.

    Args:
        key: the store key.

    """

    def __init__(self, key: str) -> None:
        self.key = key
        self._seen = False

    def is_set(self, store: Store) -> bool:
        """Whether :attr:`key` is set: a ``check`` until it first was, then none."""
        self._seen = self._seen or store.check([self.key])
        return self._seen
