"""What each rank's collectives were: the Flight Recorder's entries as calls, and what the ranks compare of them.

torch's Flight Recorder (:func:`~ddp_strategy._compat.torch.collective_trace`) keeps every collective of every
process group per rank, with its op, tensor sizes and Python stack. :func:`calls_from_trace` turns its entries into
:class:`CollectiveCall` values (the innermost user frame as the call site, and what made the call); the strategy
notes what made its own collectives (:class:`CallNotes`, :class:`LogSites` for ``self.log(..., sync_dist=True)``)
and counts them in a running digest (:class:`CallLedger`); :class:`CallAudit` keeps per-call digests of every
recorded collective, which the ranks publish and compare (:func:`first_published_difference`). The desync monitor
(:mod:`ddp_strategy.desync`) uses them to find ranks whose calls diverged.
"""

from __future__ import annotations

import array
import functools
import os
import threading
import time
import zlib
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ._compat.lightning import current_hook_name
from .positions import call_site, is_user_path, short_path

__all__ = [
    "AUDIT_INTERVAL",
    "REPORT_CALLS",
    "TRACE_ENTRIES",
    "CallAudit",
    "CallLedger",
    "CallNotes",
    "CollectiveCall",
    "LogSites",
    "calls_from_trace",
    "first_published_difference",
]

#: Collectives the Flight Recorder keeps (its ring buffer; torch's default is 2000), unless the user set
#: ``TORCH_FR_BUFFER_SIZE``. A dump holds the GIL for its whole length, in proportion to the entries, with a tail
#: (cold caches) that crossed 1 ms of CPU at 16 entries and not at 8 (bench/results/recorder_dump_cost-b0a1d77*: the
#: longest of 200 dumps 1.33 and 1.09 ms at 16, 0.73 and 0.64 ms at 8). The audit's coverage inside training steps
#: per CPU second is the same at any size (it dumps as often as its CPU budget allows); its reads as epochs start and
#: stages end see the last 8 calls; an inquiry's report adds the calls earlier audits kept (REPORT_CALLS).
TRACE_ENTRIES = 8
#: Collectives per process group a rank puts in its report (the newest): the recorder's, and those its audits kept.
REPORT_CALLS = 256
#: Seconds between two audits of a rank's recorded collectives (see :class:`CallAudit`), while it makes any.
AUDIT_INTERVAL = 5.0


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
    (``reduce on_train_epoch_end.x Float[]``, :meth:`add`: one append on the training thread); the digest takes it
    in (one ``zlib.crc32`` of a short string) when the state is next read, by the heartbeat's beat, which publishes
    ``(count, digest)``, or by the adding thread once :data:`_PENDING_MOST` calls wait; each rank compares a peer's
    with its own digest at the same count.
    """

    def __init__(self, keep: int = 4096, texts: int = REPORT_CALLS) -> None:
        self._state: tuple[int, int] = (0, 0)
        self._history: dict[int, int] = {}
        self._keep = keep
        self._texts: deque[tuple[int, str]] = deque(maxlen=texts)
        self._pending: deque[str] = deque()  # added, not yet in the digest
        self._settling = threading.Lock()

    def add(self, what: str) -> None:
        """Record one collective (its digest is computed when the state is next read)."""
        self._pending.append(what)
        if len(self._pending) >= _PENDING_MOST:  # nothing read the state for long (no heartbeat): not unbounded
            self._settle(wait=False)

    def _settle(self, *, wait: bool = True, until: int | None = None) -> None:
        """Take the calls added (``until``: up to that count) into the count and digest (any thread; one at a time).

        The GIL is let go (a short sleep) once the thread has kept it :data:`_HOLD_MOST` seconds while calls still
        wait (looked at every :data:`_SETTLED_AT_ONCE` calls, ~0.5 us each), so that a training thread waiting for
        it never waits long. A sleep is what costs here (0.1-0.2 ms of CPU on a VM, more than hundreds of calls), so
        a heartbeat's usual second of calls takes none. ``wait=False``: nothing when another thread is settling.
        """
        if not self._pending or not self._settling.acquire(blocking=wait):
            return
        try:
            count, digest = self._state
            pending, history, texts, keep = self._pending, self._history, self._texts, self._keep
            last = count + len(pending) if until is None else until
            hold_until = time.perf_counter() + _HOLD_MOST
            while pending and count < last:
                for _ in range(min(len(pending), _SETTLED_AT_ONCE, last - count)):
                    what = pending.popleft()
                    count, digest = count + 1, zlib.crc32(what.encode(), digest)
                    history[count] = digest
                    history.pop(count - keep, None)
                    texts.append((count, what))
                self._state = (count, digest)
                if pending and count < last and time.perf_counter() >= hold_until:
                    time.sleep(_YIELD)
                    hold_until = time.perf_counter() + _HOLD_MOST
        finally:
            self._settling.release()

    @property
    def state(self) -> tuple[int, int]:
        """``(count, digest)`` of the calls recorded so far."""
        self._settle()
        return self._state

    @property
    def texts(self) -> deque[tuple[int, str]]:
        """The newest calls as ``(count, what)``."""
        self._settle()
        return self._texts

    @property
    def count(self) -> int:
        """How many calls were recorded, the pending ones included: no work (for another thread's quick look)."""
        return self._state[0] + len(self._pending)

    def digest_at(self, count: int) -> int | None:
        """The digest after ``count`` calls, if still kept (``0`` for none).

        Takes pending calls into the digest up to ``count`` only: on the heartbeat thread, which compares a peer's
        count, that is at most the :data:`_PENDING_MOST` calls the adding thread leaves, not a second's worth.
        """
        if count > self._state[0]:
            self._settle(until=count)
        return 0 if count == 0 else self._history.get(count)


#: calls :class:`CallLedger` holds outside its digest at most (then the adding thread settles them): a beat on the
#: training thread settles no more (about 0.1 ms), however many steps a second it makes (a tiny model's 400 steps
#: with a ``sync_dist`` log each made its beat settle 400, about 1 ms)
_PENDING_MOST = 64
#: calls :class:`CallLedger` takes into its digest between two looks at the time it has kept the GIL
_SETTLED_AT_ONCE = 32
#: seconds :class:`CallLedger` keeps the GIL settling calls before a short sleep lets it go
_HOLD_MOST = 2.5e-4
_YIELD = 1e-4  # seconds of such a sleep: a training thread waiting for the GIL takes it meanwhile


class LogSites:
    """Where the module called ``self.log(..., sync_dist=True)``, per hook and name, for the collectives they make.

    Lightning syncs a value logged in an epoch-end hook later, from its own code, so the user's line is no longer
    on the stack when the collective runs. :meth:`install` wraps the module's ``log`` (an instance attribute,
    removed by :meth:`uninstall`) to record the line the first time each ``(hook, name)`` is logged with
    ``sync_dist=True``.
    """

    def __init__(self) -> None:
        self.sites: dict[tuple[str, str], str] = {}
        #: ``(hook, name)`` of the ``self.log(..., sync_dist=True)`` call running now: Lightning syncs a step value
        #: inside it (the strategy's ``reduce`` then needs no look at the stack to name it)
        self.current: tuple[str, str] | None = None
        self._module: Any = None

    def install(self, module: Any) -> None:
        """Start recording the ``self.log(..., sync_dist=True)`` lines of ``module``."""
        self.uninstall()
        original = module.log
        sites = self.sites

        def log_recording_site(name: str, value: Any, *args: Any, **kwargs: Any) -> Any:
            if not kwargs.get("sync_dist"):
                return original(name, value, *args, **kwargs)
            key = (current_hook_name(module), name)
            if key not in sites:
                sites[key] = call_site(skip=2)
            self.current = key
            try:
                return original(name, value, *args, **kwargs)
            finally:
                self.current = None

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
    and mix their values silently. The heartbeat thread adds the recorder's new calls now and then (:meth:`add`: a
    CRC-32 of each call's op, shapes, dtypes, user call site and what made it; see
    :class:`~ddp_strategy.desync_audit.RecorderAudit` for when), publishes the newest digests of each group
    (:meth:`publication`, a few kilobytes) and compares the next rank's publication with its own
    (:meth:`first_difference`); the strategy compares every rank's once more at each stage's end. A difference
    opens an inquiry, whose verdict names both calls. The calls added are kept too (the newest
    :data:`REPORT_CALLS` per group), for a report to name calls the recorder no longer holds.
    """

    def __init__(self, keep: int = 4 * REPORT_CALLS) -> None:
        self._digests: dict[str, dict[int, int]] = {}
        self._keep = keep
        #: per group, the newest sequence number added
        self.newest: dict[str, int] = {}
        #: per group, the newest calls added, oldest first
        self.calls: dict[str, deque[CollectiveCall]] = {}
        self._digest_of: dict[tuple[Any, ...], int] = {}  # per call key (most calls repeat a few keys)

    def add(self, calls: Sequence[CollectiveCall]) -> None:
        """Add the calls newer than those added before (recorder order: oldest first)."""
        known = self._digest_of
        for call in calls:
            if call.seq <= self.newest.get(call.group, 0):
                continue
            key = call.key()
            digest = known.get(key)
            if digest is None:
                if len(known) >= _DIGESTS_CACHED:
                    known.clear()
                digest = known[key] = zlib.crc32(repr(key).encode()) or 1  # 0 means "not known"
            digests = self._digests.setdefault(call.group, {})
            digests[call.seq] = digest
            digests.pop(call.seq - self._keep, None)
            self.newest[call.group] = call.seq
            self.calls.setdefault(call.group, deque(maxlen=REPORT_CALLS)).append(call)

    def publication(self, most: int = REPORT_CALLS) -> dict[str, list[Any]]:
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


#: call keys whose digest :class:`CallAudit` keeps at most (then it starts over)
_DIGESTS_CACHED = 4096


def _published_digests(publication: Mapping[str, Sequence[Any]], group: str) -> tuple[int, array.array[int]] | None:
    """``(first seq, digests)`` of ``group`` in a publication."""
    if group not in publication:
        return None
    first, data = publication[group]
    values = array.array("I")
    values.frombytes(bytes.fromhex(str(data)))
    return int(first), values


def first_published_difference(publications: Sequence[Mapping[str, Sequence[Any]]]) -> tuple[str, int] | None:
    """The first ``(group, seq)`` (lowest group id, then seq) to which ranks' publications give different digests.

    Args:
        publications: every rank's :meth:`CallAudit.publication`; a call only some ranks published is not compared
            (nor one a rank published as unknown, digest 0).

    """
    groups = sorted({group for publication in publications for group in publication})
    for group in groups:
        tables = [t for t in (_published_digests(p, group) for p in publications) if t is not None and len(t[1])]
        if len(tables) < 2:
            continue
        starts = sorted(first for first, _ in tables)
        ends = sorted(first + len(values) for first, values in tables)
        low, high = starts[1], ends[-2]  # the calls at least two ranks published
        if all(first == starts[0] for first in starts) and all(v == tables[0][1] for _, v in tables):
            continue  # the same calls, the same digests (the usual case at a stage's end)
        if len(tables) == 2:  # a rank and the next one, as the heartbeat compares: pairs of digests, no sets
            if low >= high:
                continue  # no call both published
            (first0, values0), (first1, values1) = tables
            pairs = zip(values0[low - first0 : high - first0], values1[low - first1 : high - first1], strict=True)
            differs = next((i for i, (a, b) in enumerate(pairs) if a != b and a and b), None)
            if differs is None:
                continue
            return group, low + differs
        for seq in range(low, high):
            values = {v[seq - first] for first, v in tables if first <= seq < first + len(v)} - {0}
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
    # a dump holds each distinct frame once (its entries share the frame dicts): one answer per stack in it
    stacks: dict[tuple[int, ...], tuple[str, str]] = {}
    for entry in entries:
        if entry.get("is_p2p"):
            continue
        frames = entry.get("frames") or ()
        stack = tuple(map(id, frames))
        found = stacks.get(stack)
        if found is None:
            found = stacks[stack] = _site_and_what(frames)
        site, what_frames = found
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
