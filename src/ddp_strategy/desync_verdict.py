"""The verdict of a desync inquiry: from every rank's report, the error every rank raises (or none).

Each rank reports its newest collective calls, what it waits in and its training progress (:class:`RankReport`).
:func:`find_divergence` computes, the same on every rank, the first collective whose calls differ between ranks, or
that every rank waits but not in the same collective, and names uneven training inputs as such
(:class:`~ddp_strategy.errors.UnevenInputsError`); :func:`stale_waits` tells a rank merely pending in a call another
rank is past. The verdict travels through the store as JSON (:func:`verdict_to_json`, :func:`verdict_from_json`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from .collective_record import CollectiveCall
from .errors import CollectiveMismatchError, UnevenInputsError
from .positions import format_ranks

__all__ = [
    "INCOMPLETE",
    "NO_VERDICT",
    "RankReport",
    "collective_wait",
    "find_divergence",
    "rank_lines",
    "stale_waits",
    "verdict_from_json",
    "verdict_to_json",
]

#: the verdict of an inquiry that found no divergence, and of one that could not complete (a rank never reported)
NO_VERDICT, INCOMPLETE = "none", "incomplete"
_GROUP_NAMES = {"0": "the default process group", "1": "the strategy's control group"}
_FIX = (
    "Every rank must make the same collective calls in the same order. A collective inside a rank-dependent branch "
    "is the usual cause: `self.log(..., sync_dist=True)`, `self.all_gather`, `strategy.broadcast`, `strategy.barrier`, "
    "`torch.distributed` calls or a torchmetrics `compute()` under `if self.trainer.is_global_zero:` (or another "
    "rank test), or a metric logged under a name only some ranks log. Move the call out of the branch; to log from "
    "one rank only, use `self.log(..., rank_zero_only=True)` without `sync_dist`."
)


@dataclass(frozen=True)
class RankReport:
    """What one rank publishes for an inquiry.

    Attributes:
        rank: the rank.
        calls: its newest collective calls, per group at most
            :data:`~ddp_strategy.collective_record.REPORT_CALLS`, oldest first.
        waiting: what its training thread waits in (see :attr:`~ddp_strategy.positions.Position.waiting`).
        waiting_since: since when.
        epoch: the training epoch of its last training batch (``None`` outside training).
        epoch_batch: the batches of that epoch it started.
        barrier_site: the call site of the barrier it waits in, if any.
        step: the optimizer step of its last training batch (``None`` outside training).
        ledger: its newest strategy collectives as ``(count, what)`` (see
            :class:`~ddp_strategy.collective_record.CallLedger`).

    """

    rank: int
    calls: tuple[CollectiveCall, ...]
    waiting: str
    waiting_since: float
    epoch: int | None = None
    epoch_batch: int | None = None
    barrier_site: str = ""
    step: int | None = None
    ledger: tuple[tuple[int, str], ...] = ()

    def to_json(self) -> str:
        """Serialise for the rendezvous store."""
        data = asdict(self)
        data["calls"] = [c.to_dict() for c in self.calls]
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str | bytes) -> RankReport:
        """Inverse of :meth:`to_json`."""
        data = json.loads(text)
        data["calls"] = tuple(CollectiveCall.from_dict(c) for c in data["calls"])
        data["ledger"] = tuple((int(n), str(w)) for n, w in data.get("ledger", ()))
        return cls(**data)

    def pending(self) -> CollectiveCall | None:
        """The collective it waits in, when that is one (not a barrier)."""
        wait = collective_wait(self.waiting)
        return None if wait is None else next((c for c in self.calls if (c.group, c.seq) == wait), None)

    def describe_wait(self) -> str:
        """Where it waits, in words."""
        call = self.pending()
        if call is not None:
            return f"waits in collective #{call.seq} of {_group_name(call.group)}: {call.describe()}"
        if self.waiting.startswith("collective "):
            group, _, seq = self.waiting.split(" ", 1)[1].partition("#")
            return f"waits in collective #{seq} of {_group_name(group)}"
        if self.waiting.startswith("barrier "):
            name = self.waiting.split(" ", 2)[2]
            return f"waits in the strategy's barrier {name}" + (f" at {self.barrier_site}" if self.barrier_site else "")
        return "runs (it waits in no collective)"

    def describe_now(self) -> str:
        """Where it waits, and its training progress."""
        progress = self.describe_progress()
        return self.describe_wait() + (f" ({progress})" if progress else "")

    def describe_progress(self) -> str:
        """``training step 5, epoch 0, 6 batch(es) started`` (empty outside training)."""
        if self.epoch is None:
            return ""
        return f"training step {self.step}, epoch {self.epoch}, {self.epoch_batch} batch(es) started"

    def barrier_name(self) -> str:
        """The name of the strategy's barrier it waits in (``""``: none)."""
        if not self.waiting.startswith("barrier "):
            return ""
        return self.waiting.split(" ", 2)[2].strip("'")


def _group_name(group: str) -> str:
    return _GROUP_NAMES.get(group, f"process group {group}")


def collective_wait(waiting: str) -> tuple[str, int] | None:
    """``(group, seq)`` of a wait ``"collective <group>#<seq>"``; ``None`` for a barrier or no wait."""
    if not waiting.startswith("collective "):
        return None
    group, _, seq = waiting.split(" ", 1)[1].partition("#")
    return (group, int(seq)) if seq.isdigit() else None


def stale_waits(waits: Mapping[int, str], done: Mapping[int, set[tuple[str, int]]] | None = None) -> set[int]:
    """The ranks whose pending collective another rank is past: they are not blocked in it.

    A backend completes the n-th collective of a group on a rank only once every rank has entered its n-th call, so
    a rank pending in call #n of a group while another rank waits in a later call of that group (or has completed
    #n) has its part of #n done: its entry is an asynchronous call not yet waited for, or about to be marked done,
    and the rank itself runs (rank 0 writing a large checkpoint with ``torch.save`` while another rank waits in the
    next collective is slow, not diverged).

    Args:
        waits: each rank's wait (see :attr:`~ddp_strategy.positions.Position.waiting`).
        done: per rank, the ``(group, seq)`` of the collectives it completed, where known.

    """
    pending = {rank: w for rank, wait in waits.items() if (w := collective_wait(wait)) is not None}
    stale = set()
    for rank, (group, seq) in pending.items():
        later = any(g == group and s > seq for other, (g, s) in pending.items() if other != rank)
        completed = done is not None and any((group, seq) in d for other, d in done.items() if other != rank)
        if later or completed:
            stale.add(rank)
    return stale


def rank_lines(lines: Mapping[int, str]) -> list[str]:
    """``  rank 0-2: <text>`` lines, ranks with the same text together, in order of their lowest rank."""
    by_text: dict[str, list[int]] = {}
    for rank, text in sorted(lines.items()):
        by_text.setdefault(text, []).append(rank)
    return [f"  rank {format_ranks(ranks)}: {text}" for text, ranks in by_text.items()]


def _first_mismatch(reports: Mapping[int, RankReport]) -> tuple[str, int, dict[int, CollectiveCall]] | None:
    """The earliest collective (by the time its first caller entered it) whose calls differ between ranks."""
    found: list[tuple[float, str, int, dict[int, CollectiveCall]]] = []
    groups = sorted({c.group for report in reports.values() for c in report.calls})
    for group in groups:
        by_seq: dict[int, dict[int, CollectiveCall]] = {}
        for rank, report in reports.items():
            for call in report.calls:
                if call.group == group:
                    by_seq.setdefault(call.seq, {})[rank] = call
        for seq in sorted(by_seq):
            calls = by_seq[seq]
            if len(calls) > 1 and len({c.key() for c in calls.values()}) > 1:
                found.append((min(c.created for c in calls.values()), group, seq, calls))
                break
    if not found:
        return None
    _, group, seq, calls = min(found, key=lambda item: (item[0], item[1]))
    return group, seq, calls


def _first_ledger_mismatch(reports: Mapping[int, RankReport]) -> tuple[int, dict[int, str]] | None:
    """The first strategy collective (by count) that differs between ranks that both still list it."""
    by_count: dict[int, dict[int, str]] = {}
    for rank, report in reports.items():
        for count, what in report.ledger:
            by_count.setdefault(count, {})[rank] = what
    for count in sorted(by_count):
        texts = by_count[count]
        if len(texts) > 1 and len(set(texts.values())) > 1:
            return count, texts
    return None


def find_divergence(reports: Mapping[int, RankReport]) -> CollectiveMismatchError | None:
    """The error every rank raises for these reports, or ``None`` when they show no divergence.

    Deterministic: every rank computes it from the same reports and gets the same error. A divergence is

    * two ranks whose n-th collective on one process group differs (op, shapes, dtypes, user call site, or what
      made it): the first such collective is named, with each rank's call; or
    * every rank waiting, not all in the same collective: each rank waits for one another never enters.

    When a rank waits in DDP's gradient all-reduce while another has started fewer batches of the epoch (or is
    in another epoch, or waits in no training step), the error is an :class:`~ddp_strategy.errors.UnevenInputsError`.
    """
    if not reports:
        return None
    mismatch = _first_mismatch(reports)
    waits = {rank: report.waiting for rank, report in reports.items()}
    done = {rank: {(c.group, c.seq) for c in report.calls if c.done} for rank, report in reports.items()}
    for rank in stale_waits(waits, done):  # not blocked: another rank is past its pending call
        waits[rank] = ""
    stuck = all(waits.values()) and len(set(waits.values())) > 1
    ledger = _first_ledger_mismatch(reports) if mismatch is None else None
    if mismatch is None and ledger is None and not stuck:
        return None
    lines: list[str] = []
    name = "collective"
    missing: list[int] = [r for r, report in reports.items() if report.pending() is not None]
    barriers = {r: report.barrier_name() for r, report in reports.items() if report.barrier_name()}
    if mismatch is not None:
        group, seq, calls = mismatch
        first = next(iter(calls.values()))
        name = f"collective #{seq} ({first.op})"
        lines.append(
            f"Ranks made different collective calls: call #{seq} of {_group_name(group)} is the first that differs "
            "(each rank's n-th call on a group is paired with every other rank's n-th call, whatever it is):"
        )
        lines.extend(rank_lines({rank: call.describe() for rank, call in calls.items()}))
        absent = sorted(set(reports) - set(calls))
        if absent:
            lines.append(f"  rank {format_ranks(absent)}: had not reached call #{seq} of that group")
    elif ledger is not None:
        count, texts = ledger
        name = f"strategy collective #{count}"
        lines.append(
            f"Ranks made different collective calls through the strategy: call #{count} is the first that differs "
            "(the backend pairs the ranks' calls in order, whatever they are, and mixes their values):"
        )
        lines.extend(rank_lines(texts))
    elif barriers:
        first_rank = min(barriers)
        name = barriers[first_rank]
        inside = sorted(r for r, b in barriers.items() if b == name)
        missing = sorted(set(reports) - set(inside))
        site = reports[first_rank].barrier_site
        lines.append(
            f"Rank(s) {format_ranks(inside)} wait at barrier '{name}'"
            + (f" ({site})" if site else "")
            + f", but rank(s) {format_ranks(missing)} never arrived: they wait elsewhere (below), so no rank can "
            "ever go on."
        )
    else:
        lines.append("Every rank waits, but not in the same collective, so none of them can ever go on:")
    lines.append("Where each rank is now:")
    lines.extend(rank_lines({rank: report.describe_now() for rank, report in reports.items()}))
    uneven = _uneven(reports)
    if uneven is not None:
        lines.append(uneven[0])
        return UnevenInputsError("\n".join(lines), batches=uneven[1])
    lines.append(_FIX)
    return CollectiveMismatchError("\n".join(lines), name=name, missing_ranks=missing, reason="desync")


#: what a rank waits in when it is inside a training batch (Lightning >= 2.5 broadcasts a SIGTERM flag before it
#: fetches each batch, the fetcher had that batch ready already; not while the strategy has SIGTERM: _compat/signals)
_PER_BATCH = ("DDP's gradient all-reduce", "DDP's buffer broadcast", "Lightning's _broadcast_sigterm_tensor")
_BEFORE_BATCH = "Lightning's _broadcast_sigterm_tensor"


def _batches_reached(report: RankReport) -> int:
    """The batches of its epoch a rank has started, counting one it waits to start."""
    call = report.pending()
    ahead = int(call is not None and call.what.startswith(_BEFORE_BATCH))
    return int(report.epoch_batch or 0) + ahead


def _uneven(reports: Mapping[int, RankReport]) -> tuple[str, list[float]] | None:
    """Uneven training inputs: a rank waits inside a training batch of an epoch another rank has run out of.

    Rank ``b`` waits in a per-batch collective (DDP's gradient all-reduce or buffer broadcast, Lightning's
    per-batch broadcast); rank ``o`` does not, and has started fewer batches of that epoch, or is in a later epoch.
    """
    in_batch = [
        r for r, report in reports.items() if (c := report.pending()) is not None and c.what.startswith(_PER_BATCH)
    ]
    reached = {r: _batches_reached(report) for r, report in reports.items()}
    epoch = {r: report.epoch if report.epoch is not None else -1 for r, report in reports.items()}
    ran_out = sorted(
        o
        for o in reports
        if o not in in_batch
        and any(epoch[o] > epoch[b] or (epoch[o] == epoch[b] and reached[o] < reached[b]) for b in in_batch)
    )
    if not ran_out:
        return None
    text = (
        f"Uneven inputs: rank(s) {format_ranks(ran_out)} ran out of training batches while rank(s) "
        f"{format_ranks(in_batch)} still had one, so those wait in a per-batch collective no other rank enters. "
        "Batches started per rank in its epoch: "
        + ", ".join(f"rank {r}: {n} (epoch {epoch[r]})" for r, n in sorted(reached.items()))
        + ". Give every rank the same number of batches: keep Lightning's DistributedSampler "
        "(`use_distributed_sampler=True`), or for an IterableDataset shard it into equal lengths per rank (drop the "
        "remainder); `SafeDDPStrategy(uneven_inputs='raise')` compares the counts before the first step when the "
        "loaders have a length."
    )
    return text, [float(reached[r]) for r in sorted(reached)]


def verdict_to_json(error: CollectiveMismatchError | None) -> str:
    """The verdict as the store keeps it: ``error`` as JSON, or :data:`NO_VERDICT`."""
    if error is None:
        return NO_VERDICT
    data: dict[str, Any] = {"message": str(error), "name": error.name, "missing": list(error.missing_ranks)}
    if isinstance(error, UnevenInputsError):
        data["batches"] = list(error.batches)
    else:
        data["reason"] = error.reason
    return json.dumps(data)


def verdict_from_json(text: str) -> CollectiveMismatchError | None:
    """Inverse of :func:`verdict_to_json`; ``None`` for :data:`NO_VERDICT` and :data:`INCOMPLETE`."""
    if text in (NO_VERDICT, INCOMPLETE):
        return None
    data = json.loads(text)
    if "batches" in data:
        return UnevenInputsError(data["message"], batches=data["batches"])
    return CollectiveMismatchError(
        data["message"], name=data["name"], missing_ranks=data["missing"], reason=data["reason"]
    )
