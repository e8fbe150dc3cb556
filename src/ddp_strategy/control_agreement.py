"""``ControlAgreement``: the agreement primitive of the control plane, :meth:`ControlAgreement.agree`.

Every rank takes the same decision on one small value per rank, or raises the same error. A base class of
:class:`~ddp_strategy.control.ControlPlane`, built on its object gather behind a monitored barrier
(:meth:`~ddp_strategy.control.ControlPlane.all_gather_object`); the values and decisions are in
:mod:`ddp_strategy.agreement`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar, overload

from .agreement import RankFailure, settle
from .positions import Position, call_site

__all__ = ["ControlAgreement"]

T = TypeVar("T")
R = TypeVar("R")


class ControlAgreement:
    """What a control plane offers on top of its object gather: :meth:`agree`.

    A subclass sets :attr:`rank` and implements :meth:`all_gather_object` (as
    :class:`~ddp_strategy.control.ControlPlane` does).
    """

    #: this process's global rank.
    rank: int

    def all_gather_object(
        self, obj: T, name: str, *, site: str | None = None, passed: Callable[[Position], bool] | None = None
    ) -> list[T]:
        """Gather one picklable object from every rank, on every rank, after a monitored barrier (a subclass's)."""
        raise NotImplementedError

    @overload
    def agree(
        self,
        name: str,
        local: Callable[[], T],
        decide: Callable[[Sequence[T | RankFailure]], R],
        *,
        site: str | None = None,
        passed: Callable[[Position], bool] | None = None,
    ) -> R: ...

    @overload
    def agree(
        self,
        name: str,
        local: T,
        decide: Callable[[Sequence[T | RankFailure]], R],
        *,
        site: str | None = None,
        passed: Callable[[Position], bool] | None = None,
    ) -> R: ...

    def agree(
        self,
        name: str,
        local: T | Callable[[], T],
        decide: Callable[[Sequence[T | RankFailure]], R],
        *,
        site: str | None = None,
        passed: Callable[[Position], bool] | None = None,
    ) -> R:
        """Make every rank take the same decision on one small value per rank, or raise the same error.

        The model is PyTorch DCP's ``_DistWrapper.all_reduce``: each rank computes its value, a failure included
        (so a rank that fails locally still takes part and nobody waits for it), the values are gathered on every
        rank (behind a monitored barrier, which names a rank that never comes), and ``decide`` turns them into the
        result on every rank. As every rank runs ``decide`` on the same values, every rank returns the same result
        or raises the same error. On a rank whose own step failed, that error is chained to its exception.

        Args:
            name: the name of the agreement, for barriers and errors; every rank must use the same.
            local: this rank's value (small and picklable), or a function without arguments computing it: an
                ``Exception`` it raises becomes this rank's value, as a :class:`RankFailure` (``KeyboardInterrupt``
                and ``SystemExit`` propagate at once). To agree on a value that is itself callable, pass a
                function returning it.
            decide: computes the result from the values, indexed by rank, or raises. It must depend only on the
                values (it may phrase a message relative to :attr:`rank`); :func:`first_failure` and
                :func:`from_rank` are the common decisions.
            site: the call site to report; found from the stack when not given.
            passed: for an agreement that only the ranks whose local test fired enter: see :meth:`barrier`.

        Returns:
            What ``decide`` returned, the same on every rank.

        Raises:
            CollectiveMismatchError: some rank did not reach the agreement in time, or reached another one.
            Exception: whatever ``decide`` raised, on every rank.

        """
        where = call_site(skip=2) if site is None else site

        def gather(mine: T | RankFailure) -> list[T | RankFailure]:
            return self.all_gather_object(mine, name, site=where, passed=passed)

        return settle(self.rank, local, decide, gather)
