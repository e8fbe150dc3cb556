r"""The monitored barrier's store protocol: O(1) store operations per rank per barrier, whatever the world size.

Keys of barrier ``seq`` (in the run's namespace of the rendezvous store; ``W`` ranks):

=========================  =====================================================  ==================================
key                        written by                                             read by
=========================  =====================================================  ==================================
``barrier/<seq>/arrived``  every rank, once: ``append("<rank>\t<name>\n")``        the leader's scans; a rank that
                                                                                  found differing names (once)
``barrier/<seq>/name``     the first named rank (``compare_set``); the others     each named rank, once
                           compare with it in the same call
``barrier/<seq>/count``    every rank, once: ``add(1)``; the rank that gets 1 is  nobody else
                           the barrier's *leader*, the one that gets ``W`` is
                           the last
``barrier/<seq>/done``     ``compare_set`` (the first decision wins): the last    every rank: a blocking ``wait``
                           rank (``"ok"``), or whoever aborts it (a JSON          (no polling), then one ``get``
                           :class:`Outcome`: the leader on a failed, passed or
                           missing rank at ``timeout``, a rank that found another
                           name, a failing rank, an agreed desync)
``barrier/<seq>/left``     every rank, once after ``done``: ``add(1)``; the rank  --
                           that gets ``W`` deletes the barrier's keys
``ranks/published``        every rank once per run: ``append("<rank>\n")``      scans: whose ``pos/<rank>`` exists
=========================  =====================================================  ==================================

Per rank and barrier: 6 to 8 operations, whatever ``W`` (the leader's scans, once per ``scan_interval`` while ranks
are missing, read ``arrived`` and the missing ranks' positions in batches of :data:`READ_BATCH`). Waiting costs the
store nothing: a blocked ``wait`` is answered when ``done`` is set.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from .positions import Position
from .store import Store, get_if_set

__all__ = [
    "OK",
    "POSITION_KEY",
    "PUBLISHED_KEY",
    "READ_BATCH",
    "Arrival",
    "Outcome",
    "abort",
    "arrive",
    "arrived",
    "done_key",
    "leave",
    "read_positions_of",
    "scan_interval",
]

POSITION_KEY = "pos/{rank}"
PUBLISHED_KEY = "ranks/published"
OK = "ok"
#: keys per ``multi_get`` of a scan (a few hundred keys is one fast round trip)
READ_BATCH = 256
#: at most this many missing ranks' positions travel in an abort record (the message lists them; the rest by count)
SHOWN_POSITIONS = 16
_UNNAMED = "<unnamed>"


def _key(seq: int, what: str) -> str:
    return f"barrier/{seq}/{what}"


def done_key(seq: int) -> str:
    """The key every rank of barrier ``seq`` waits for."""
    return _key(seq, "done")


def scan_interval(poll_interval: float, world_size: int) -> float:
    """Seconds between two scans of the leader: the heartbeat interval, and 1 s more per 1024 ranks."""
    return max(poll_interval, world_size / 1024)


@dataclass(frozen=True)
class Outcome:
    """How barrier ``seq`` ended, as every rank reads it from ``done``.

    Attributes:
        reason: ``"ok"``, or why it was aborted: ``"failed"`` (a missing rank published a failure), ``"went_on"``
            (a missing rank went past without entering), ``"missing"`` (``timeout``), ``"names"`` (ranks reached
            barriers of different names), ``"desync"`` (the ranks agreed on a collective desync), ``"interrupted"``
            (a rank's wait was interrupted, e.g. Ctrl-C).
        missing: the ranks that had not arrived.
        positions: the last published positions of up to :data:`SHOWN_POSITIONS` of them.
        table: for ``"names"``: which names the arrived ranks reached (``"'save' on rank(s) 0; 'load' on rank(s) 1"``).
        by: the rank that decided.

    """

    reason: str
    missing: tuple[int, ...] = ()
    positions: dict[int, Position | None] = field(default_factory=dict)
    table: str = ""
    by: int = -1

    @property
    def ok(self) -> bool:
        """Whether every rank arrived under compatible names."""
        return self.reason == OK

    def to_json(self) -> str:
        """The value of ``done``."""
        positions = {str(r): (p.to_json() if p is not None else None) for r, p in self.positions.items()}
        return json.dumps(
            {"reason": self.reason, "missing": list(self.missing), "positions": positions, "table": self.table,
             "by": self.by}
        )  # fmt: skip

    @classmethod
    def from_value(cls, value: bytes | str) -> Outcome:
        """Read the value of ``done``."""
        text = value.decode() if isinstance(value, bytes) else value
        if text == OK:
            return cls(OK)
        data = json.loads(text)
        positions = {int(r): (Position.from_json(p) if p is not None else None) for r, p in data["positions"].items()}
        return cls(
            str(data["reason"]), tuple(int(r) for r in data["missing"]), positions, str(data["table"]), int(data["by"])
        )


@dataclass(frozen=True)
class Arrival:
    """What a rank learned on arriving: whether it leads the scans, and the outcome when it decided it itself."""

    leader: bool
    outcome: Outcome | None


def arrive(store: Store, seq: int, rank: int, world_size: int, name: str) -> Arrival:
    """Enter barrier ``seq``: record the arrival, compare the name, count; decide when last or names differ."""
    clean = name.replace("\t", " ").replace("\n", " ")
    store.append(_key(seq, "arrived"), f"{rank}\t{clean}\n")
    if name != _UNNAMED:
        first = store.compare_set(_key(seq, "name"), "", name)
        if first.decode() != name:
            table = _names_table(arrived(store, seq))
            return Arrival(False, abort(store, seq, Outcome("names", table=table, by=rank)))
    count = int(store.add(_key(seq, "count"), 1))
    if count == world_size:
        return Arrival(count == 1, _decide(store, seq, OK))
    return Arrival(count == 1, None)


def abort(store: Store, seq: int, outcome: Outcome) -> Outcome:
    """End barrier ``seq`` with ``outcome`` unless it has ended already; return how it ended."""
    return _decide(store, seq, outcome.to_json())


def _decide(store: Store, seq: int, value: str) -> Outcome:
    return Outcome.from_value(store.compare_set(done_key(seq), "", value))


def leave(store: Store, seq: int, world_size: int) -> None:
    """After reading ``done``: the last rank to leave deletes the barrier's keys."""
    if int(store.add(_key(seq, "left"), 1)) == world_size:
        for what in ("arrived", "name", "count", "done", "left"):
            store.delete_key(_key(seq, what))


def arrived(store: Store, seq: int) -> dict[int, str]:
    """Rank -> barrier name of every rank that has arrived at ``seq`` (one read)."""
    value = get_if_set(store, _key(seq, "arrived"))
    if value is None:
        return {}
    entries = (line.split("\t", 1) for line in value.decode().splitlines() if "\t" in line)
    return {int(rank): name for rank, name in entries}


def _names_table(names: dict[int, str]) -> str:
    from .positions import format_ranks

    by_name: dict[str, list[int]] = {}
    for rank, name in sorted(names.items()):
        by_name.setdefault(name, []).append(rank)
    return "; ".join(f"'{n}' on rank(s) {format_ranks(r)}" for n, r in by_name.items())


def read_positions_of(store: Store, ranks: Sequence[int]) -> dict[int, Position | None]:
    """The last published positions of ``ranks`` (``None``: never published), in batches of :data:`READ_BATCH`."""
    published = _published(store)
    positions: dict[int, Position | None] = {rank: None for rank in ranks}
    present = [rank for rank in ranks if rank in published]
    for start in range(0, len(present), READ_BATCH):
        chunk = present[start : start + READ_BATCH]
        values = store.multi_get([POSITION_KEY.format(rank=rank) for rank in chunk])
        positions.update({rank: Position.from_json(value) for rank, value in zip(chunk, values, strict=True)})
    return positions


def _published(store: Store) -> set[int]:
    value = get_if_set(store, PUBLISHED_KEY)
    return set() if value is None else {int(line) for line in value.decode().split()}
