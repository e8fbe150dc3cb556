"""Collective desync detection: ranks that diverge in their collective calls get one named error, within seconds.

DDP is correct only when every rank makes the same collective calls in the same order. torch's Flight Recorder
(:func:`~ddp_strategy._compat.torch.collective_trace`) numbers every collective of every process group per rank
and keeps its op, tensor sizes and Python stack, for gloo as for NCCL. The strategy turns it on, and
:class:`DesyncMonitor`, on each rank's heartbeat thread, uses it in two steps:

1. **Watch, cheaply.** Each beat reads the recorder's per-group counters (tens of microseconds, no stacks) and
   the training thread's control-plane barrier. A rank whose training thread waits, unchanged, in a collective
   or a barrier for :data:`STUCK_AFTER` seconds is *stuck*; it publishes that with its position and counts itself
   in one store counter. When the counter reaches the world size every rank is stuck: unless all wait in the same
   collective (the verdict tells), no rank can ever go on. A rank merely slow (rank 0 writing a large checkpoint
   while the others wait in the next collective) is not stuck, so nothing happens: that stays the hang timeout's
   business.
2. **Inquire, once.** The rank opens an *inquiry* in the rendezvous store; every rank publishes a
   :class:`RankReport` (its last collectives with their op, shapes, dtypes and innermost user frame, what it
   waits in, its epoch and batch); the rank whose report completes the count reads them all (batched), computes
   the verdict with :func:`find_divergence` and publishes it once: every rank reaches the same
   :class:`~ddp_strategy.errors.CollectiveMismatchError` (or :class:`~ddp_strategy.errors.UnevenInputsError`).
   The first collective whose calls differ between ranks is named even when the backend paired the calls (gloo
   pairs calls by order), then where each rank waits now.

A rank whose training thread waits in a control-plane barrier raises the error there. A rank blocked inside a
backend collective cannot be interrupted from Python; the lowest such rank prints the error and exits
(``os._exit``), which closes its connections, so that the collectives of the others return with a backend error,
which the strategy's launcher replaces by the agreed error (see ``SafeDDPStrategy``).
"""

from __future__ import annotations

import array
import functools
import json
import logging
import os
import sys
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ._compat.lightning import current_hook_name
from ._compat.torch import collective_status, collective_trace
from .control import ControlPlane, Store
from .errors import CollectiveMismatchError, UnevenInputsError
from .positions import call_site, format_ranks, is_user_path, short_path

__all__ = [
    "AUDIT_INTERVAL",
    "STUCK_AFTER",
    "TRACE_ENTRIES",
    "CallAudit",
    "CallLedger",
    "CallNotes",
    "CollectiveCall",
    "DesyncMonitor",
    "LogSites",
    "RankReport",
    "calls_from_trace",
    "check_gather_shapes",
    "collective_wait",
    "find_divergence",
    "stale_waits",
]

log = logging.getLogger(__name__)

#: Seconds a rank must wait, unchanged, in one collective or barrier before it counts as stuck.
STUCK_AFTER = 2.0
#: Collectives the Flight Recorder keeps (its ring buffer), unless the user set ``TORCH_FR_BUFFER_SIZE``.
TRACE_ENTRIES = 256
#: Collectives per process group a rank puts in its report (the newest).
REPORT_CALLS = TRACE_ENTRIES
#: Seconds between two audits of a rank's recorded collectives (see :class:`CallAudit`), while it makes any.
AUDIT_INTERVAL = 5.0
_INQUIRY_KEY = "desync/inquiry"  # the number of the newest inquiry (opened with compare_set: one opener wins)
_STUCK_KEY = "desync/stuck"  # how many ranks are stuck right now (each adds 1 when it gets stuck, -1 when it runs)
_RANK0_STOPPING_KEY = "desync/rank0-stopping"  # rank 0 has printed the agreed error (it may exit any moment now)
_REPORT_KEY = "desync/report/{inquiry}/{rank}"
_REPORTED_KEY = "desync/reported/{inquiry}"  # how many ranks reported; the one that makes it W decides
_VERDICT_KEY = "desync/verdict/{inquiry}"  # the decision, written once (compare_set), read by every rank
_READ_KEY = "desync/read/{inquiry}"  # how many ranks have read the verdict; the last deletes it
_HOLDING_KEY = "desync/holding"  # how many ranks hold the agreed error (rank 0 hosts the store: it waits for W)
_AUDIT_KEY = "desync/audit/{rank}"
_NO_VERDICT, _INCOMPLETE = "none", "incomplete"
_REPORTS_PER_READ = 16  # reports of about 150 KB: one batched read of 16 is a few MB
_VERDICT_WAIT = 6.0  # seconds rank 0, before it exits, waits for the others to hold the verdict (the store is its)
_REPORT_WAIT = 6.0  # seconds an inquiry waits for every rank's report
_BREAK_AFTER = 1.0  # seconds after the verdict before the highest blocked rank exits; then 0.5 s per rank below
_EXIT_CODE = 1
_DEFAULT_GROUP = "0"
_GROUP_NAMES = {"0": "the default process group", "1": "the strategy's control group"}
_FIX = (
    "Every rank must make the same collective calls in the same order. A collective inside a rank-dependent branch "
    "is the usual cause: `self.log(..., sync_dist=True)`, `self.all_gather`, `strategy.broadcast`, `strategy.barrier`, "
    "`torch.distributed` calls or a torchmetrics `compute()` under `if self.trainer.is_global_zero:` (or another "
    "rank test), or a metric logged under a name only some ranks log. Move the call out of the branch; to log from "
    "one rank only, use `self.log(..., rank_zero_only=True)` without `sync_dist`."
)


@dataclass(frozen=True)
class CollectiveCall:
    """One collective call of one rank, as the Flight Recorder saw it.

    Attributes:
        group: the process group's id (``"0"``: the default group, ``"1"``: the strategy's control group).
        seq: the call's number on that group (1 for the first); the n-th calls of every rank are paired.
        op: the operation, e.g. ``"all_reduce"``.
        shapes: the input tensors' shapes.
        dtypes: the input tensors' dtypes (torch's names: ``"Float"``, ``"Long"``).
        site: the innermost frame of user code that led to the call, ``"model.py:34 in on_train_epoch_end"``.
        what: what made the call, where known: ``"self.log('x', sync_dist=True)"``, ``"DDP's gradient
            all-reduce (backward)"``, a Lightning or torchmetrics function.
        done: whether it completed on this rank.
        created: when the rank entered it (``time.time()``).

    """

    group: str
    seq: int
    op: str
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    site: str = ""
    what: str = ""
    done: bool = True
    created: float = 0.0

    def key(self) -> tuple[Any, ...]:
        """What must be equal on every rank for the calls to be the same collective."""
        return (self.op, self.shapes, self.dtypes, self.site, self.what)

    def describe(self) -> str:
        """``all_reduce of Float[] from self.log('x', sync_dist=True) at model.py:34 in on_train_epoch_end``."""
        tensors = ", ".join(f"{d}{list(s)}" for d, s in zip(self.dtypes, self.shapes, strict=False)) or "no tensor"
        text = f"{self.op} of {tensors}"
        if self.what:
            text += f" from {self.what}"
        if self.site:
            text += f" at {self.site}"
        return text

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CollectiveCall:
        """Inverse of :meth:`to_dict`."""
        values = dict(data)
        values["shapes"] = tuple(tuple(int(n) for n in shape) for shape in values["shapes"])
        values["dtypes"] = tuple(values["dtypes"])
        return cls(**values)


class CallNotes:
    """What made recent collectives, noted by the strategy around its own collectives (``self.log`` syncs).

    The strategy calls :meth:`begin` before a collective it runs and :meth:`end` after it; a Flight Recorder entry
    created in between (``time.time_ns()``) gets the note's text as its :attr:`CollectiveCall.what`. A collective
    that never returns keeps an open note. Bounded; no I/O.
    """

    def __init__(self, size: int = 512) -> None:
        self._notes: deque[list[Any]] = deque(maxlen=size)

    def begin(self, text: str) -> list[Any]:
        """Open a note for the collectives that follow; pass the result to :meth:`end`."""
        note = [time.time_ns(), None, text]
        self._notes.append(note)
        return note

    @staticmethod
    def end(note: list[Any]) -> None:
        """Close ``note``: later collectives are not part of it."""
        note[1] = time.time_ns()

    def lookup(self, created_ns: int) -> str:
        """The text of the note whose interval holds ``created_ns``, else ``""``."""
        for start, end, text in reversed(list(self._notes)):
            if start <= created_ns and (end is None or created_ns <= end):
                return str(text)
            if end is not None and end < created_ns:
                break
        return ""


class CallLedger:
    """A running count and CRC-32 digest of the strategy's own collectives, for a cheap comparison across ranks.

    The backend pairs the n-th calls of the ranks whatever they are: two ranks that log different names with
    ``sync_dist=True`` (Lightning #19106) never wait, and mix their values silently. Each call adds what it was
    (``reduce on_train_epoch_end.x Float[]``) to the digest (one ``zlib.crc32`` of a short string, no I/O); the
    heartbeat publishes ``(count, digest)``, and each rank compares a peer's with its own digest at the same count.
    """

    def __init__(self, keep: int = 4096, texts: int = REPORT_CALLS) -> None:
        #: ``(count, digest)``, replaced as one tuple so that another thread never reads a torn pair
        self.state: tuple[int, int] = (0, 0)
        self._history: dict[int, int] = {}
        self._keep = keep
        self.texts: deque[tuple[int, str]] = deque(maxlen=texts)

    def add(self, what: str) -> None:
        """Record one collective."""
        count, digest = self.state
        count, digest = count + 1, zlib.crc32(what.encode(), digest)
        self._history[count] = digest
        self._history.pop(count - self._keep, None)
        self.texts.append((count, what))
        self.state = (count, digest)

    def digest_at(self, count: int) -> int | None:
        """The digest after ``count`` calls, if still kept (``0`` for none)."""
        return 0 if count == 0 else self._history.get(count)


class LogSites:
    """Where the module called ``self.log(..., sync_dist=True)``, per hook and name, for the collectives they make.

    Lightning syncs a value logged in an epoch-end hook later, from its own code, so the user's line is no longer
    on the stack when the collective runs. :meth:`install` wraps the module's ``log`` (an instance attribute,
    removed by :meth:`uninstall`) to record the line the first time each ``(hook, name)`` is logged with
    ``sync_dist=True``.
    """

    def __init__(self) -> None:
        self.sites: dict[tuple[str, str], str] = {}
        self._module: Any = None

    def install(self, module: Any) -> None:
        """Start recording the ``self.log(..., sync_dist=True)`` lines of ``module``."""
        self.uninstall()
        original = module.log
        sites = self.sites

        def log_recording_site(name: str, value: Any, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("sync_dist"):
                key = (current_hook_name(module), name)
                if key not in sites:
                    sites[key] = call_site(skip=2)
            return original(name, value, *args, **kwargs)

        module.log = log_recording_site
        self._module = module

    def uninstall(self) -> None:
        """Give the module its own ``log`` back."""
        if self._module is not None:
            self._module.__dict__.pop("log", None)
            self._module = None

    def describe(self, fx: str, name: str) -> str:
        """``self.log('x', sync_dist=True) in on_train_epoch_end at model.py:34 in on_train_epoch_end``."""
        text = f"self.log({name!r}, sync_dist=True) in {fx}"
        site = self.sites.get((fx, name))
        return f"{text} (called at {site})" if site else text


class CallAudit:
    """Per-call digests of one rank's recorded collectives, for the ranks to compare while they run.

    gloo pairs the n-th calls of the ranks on a group whatever they are: two ranks that all-reduce different
    tensors of one shape at different lines (a rank-dependent branch with a collective on each side) never wait,
    and mix their values silently. Every :data:`AUDIT_INTERVAL` seconds the heartbeat thread adds the recorder's new
    calls (:meth:`add`: a CRC-32 of each call's op, shapes, dtypes, user call site and what made it), publishes the
    newest digests of each group (:meth:`publication`, a few kilobytes) and compares the next rank's publication
    with its own (:meth:`first_difference`); the strategy compares every rank's once more at each stage's end.
    A difference opens an inquiry, whose verdict names both calls.
    """

    def __init__(self, keep: int = 4 * TRACE_ENTRIES) -> None:
        self._digests: dict[str, dict[int, int]] = {}
        self._keep = keep
        #: per group, the newest sequence number added
        self.newest: dict[str, int] = {}

    def add(self, calls: Sequence[CollectiveCall]) -> None:
        """Add the calls newer than those added before (recorder order: oldest first)."""
        for call in calls:
            if call.seq <= self.newest.get(call.group, 0):
                continue
            digests = self._digests.setdefault(call.group, {})
            digests[call.seq] = zlib.crc32(repr(call.key()).encode()) or 1  # 0 means "not known"
            digests.pop(call.seq - self._keep, None)
            self.newest[call.group] = call.seq

    def publication(self, most: int = TRACE_ENTRIES) -> dict[str, list[Any]]:
        """Per group ``[first seq, digests as hex]``: the newest ``most`` calls (an unknown call's digest is 0)."""
        published: dict[str, list[Any]] = {}
        for group, digests in self._digests.items():
            last = self.newest[group]
            first = max(min(digests), last - most + 1)
            values = array.array("I", (digests.get(seq, 0) for seq in range(first, last + 1)))
            published[group] = [first, values.tobytes().hex()]
        return published

    def first_difference(self, other: Mapping[str, Sequence[Any]]) -> tuple[str, int] | None:
        """The first ``(group, seq)`` whose digest differs between this rank's calls and ``other``'s publication."""
        return first_published_difference([self.publication(), other])


def _published_digests(publication: Mapping[str, Sequence[Any]], group: str) -> dict[int, int]:
    if group not in publication:
        return {}
    first, data = publication[group]
    values = array.array("I")
    values.frombytes(bytes.fromhex(str(data)))
    return {int(first) + i: value for i, value in enumerate(values) if value}


def first_published_difference(publications: Sequence[Mapping[str, Sequence[Any]]]) -> tuple[str, int] | None:
    """The first ``(group, seq)`` (lowest group id, then seq) to which ranks' publications give different digests.

    Args:
        publications: every rank's :meth:`CallAudit.publication`; a call only some ranks published is not compared.

    """
    groups = sorted({group for publication in publications for group in publication})
    for group in groups:
        tables = [_published_digests(publication, group) for publication in publications]
        for seq in sorted(set().union(*tables)):
            values = {table[seq] for table in tables if seq in table}
            if len(values) > 1:
                return group, seq
    return None


@functools.lru_cache(maxsize=4096)
def _user_file(path: str) -> bool:
    return is_user_path(path)


@functools.lru_cache(maxsize=4096)
def _site_text(path: str, line: int, name: str) -> str:
    return f"{short_path(path)}:{line} in {name}"


@functools.lru_cache(maxsize=1024)
def _what(inner: tuple[tuple[str, str], ...]) -> str:
    """What made a call, from the ``(file, function)`` of its frames inside the innermost user frame (innermost first).

    Only those frames count: a library the user's code called made the call; the library that called the user's
    code (Lightning calling a hook) did not. For the calls the strategy did not note.
    """
    names = [(path.replace(os.sep, "/"), name) for path, name in inner]
    for path, name in names:
        if name == "_engine_run_backward" or path.endswith("torch/autograd/graph.py"):
            return "DDP's gradient all-reduce (backward)"
        if name in ("_sync_buffers", "_sync_module_buffers") and path.endswith("torch/nn/parallel/distributed.py"):
            return "DDP's buffer broadcast (forward)"
        if name in ("_verify_param_shape_across_processes", "_sync_module_states"):
            return "DDP's wrapper construction"
        if path.endswith("ddp_strategy/object_collectives.py"):
            return "ddp_strategy's control plane"
    for path, name in names:
        if "/torchmetrics/" in path:
            return f"torchmetrics {name}"
        if "/lightning/" in path or "/pytorch_lightning/" in path or "/lightning_fabric/" in path:
            return f"Lightning's {name} ({short_path(path)})"
    return ""


def _site_and_what(frames: Sequence[Mapping[str, Any]]) -> tuple[str, str]:
    """The innermost user frame of a stack (innermost first) as ``file:line in function``, and what made the call.

    Called for every recorded collective an audit reads: the per-file and per-path answers are cached.
    """
    inner: list[tuple[str, str]] = []
    for frame in frames:
        path = str(frame.get("filename") or "")
        if _user_file(path):
            site = _site_text(path, int(frame.get("line") or 0), str(frame.get("name") or "?"))
            return site, _what(tuple(inner))
        inner.append((path, str(frame.get("name") or "")))
    return "", _what(tuple(inner))


def calls_from_trace(entries: Sequence[Mapping[str, Any]], notes: CallNotes | None = None) -> list[CollectiveCall]:
    """The Flight Recorder's entries (:func:`~ddp_strategy._compat.torch.collective_trace`) as calls, oldest first."""
    calls = []
    for entry in entries:
        if entry.get("is_p2p"):
            continue
        site, what_frames = _site_and_what(entry.get("frames") or ())
        created_ns = int(entry.get("time_created_ns") or 0)
        what = notes.lookup(created_ns) if notes is not None else ""
        op = str(entry.get("profiling_name", "?")).split(":", 1)[-1]
        calls.append(
            CollectiveCall(
                group=str(entry.get("pg_id", "?")),
                seq=int(entry.get("collective_seq_id", 0)),
                op=op,
                shapes=tuple(tuple(int(n) for n in shape) for shape in entry.get("input_sizes") or ()),
                dtypes=tuple(str(d) for d in entry.get("input_dtypes") or ()),
                site=site,
                what=what or what_frames,
                done=bool(entry.get("retired")),
                created=created_ns / 1e9,
            )
        )
    return calls


@dataclass(frozen=True)
class RankReport:
    """What one rank publishes for an inquiry.

    Attributes:
        rank: the rank.
        calls: its newest collective calls, per group at most :data:`REPORT_CALLS`, oldest first.
        waiting: what its training thread waits in (see :attr:`~ddp_strategy.positions.Position.waiting`).
        waiting_since: since when.
        epoch: the training epoch of its last training batch (``None`` outside training).
        epoch_batch: the batches of that epoch it started.
        barrier_site: the call site of the barrier it waits in, if any.
        step: the optimizer step of its last training batch (``None`` outside training).
        ledger: its newest strategy collectives as ``(count, what)`` (see :class:`CallLedger`).

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


def _grouped(lines: Mapping[int, str]) -> list[str]:
    """``rank 0-2: <text>`` lines, ranks with the same text together, in order of their lowest rank."""
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
        lines.extend(_grouped({rank: call.describe() for rank, call in calls.items()}))
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
        lines.extend(_grouped(texts))
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
    lines.extend(_grouped({rank: report.describe_now() for rank, report in reports.items()}))
    uneven = _uneven(reports)
    if uneven is not None:
        lines.append(uneven[0])
        return UnevenInputsError("\n".join(lines), batches=uneven[1])
    lines.append(_FIX)
    return CollectiveMismatchError("\n".join(lines), name=name, missing_ranks=missing, reason="desync")


#: what a rank waits in when it is inside a training batch (Lightning >= 2.5 broadcasts a SIGTERM flag before it
#: fetches each batch; the fetcher had that batch ready already)
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


_TORCH_DIR = f"{os.sep}torch{os.sep}"


def _training_thread_in_torch() -> bool:
    """Whether the main thread's innermost Python frame is torch's own code (where it blocks in a collective)."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    return frame is not None and _TORCH_DIR in frame.f_code.co_filename


def _poll_pause(world_size: int) -> float:
    """Seconds between two looks at one key by every rank: 50 ms up to 64 ranks, then longer in proportion.

    All ranks together then look about 1300 times a second, whatever their number.
    """
    return 0.05 * max(1.0, world_size / 64)


def _open(store: Store, seen: int) -> int:
    """Open inquiry ``seen + 1`` unless a rank has opened a newer one (compare-and-set: one opener for many)."""
    return int(store.compare_set(_INQUIRY_KEY, str(seen), str(seen + 1)))


def _decide(store: Store, inquiry: int, world_size: int) -> None:
    """Read every rank's report of ``inquiry`` (batched), write the verdict once, delete the reports."""
    keys = [_REPORT_KEY.format(inquiry=inquiry, rank=r) for r in range(world_size)]
    reports: dict[int, RankReport] = {}
    for start in range(0, world_size, _REPORTS_PER_READ):
        values = store.multi_get(keys[start : start + _REPORTS_PER_READ])
        reports.update({start + i: RankReport.from_json(value) for i, value in enumerate(values)})
    store.compare_set(_VERDICT_KEY.format(inquiry=inquiry), "", _verdict_to_json(find_divergence(reports)))
    for key in [*keys, _REPORTED_KEY.format(inquiry=inquiry)]:
        store.delete_key(key)


def _verdict_to_json(error: CollectiveMismatchError | None) -> str:
    if error is None:
        return _NO_VERDICT
    data: dict[str, Any] = {"message": str(error), "name": error.name, "missing": list(error.missing_ranks)}
    if isinstance(error, UnevenInputsError):
        data["batches"] = list(error.batches)
    else:
        data["reason"] = error.reason
    return json.dumps(data)


def _verdict_from_json(text: str) -> CollectiveMismatchError | None:
    if text in (_NO_VERDICT, _INCOMPLETE):
        return None
    data = json.loads(text)
    if "batches" in data:
        return UnevenInputsError(data["message"], batches=data["batches"])
    return CollectiveMismatchError(
        data["message"], name=data["name"], missing_ranks=data["missing"], reason=data["reason"]
    )


def _holding(store: Store) -> set[int]:
    """The ranks that hold the agreed error (one key)."""
    if not store.check([_HOLDING_KEY]):
        return set()
    return {int(line) for line in store.get(_HOLDING_KEY).decode().split()}


class DesyncMonitor:
    """Watches one rank's collectives on its heartbeat thread and takes part in inquiries; see the module docs.

    Args:
        control: this rank's control plane (its heartbeat thread runs :meth:`beat`).
        notes: what made the strategy's own collectives.
        progress: ``(epoch, batches fetched in it)`` while training, else ``None`` (read by the heartbeat thread);
            without it, the epoch and batches started that the strategy noted with each training step.
        ledger: the count and digest of the strategy's own collectives, compared with the next rank's each beat.
        stuck_after: seconds of an unchanged wait before this rank counts as stuck.
        audit_interval: seconds between two audits of the recorded collectives (:class:`CallAudit`).

    """

    def __init__(
        self,
        control: ControlPlane,
        notes: CallNotes,
        *,
        progress: Callable[[], tuple[int, int] | None] | None = None,
        ledger: CallLedger | None = None,
        stuck_after: float = STUCK_AFTER,
        audit_interval: float = AUDIT_INTERVAL,
    ) -> None:
        self.control = control
        self.notes = notes
        self.progress = progress
        self.ledger = ledger if ledger is not None else CallLedger()
        self._ledger_inquired = False
        self.stuck_after = stuck_after
        self.audit = CallAudit()
        self.audit_interval = audit_interval
        self._next_audit = time.monotonic() + audit_interval
        self._next_look = 0.0  # the next look at the next rank's ledger and audit (once per heartbeat interval)
        self._audited_status: dict[str, tuple[int, int]] = {}
        self._audit_inquired: set[tuple[str, int]] = set()
        self._audit_lock = threading.Lock()
        self._wait: tuple[str, float] = ("", 0.0)
        self._answered = 0  # the last inquiry this rank answered
        self._counted_stuck = False  # whether this rank counts itself in the store's count of stuck ranks
        self._inquired: set[str] = set()  # the stuck states this rank opened an inquiry for
        self._verdict_at: float | None = None
        self._shown = False  # this rank printed the agreed error already
        self._lock = threading.Lock()
        control.forget_at_close(_AUDIT_KEY.format(rank=control.rank))
        control.forget_at_close(_INQUIRY_KEY, _STUCK_KEY, _HOLDING_KEY, _RANK0_STOPPING_KEY, shared=True)
        for counter in (_INQUIRY_KEY, _STUCK_KEY):  # both exist from now on: a beat reads them in one round trip
            control.store.add(counter, 0)
        control.add_beat(self.beat)

    # ------------------------------------------------------------------ watching
    def _current_wait(self) -> tuple[str, float]:
        now = time.time()
        barrier = self.control.in_barrier
        if barrier is not None:
            return barrier
        pending = [(group, enq) for group, (enq, done) in sorted(collective_status().items()) if enq > done]
        # a pending collective counts only while the training thread is inside torch's code (a collective's wait,
        # backward, DDP's forward): an asynchronous one stays pending while the thread runs the user's code
        what = f"collective {pending[0][0]}#{pending[0][1]}" if pending and _training_thread_in_torch() else ""
        if what and what == self._wait[0]:
            return self._wait
        return (what, now) if what else ("", 0.0)

    def beat(self, store: Store) -> None:
        """One heartbeat: update this rank's wait, answer an inquiry, open one when every rank is stuck."""
        control = self.control
        self._wait = self._current_wait()
        what, since = self._wait
        stuck = bool(what) and time.time() - since >= self.stuck_after
        control.set_waiting(what if stuck else "", since if stuck else 0.0)
        control.fast_beat = bool(what) and time.time() - since >= self.stuck_after / 2  # answer inquiries quickly
        if control.desync_error is not None:
            self._break_if_blocked(store)
            return
        control.set_ledger(*self.ledger.state)
        if stuck != self._counted_stuck:  # every rank counts itself in while stuck: "all stuck" is one counter
            store.add(_STUCK_KEY, 1 if stuck else -1)
            self._counted_stuck = stuck
        inquiry, stuck_ranks = (int(value) for value in store.multi_get([_INQUIRY_KEY, _STUCK_KEY]))
        if inquiry > self._answered:
            self._answer(store, inquiry)
            return
        if stuck and what not in self._inquired and stuck_ranks >= control.world_size:
            self._inquired.add(what)  # every rank waits: whether they wait for each other, the reports tell
            self._answer(store, _open(store, inquiry))
            return
        now = time.monotonic()
        if now < self._next_look:  # a fast beat watches for inquiries only: the looks at a peer keep their pace
            return
        self._next_look = now + control.heartbeat_interval
        if not self._ledger_inquired and self._ledger_differs(store):
            self._ledger_inquired = True  # once: the verdict names it, or the calls are too old to be named
            self._answer(store, _open(store, inquiry))
            return
        if time.monotonic() >= self._next_audit:
            difference = self._audit(store)
            self._next_audit = time.monotonic() + self.audit_interval
            if difference is not None and difference not in self._audit_inquired:
                self._audit_inquired.add(difference)  # once per call: the verdict names it
                self._answer(store, _open(store, inquiry))

    # ------------------------------------------------------------------ auditing
    def update_audit(self) -> dict[str, list[Any]]:
        """Add the recorder's new calls to :attr:`audit` (one dump with stacks) and return its publication."""
        with self._audit_lock:
            status = collective_status()
            if status != self._audited_status:
                self._audited_status = status
                newest = self.audit.newest
                entries = [
                    e
                    for e in collective_trace()
                    if int(e.get("collective_seq_id") or 0) > newest.get(str(e.get("pg_id", "?")), 0)
                ]
                # no notes: what a call was must come from its own stack, the same on every rank at any time
                self.audit.add(calls_from_trace(entries))
            return self.audit.publication()

    def _audit(self, store: Store) -> tuple[str, int] | None:
        """Publish this rank's digests; the first call whose digest differs from the next rank's, if any."""
        control = self.control
        before = dict(self.audit.newest)
        publication = self.update_audit()
        if self.audit.newest != before:
            store.set(_AUDIT_KEY.format(rank=control.rank), json.dumps(publication))
        peer = _AUDIT_KEY.format(rank=(control.rank + 1) % control.world_size)
        if not store.check([peer]):
            return None
        return self.audit.first_difference(json.loads(store.get(peer)))

    def _ledger_differs(self, store: Store) -> bool:
        """Whether the next rank's strategy collectives differ from this rank's at the count it reached."""
        peer = (self.control.rank + 1) % self.control.world_size
        position = self.control.read_position(peer, store)
        if position is None or position.calls == 0 or position.calls > self.ledger.state[0]:
            return False
        mine = self.ledger.digest_at(position.calls)
        return mine is not None and mine != position.digest

    # ------------------------------------------------------------------ inquiring
    def report(self) -> RankReport:
        """This rank's report: its newest calls (with stacks: costly), its wait, its progress."""
        calls = calls_from_trace(collective_trace(), self.notes)
        newest: list[CollectiveCall] = []
        for group in sorted({c.group for c in calls}):
            newest.extend([c for c in calls if c.group == group][-REPORT_CALLS:])
        what, since = self._current_wait()
        epoch, epoch_batch = self.control.progress
        if self.progress is not None:
            now = self.progress()
            epoch, epoch_batch = now if now is not None else (None, None)
        step = self.control.step
        barrier_site = self.control.position.site if what.startswith("barrier ") else ""
        return RankReport(
            rank=self.control.rank,
            calls=tuple(newest),
            waiting=what,
            waiting_since=since,
            epoch=epoch,
            epoch_batch=epoch_batch,
            barrier_site=barrier_site,
            step=step,
            ledger=tuple(self.ledger.texts),
        )

    def _answer(self, store: Store, inquiry: int) -> CollectiveMismatchError | None:
        """Report for the newest inquiry and return its verdict, the same on every rank.

        Each rank publishes its report and counts itself in; the rank that completes the count reads every report
        (batched reads) and writes the verdict once, which every rank reads (one key, polled at a pace that keeps
        the store's total load flat as ranks are added). Two ranks may open inquiries at once; every rank follows the
        newest one (it reports again). When a rank publishes a failure, or reports do not come within
        ``_REPORT_WAIT`` seconds, the first rank to see it decides "incomplete" for every rank.
        """
        with self._lock:
            if inquiry <= self._answered:
                return self.control.desync_error
            world, rank = self.control.world_size, self.control.rank
            report = self.report()
            mine = report.to_json()
            deadline = time.monotonic() + _REPORT_WAIT
            own_failure = int(self.control.position.kind == "failed")
            while True:
                inquiry = max(inquiry, int(store.add(_INQUIRY_KEY, 0)))
                if inquiry > self._answered:
                    store.set(_REPORT_KEY.format(inquiry=inquiry, rank=rank), mine)
                    self._answered = inquiry
                    if int(store.add(_REPORTED_KEY.format(inquiry=inquiry), 1)) == world:
                        _decide(store, inquiry, world)  # the last to report decides for every rank
                key = _VERDICT_KEY.format(inquiry=inquiry)
                if store.check([key]):
                    break
                if time.monotonic() > deadline or self.control.failures_published(store) > own_failure:
                    store.compare_set(key, "", _INCOMPLETE)  # a rank that failed or went silent never reports
                    break
                time.sleep(_poll_pause(world))
            text = store.get(key).decode()
            error = _verdict_from_json(text)
            if text == _NO_VERDICT and report.waiting:
                self._inquired.add(report.waiting)  # every rank reported: while this wait lasts, none is to be found
            read = _READ_KEY.format(inquiry=inquiry)
            if int(store.add(read, 1)) == world:  # the last rank to read the verdict deletes it
                store.delete_key(key)
                store.delete_key(read)
            if error is None:
                log.info(
                    "ddp_strategy: rank %d: desync inquiry %d found no divergence or was incomplete", rank, inquiry
                )
                return None
            if self.control.desync_error is None:
                self.control.desync_error = error
                self._verdict_at = time.monotonic()
                store.append(_HOLDING_KEY, f"{rank}\n")  # rank 0 hosts the store: it waits for every rank's
                if self._current_wait()[0].startswith("collective "):
                    # blocked inside the backend: it may be killed (a launcher stopping the job when another rank
                    # exits) before it can raise, so it shows the error now
                    self._show(error)
            return error

    def _show(self, error: CollectiveMismatchError) -> None:
        if not self._shown:
            self._shown = True
            rank = self.control.rank
            text = "\n".join(f"[rank{rank}]: {line}" for line in str(error).splitlines())
            sys.stderr.write(
                f"[rank{rank}]: ddp_strategy.errors.{type(error).__name__}: {text[len(f'[rank{rank}]: ') :]}\n"
            )
            sys.stderr.flush()

    def _a_silent_rank_among(self, store: Store, ranks: Sequence[int]) -> bool:
        """Whether one of ``ranks`` failed or stopped its heartbeat: it never will do what is awaited of it."""
        if not ranks:
            return False
        positions = self.control.read_positions_of(ranks, store)
        now = time.time()
        stale = max(2.0, 4 * self.control.heartbeat_interval)
        return any(p is None or p.kind == "failed" or now - p.heartbeat > stale for p in positions.values())

    def inquire(self) -> CollectiveMismatchError | None:
        """Open an inquiry from the training thread (after a backend error) and return the verdict, if any."""
        if self.control.desync_error is not None:
            return self.control.desync_error
        store = self.control.store  # the training thread's own connection: a new one would retry a gone host
        try:
            seen = int(store.add(_INQUIRY_KEY, 0))
            return self._answer(store, seen if seen > self._answered else _open(store, seen))
        except Exception as err:  # the store is gone (rank 0 exited): nothing to agree on
            log.debug("ddp_strategy: rank %d could not open a desync inquiry: %s", self.control.rank, err)
            return self.control.desync_error

    # ------------------------------------------------------------------ acting
    def _break_if_blocked(self, store: Store) -> None:
        """After the verdict: a rank still blocked in a backend collective prints the error and exits.

        Rank 0 goes first, one second after the verdict, the others half a second apart after it: its exit closes
        its connections, so the others' collectives return with an error, and they raise the agreed error instead
        (through the strategy's launcher). Rank 0 first, because under Lightning's subprocess launcher it is the
        parent of the node's other ranks, and kills itself at once when one of them exits with an error.
        """
        error = self.control.desync_error
        if error is None or self._verdict_at is None:
            return
        what, _ = self._current_wait()
        if not what.startswith("collective "):
            return
        delay = _BREAK_AFTER + 0.5 * self.control.rank
        if time.monotonic() - self._verdict_at < delay:
            return
        self._show(error)
        sys.stderr.write(
            f"[rank{self.control.rank}]: this rank's training thread is blocked inside a collective, which no "
            f"Python error can interrupt; the process exits with code {_EXIT_CODE} so that the other ranks' "
            "collectives return.\n"
        )
        sys.stderr.flush()
        sys.stdout.flush()
        if self.control.rank == 0:
            self.rank0_stopping(store)
        os._exit(_EXIT_CODE)

    def rank0_stopping(self, store: Store | None = None, *, await_verdicts: bool = True) -> None:
        """On rank 0, before it exits with the agreed error: let the others take the verdict, then say it stops.

        Rank 0 hosts the store the inquiry's reports are in: a rank whose heartbeat thread has not read them yet when
        rank 0 exits never learns the verdict and fails with the backend's unnamed "Connection reset by peer". So rank
        0 first waits (at most ``_VERDICT_WAIT`` seconds, less when a rank without it has died) until every rank holds
        the verdict. Best effort: the error being raised is what matters.

        Args:
            store: the store connection to use (the calling thread's own); the training thread's by default.
            await_verdicts: ``False`` when every rank got the error from one gather (the end-of-stage comparison).

        """
        store = store if store is not None else self.control.store
        try:
            if await_verdicts:
                world = self.control.world_size
                deadline = time.monotonic() + _VERDICT_WAIT
                next_look = time.monotonic()
                while time.monotonic() < deadline:
                    holding = _holding(store)
                    if len(holding) >= world:
                        break
                    if time.monotonic() >= next_look:  # twice a second: whether a rank without it has died
                        next_look = time.monotonic() + 0.5
                        if self._a_silent_rank_among(store, [r for r in range(world) if r not in holding]):
                            break
                    time.sleep(0.05)
            store.set(_RANK0_STOPPING_KEY, "1")
        except Exception as err:  # the error being raised is what matters
            log.debug("ddp_strategy: rank 0 could not announce its stop: %s", err)

    def await_rank0(self, timeout: float = 3.0) -> None:
        """On another rank, before it exits with the agreed error: wait (at most ``timeout``) until rank 0 showed it.

        Under Lightning's subprocess launcher rank 0 is the parent of its node's other ranks and kills itself as
        soon as one of them exits with an error; waiting lets rank 0 print the error first.
        """
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline and not self.control.store.check([_RANK0_STOPPING_KEY]):
                time.sleep(_poll_pause(self.control.world_size))
        except Exception as err:  # rank 0's store is gone: it has exited already
            log.debug("ddp_strategy: rank %d: rank 0's store is gone (%s)", self.control.rank, err)


_MAX_DIMS = 8


def check_gather_shapes(tensor: Any, *, group: Any = None, device: Any = None, site: str = "") -> None:
    """Before ``all_gather``: gather every rank's shape and dtype (one small fixed-size gather) and compare them.

    gloo aborts the whole process (``gloo::EnforceNotMet``, SIGABRT) when the ranks gather tensors of different
    sizes. A fixed-size gather of the shapes first lets every rank raise the same named error instead.

    Raises:
        CollectiveMismatchError: the ranks' tensors differ in shape or dtype (``reason="shapes"``).

    """
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) < 2:
        return
    shape = list(tensor.shape)
    if len(shape) > _MAX_DIMS:
        return
    meta = torch.tensor(
        [zlib.crc32(str(tensor.dtype).encode()), len(shape), *shape, *([0] * (_MAX_DIMS - len(shape)))],
        dtype=torch.int64,
        device=device,
    )
    gathered = [torch.empty_like(meta) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, meta, group=group)
    rows = [tuple(int(x) for x in g.tolist()) for g in gathered]
    if len(set(rows)) == 1:
        return
    described = {}
    for rank, row in enumerate(rows):
        dims = row[2 : 2 + row[1]]
        described[rank] = f"shape {list(dims)}" + ("" if row[0] == rows[0][0] else " (another dtype than rank 0's)")
    lines = [
        f"`all_gather` at {site or 'an unknown site'}: the ranks passed tensors of different shapes or dtypes, "
        "which the backend cannot gather (gloo aborts the process):",
        *_grouped(described),
        "Every rank must gather a tensor of the same shape and dtype: pad to a common shape (gather the sizes "
        "first), or use `trainer.strategy.all_gather_object` / torchmetrics' `gather_all_tensors` for uneven shapes.",
    ]
    raise CollectiveMismatchError("\n".join(lines), name="all_gather", missing_ranks=[], reason="shapes")
