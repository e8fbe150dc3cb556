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

#: Collectives the Flight Recorder keeps (its ring buffer), unless the user set ``TORCH_FR_BUFFER_SIZE``.
TRACE_ENTRIES = 256
#: Collectives per process group a rank puts in its report (the newest).
REPORT_CALLS = TRACE_ENTRIES
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
