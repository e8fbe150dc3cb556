"""The agreement primitive's values and decisions: what a rank's failed local step becomes, and how ranks decide.

:meth:`~ddp_strategy.control.ControlPlane.agree` gathers one small value per rank, a failure included, and runs
the same decision on every rank (:func:`settle`). A rank's local step that raised travels as a :class:`RankFailure`;
:func:`first_failure` and :func:`from_rank` are the common decisions, :func:`failures` and :func:`also_failed` help
phrase an error that names every failing rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from .errors import DDPStrategyError
from .positions import format_ranks

__all__ = ["RankFailure", "also_failed", "failures", "first_failure", "from_rank", "settle"]

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class RankFailure:
    """What one rank's local step of :meth:`ControlPlane.agree` raised, as every rank receives it.

    Exceptions themselves do not travel between ranks (many do not unpickle: keyword-only constructor arguments,
    unpicklable attributes); their class name and text do. On the rank that raised it, :attr:`exception` is the
    exception itself, for chaining or re-raising; it is ``None`` on the other ranks and is never pickled.

    Attributes:
        rank: the global rank whose local step raised.
        type_name: the exception's class name, e.g. ``"OSError"``.
        message: the text to show: an error of this package as is (it names its own cause), any other exception as
            ``"TypeName: text"``.
        exception: the exception itself on the rank that raised it, else ``None``.

    """

    rank: int
    type_name: str
    message: str
    exception: BaseException | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, rank: int, exception: BaseException) -> RankFailure:
        """Describe ``exception``, raised by the local step of ``rank``."""
        text = str(exception) if isinstance(exception, DDPStrategyError) else f"{type(exception).__name__}: {exception}"
        return cls(rank=rank, type_name=type(exception).__name__, message=text, exception=exception)

    def __reduce__(self) -> tuple[type[RankFailure], tuple[int, str, str]]:
        return (RankFailure, (self.rank, self.type_name, self.message))  # without the local exception

    def __str__(self) -> str:
        return self.message


def failures(values: Sequence[object]) -> list[RankFailure]:
    """The :class:`RankFailure` entries among the values :meth:`ControlPlane.agree` gathered, lowest rank first."""
    return [value for value in values if isinstance(value, RankFailure)]


def also_failed(failed: Sequence[RankFailure]) -> str:
    """A sentence naming every failing rank when more than one failed (for messages that show the first), else ``""``.

    Example:
        >>> also_failed([RankFailure(0, "OSError", "a"), RankFailure(2, "OSError", "b")])
        ' (rank(s) 0, 2 failed; the first failure is shown)'

    """
    if len(failed) < 2:
        return ""
    return f" (rank(s) {format_ranks([f.rank for f in failed])} failed; the first failure is shown)"


def first_failure(
    make_error: Callable[[list[RankFailure]], BaseException],
) -> Callable[[Sequence[T | RankFailure]], list[T]]:
    """A decision for :meth:`ControlPlane.agree`: when any rank failed, every rank raises the same error.

    Args:
        make_error: builds the error from every failure, lowest rank first (``failed[0]`` is the one to report;
            :func:`also_failed` names the others). It runs on every rank with the same failures; it may phrase the
            message relative to the calling rank, or return a failing rank's own :attr:`RankFailure.exception` to
            re-raise it there.

    Returns:
        The decision: the values of every rank (none failed), else raises ``make_error(failures)``.

    """

    def decide(values: Sequence[T | RankFailure]) -> list[T]:
        failed = failures(values)
        if failed:
            raise make_error(failed)
        return [value for value in values if not isinstance(value, RankFailure)]

    return decide


def from_rank(
    src: int = 0, make_error: Callable[[list[RankFailure]], BaseException] | None = None
) -> Callable[[Sequence[T | RankFailure]], T]:
    """A decision for :meth:`ControlPlane.agree`: every rank takes rank ``src``'s value (a checked broadcast).

    Meant for small values; send a large payload with :meth:`ControlPlane.broadcast_object`.

    Args:
        src: the rank whose value every rank takes.
        make_error: the error every rank raises when some rank's local step failed (as for :func:`first_failure`);
            by default a :class:`~ddp_strategy.errors.DDPStrategyError` naming the first failing rank.

    Returns:
        The decision.

    """

    def default_error(failed: list[RankFailure]) -> BaseException:
        first = failed[0]
        return DDPStrategyError(f"Rank {first.rank} failed: {first.message}{also_failed(failed)}")

    every = first_failure(make_error if make_error is not None else default_error)

    def decide(values: Sequence[T | RankFailure]) -> T:
        return every(values)[src]

    return decide


def _chain_last(err: BaseException, first: BaseException) -> None:
    """Make ``first`` the context of the innermost exception of ``err``'s chain, so tracebacks show both."""
    seen = {id(err)}
    tail = err
    while (inner := tail.__cause__ or tail.__context__) is not None and id(inner) not in seen:
        seen.add(id(inner))
        tail = inner
    if first is not tail and id(first) not in seen:
        tail.__context__ = first


def settle(
    rank: int,
    local: T | Callable[[], T],
    decide: Callable[[Sequence[T | RankFailure]], R],
    gather: Callable[[T | RankFailure], list[T | RankFailure]],
) -> R:
    """The body of :meth:`~ddp_strategy.control.ControlPlane.agree`: this rank's value, gathered, then decided.

    Args:
        rank: this rank.
        local: this rank's value, or a function without arguments computing it (an ``Exception`` it raises becomes
            this rank's value, as a :class:`RankFailure`).
        decide: computes the result from every rank's value, indexed by rank, or raises.
        gather: gathers this rank's value from every rank, on every rank (behind a monitored barrier).

    Returns:
        What ``decide`` returned. On a rank whose own step failed, an error raised by ``gather`` or ``decide`` is
        chained to that rank's exception.

    """
    mine: T | RankFailure
    if callable(local):
        try:
            mine = local()
        except Exception as err:  # a value like any other: the other ranks learn it instead of waiting
            mine = RankFailure.of(rank, err)
    else:
        mine = local
    own = mine.exception if isinstance(mine, RankFailure) else None
    try:
        values = gather(mine)
    except BaseException as err:
        if own is not None:  # shown with the barrier's error: this rank had failed too
            _chain_last(err, own)
        raise
    values[rank] = mine  # this rank's own entry keeps its exception (only its text travelled)
    try:
        return decide(values)
    except BaseException as err:
        if own is None or err is own or err.__cause__ is not None:
            raise
        raise err from own
