"""Name the other ranks behind an error that names none (a dead peer seen by the backend as a closed socket).

One diagnosis per failure per rank: ``SafeDDPStrategy.on_exception`` and ``HangWatchdog.on_exception`` both ask
:func:`diagnose_failed_peers` (Lightning calls the callback first). The first call reads the peers' positions,
waits for their heartbeats and logs the message; a later call for the same exception returns the same diagnosis
without reading or waiting again.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from .control import ControlPlane
from .errors import DDPStrategyError
from .positions import Position, format_ranks
from .preemption import Preempted

__all__ = ["PeerDiagnosis", "diagnose_failed_peers"]

log = logging.getLogger(__name__)

_MAX_LISTED = 8  # gone ranks listed with their last position; the others are counted
_SURVEYOR_KEY = "diagnosis/surveyor"  # the first rank to diagnose a failure (compare_set): it surveys every rank
_SURVEY_KEY = "diagnosis/survey"  # what it found, read by the other ranks that diagnose


@dataclass(frozen=True)
class PeerDiagnosis:
    """What this rank's peers were doing when it stopped with an error that names none of them.

    Exactly one of ``failed``, ``gone`` and ``store_error`` is set.

    Attributes:
        rank: this rank.
        cause: the first line of this rank's error (``"RuntimeError: ..."``, at most 200 characters).
        failed: peers that had already published a failure: the first failure was theirs.
        gone: peers whose heartbeat did not move during the wait, or that never published a position.
        positions: every rank's position at the last read of the store (empty when it is unreachable).
        seen_at: when that read was (``time.time()``), for the ages in :attr:`message`.
        store_error: why the rendezvous store could not be read (its host, rank 0, is gone).
        world_size: the number of ranks (``0``: not known).
        step: this rank's training step when it stopped (``None``: not training).

    """

    rank: int
    cause: str
    failed: tuple[int, ...] = ()
    gone: tuple[int, ...] = ()
    positions: Mapping[int, Position | None] = field(default_factory=dict, hash=False)
    seen_at: float = 0.0
    store_error: str | None = None
    world_size: int = 0
    step: int | None = None

    @property
    def message(self) -> str:
        """The message for the log, starting ``ddp_strategy: rank R stops after <error>``."""
        head = f"ddp_strategy: rank {self.rank} stops after {self.cause}"
        if self.store_error is not None:
            return (
                f"{head}, and the rendezvous store is unreachable ({self.store_error}): rank 0 (or, under torchrun, "
                "node 0's agent), which hosts it, has most likely died or exited. Look at its output (or its exit "
                "signal) for the cause."
            )
        if self.failed and all(self._failed_alike(r) for r in self.failed):
            everyone = len(self.failed) + 1 == self.world_size
            others = (
                "Every rank failed with this same error"
                if everyone
                else (f"Rank(s) {format_ranks(self.failed)} failed with this same error too")
            )
            at = f" (this rank at step {self.step})" if self.step is not None else ""
            return (
                f"{head}. {others}{at}: each rank hit it by itself, so it is no consequence of another rank's "
                "failure; the cause is in this error."
            )
        if self.failed:
            names = "; ".join(f"rank {r} {self._last_seen(r)}" for r in self.failed)
            return (
                f"{head}. The first failure was on another rank: {names}. Look at that rank's own error for the cause."
            )
        lines = [
            f"{head}. Rank(s) {format_ranks(self.gone)} stopped sending heartbeats: killed (SIGKILL, out-of-memory "
            "killer), crashed without a Python error, or exited early. Last seen:"
        ]
        lines.extend(f"  rank {r}: {self._last_seen(r)}" for r in self.gone[:_MAX_LISTED])
        if len(self.gone) > _MAX_LISTED:
            lines.append(f"  ... and {len(self.gone) - _MAX_LISTED} more")
        return "\n".join(lines)

    def _failed_alike(self, rank: int) -> bool:
        """Whether ``rank`` published a failure with this rank's own error text (type and first line)."""
        position = self.positions.get(rank)
        return position is not None and position.kind == "failed" and position.name[: len(self.cause)] == self.cause

    def _last_seen(self, rank: int) -> str:
        position = self.positions.get(rank)
        return "never published a position" if position is None else position.describe(self.seen_at)

    def __str__(self) -> str:
        return self.message


def _moved(before: Position | None, after: Position | None) -> bool:
    """Whether a rank showed life between two reads of its position (a new heartbeat, or a published failure)."""
    if after is None:
        return False
    return after.kind == "failed" or before is None or after.heartbeat > before.heartbeat


def diagnose_failed_peers(control: ControlPlane, exception: BaseException) -> PeerDiagnosis | None:
    """Which other ranks failed first or are gone, after an error on this rank that names no rank; logged once.

    A backend error for a dead peer (gloo's ``Connection closed by peer [127.0.0.1]:20362``) names an address.
    Peers that published a failure are named at once, also when the store is gone by now (this rank's heartbeat
    thread keeps the first failure it reads: ``control.heartbeat.peer_failure``). Otherwise this rank publishes its
    own failure (so peers waiting for it stop now) and waits up to ``max(1 s, 3 heartbeat intervals)`` for the
    other peers' heartbeats to move; the ones whose heartbeat does not are named as gone. When the store cannot
    be read, its host (rank 0) is named.

    The first call for ``exception`` does this and logs the message at ERROR level; later calls for the same
    exception return the same diagnosis at once (the result is kept on ``control``). Errors of this package
    (:class:`~ddp_strategy.errors.DDPStrategyError`) already name the ranks involved and get no diagnosis.

    Args:
        control: this rank's control plane.
        exception: the error this rank stops with.

    Returns:
        The diagnosis, or ``None`` when every peer is alive (or there are none).

    """
    memo = control.failure_diagnosis
    if memo is not None and memo[0] is exception:
        remembered: PeerDiagnosis | None = memo[1]  # this function's own memo (see ControlPlane.failure_diagnosis)
        return remembered
    diagnosis = (
        None
        if control.world_size < 2 or isinstance(exception, (DDPStrategyError, Preempted))
        else _diagnose(control, exception)
    )
    if diagnosis is not None:
        diagnosis = replace(diagnosis, world_size=control.world_size, step=control.heartbeat.step)
    control.failure_diagnosis = (exception, diagnosis)
    if diagnosis is not None:
        log.error(diagnosis.message)
    return diagnosis


def _diagnose(control: ControlPlane, exception: BaseException) -> PeerDiagnosis | None:
    """The first rank to diagnose surveys every rank and publishes what it found; the others read that (one key).

    Many ranks fail together when one dies (each one's collective returns an error): one survey of ``W`` positions
    instead of ``W`` of them. A rank that finds no survey within the survey's wait (its author died) surveys itself.
    """
    rank = control.rank
    cause = f"{type(exception).__name__}: {exception}".splitlines()[0][:200]
    if control.heartbeat.peer_failure is not None:  # read by the heartbeat thread, maybe before the store went away
        failed_rank, position = control.heartbeat.peer_failure
        return PeerDiagnosis(rank, cause, failed=(failed_rank,), positions={failed_rank: position}, seen_at=time.time())
    try:
        store = control.store
        first_to_ask = store.compare_set(_SURVEYOR_KEY, "", str(rank)).decode() == str(rank)
        if not first_to_ask:
            survey = _await_survey(control)
            if survey is not None:
                if control.heartbeat.position.kind != "failed" and control.heartbeat.interval > 0:
                    control.note_failure(exception)  # peers waiting for this rank stop now, as after a survey
                return _adopt(survey, rank, cause)
        diagnosis = _survey(control, exception, cause)
        if first_to_ask:
            store.set(_SURVEY_KEY, _survey_to_json(diagnosis))
        return diagnosis
    except Exception as err:  # the store is gone with the process that hosts it
        return PeerDiagnosis(rank, cause, store_error=str(err))


def _survey_to_json(diagnosis: PeerDiagnosis | None) -> str:
    if diagnosis is None:
        return json.dumps({"failed": [], "gone": [], "positions": {}, "seen_at": 0.0})
    listed = (diagnosis.failed + diagnosis.gone)[: _MAX_LISTED + 1]
    positions = {str(r): (p.to_json() if (p := diagnosis.positions.get(r)) is not None else None) for r in listed}
    data = {"failed": list(diagnosis.failed), "gone": list(diagnosis.gone), "positions": positions}
    return json.dumps({**data, "seen_at": diagnosis.seen_at, "by": diagnosis.rank})


def _await_survey(control: ControlPlane) -> dict[str, object] | None:
    """The survey another rank publishes, or ``None`` when none comes within the survey's own wait and 2 s."""
    deadline = time.monotonic() + max(1.0, 3 * control.heartbeat.interval) + 2.0
    pause = 0.05 * max(1.0, control.world_size / 64)  # every waiting rank looks: keep the total flat
    while time.monotonic() < deadline:
        if control.store.check([_SURVEY_KEY]):
            return dict(json.loads(control.store.get(_SURVEY_KEY)))
        time.sleep(pause)
    return None


def _adopt(survey: dict[str, object], rank: int, cause: str) -> PeerDiagnosis | None:
    """This rank's diagnosis from another rank's survey (itself left out: it is alive and knows its own error)."""
    by = int(survey.get("by", -1))  # type: ignore[call-overload]
    failed = tuple(r for r in survey["failed"] if r != rank)  # type: ignore[attr-defined]
    gone = tuple(r for r in survey["gone"] if r != rank)  # type: ignore[attr-defined]
    raw = dict(survey["positions"])  # type: ignore[call-overload]
    positions = {int(r): (Position.from_json(p) if p is not None else None) for r, p in raw.items()}
    if not failed and not gone:
        return None
    seen_at = float(survey["seen_at"])  # type: ignore[arg-type]
    if failed:
        return PeerDiagnosis(rank, cause, failed=failed, positions=positions, seen_at=seen_at)
    log.debug("ddp_strategy: rank %d takes rank %d's survey of its peers", rank, by)
    return PeerDiagnosis(rank, cause, gone=gone, positions=positions, seen_at=seen_at)


def _survey(control: ControlPlane, exception: BaseException, cause: str) -> PeerDiagnosis | None:
    """Read every rank's position; wait for the heartbeats of the ranks that published one, at most the bound."""
    rank = control.rank
    try:
        first = control.heartbeat.read_positions(control.store)
        seen_at = time.time()
        failed = tuple(r for r, p in sorted(first.items()) if r != rank and p is not None and p.kind == "failed")
        if failed:
            return PeerDiagnosis(rank, cause, failed=failed, positions=first, seen_at=seen_at)
        latest = first
        pending = {r for r, p in first.items() if r != rank and p is not None}
        if control.heartbeat.interval > 0:
            if control.heartbeat.position.kind != "failed":  # a HangWatchdog asks before the strategy publishes it
                control.note_failure(exception)
            deadline = time.monotonic() + max(1.0, 3 * control.heartbeat.interval)
            while pending and time.monotonic() < deadline:
                time.sleep(min(0.1, control.heartbeat.interval / 2))
                latest = {
                    **latest,
                    **control.heartbeat.read_positions(control.store, sorted(pending)),
                }  # only the ranks not yet seen
                seen_at = time.time()
                pending = {r for r in pending if not _moved(first[r], latest[r])}
        else:  # no heartbeats to watch: only ranks that never published a position are known to be gone
            pending = set()
    except Exception as err:  # the store is gone with the process that hosts it
        return PeerDiagnosis(rank, cause, store_error=str(err))
    gone = tuple(sorted(pending | {r for r, p in first.items() if p is None and r != rank}))
    if not gone:
        return None
    return PeerDiagnosis(rank, cause, gone=gone, positions=latest, seen_at=seen_at)
