"""The checkpoint file format: a plain ``torch.save`` payload followed by an integrity record.

Layout of a file written by :class:`~ddp_strategy.checkpoint.io.SafeCheckpointIO`::

    [ torch.save zip payload ][ record: JSON ][ record length: u64 LE ][ record SHA-256, first 8 bytes ][ MAGIC ]

``torch.load`` (and so ``LightningModule.load_from_checkpoint``) reads the file unchanged: zip readers find the
archive's directory from its own end-of-archive record and ignore the few bytes after it (the zip records carry no
CRC of their own, as with ``torch.serialization.set_crc32_options(False)``: ``torch.load`` never checks them, and
the footer's CRC-32 covers the whole payload; a generic ``unzip -t`` reports CRC errors). The record holds the
format version, the payload's byte size and checksum, the global step, epoch and world size; the trailer carries a
checksum of the record itself, so neither part can change unnoticed. A truncated file
loses its footer (or its payload no longer matches the checksum) and fails :func:`verify` with
:class:`~ddp_strategy.errors.CheckpointIntegrityError`.

Format versions (both are read):

* 1: the payload checksum is ``"sha256:<64 hex digits>"``.
* 2 (written by default): the payload checksum is ``"crc32:<8 hex digits>"``, the CRC-32 (zlib / zip polynomial) of
  the whole payload. It detects accidental damage (truncation, bit rot, a partial copy) like SHA-256 does, at a
  fraction of the cost; neither is a defence against deliberate tampering, since anyone who can alter the file can
  rewrite an unsigned footer. :class:`HashingWriter` computes it while the payload streams out, large tensor
  writes on a helper thread beside their file write, and :func:`verify` recomputes it from the file's bytes.

The checksums as the payload streams out (:class:`HashingWriter`, :func:`crc32_combine`) are in
:mod:`ddp_strategy.checkpoint.hashing`; this module re-exports them.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import zipfile
import zlib
from dataclasses import asdict, dataclass, fields
from typing import IO, Any

import fsspec

from ..errors import CheckpointIntegrityError
from .hashing import (
    CHECKSUM_ALGORITHM,
    CHECKSUM_ALGORITHMS,
    READ_CHUNK,
    HashingWriter,
    crc32_combine,
)

__all__ = [
    "CHECKSUM_ALGORITHM",
    "CHECKSUM_ALGORITHMS",
    "FORMAT_VERSION",
    "MAGIC",
    "HashingWriter",
    "IntegrityRecord",
    "crc32_combine",
    "filesystem",
    "read_record",
    "verify",
    "verify_stream",
    "write_footer",
]

MAGIC = b"DDPSCKPT"
FORMAT_VERSION = 2  # the newest format this version reads and, with the default checksum, writes
_TRAILER = struct.Struct("<Q8s8s")  # record length, first 8 bytes of the record's SHA-256, magic
_MAX_RECORD_BYTES = 16 * 1024  # keeps the footer far inside the 64 KiB a zip reader scans for its end record
_EOCD_SIGNATURE = b"PK\x05\x06"  # zip end-of-central-directory record
_EOCD_SEARCH = 22 + 65535 + _MAX_RECORD_BYTES + _TRAILER.size


@dataclass(frozen=True, kw_only=True)
class IntegrityRecord:
    """What the footer of a checkpoint says about its payload.

    Attributes:
        format_version: the footer format (2 when written by this version with the default CRC-32, 1 with SHA-256).
        payload_bytes: size of the ``torch.save`` payload in bytes.
        checksum: ``"<algorithm>:<hex digest>"`` of the payload: ``"crc32:<8 hex>"`` (format 2) or
            ``"sha256:<64 hex>"`` (format 1).
        global_step: the checkpoint's ``global_step``, when it has one.
        epoch: the checkpoint's ``epoch``, when it has one.
        world_size: the number of ranks of the run that wrote it, when known.
        writer: the software that wrote it, e.g. ``"ddp_strategy 0.1.0"``.

    """

    format_version: int
    payload_bytes: int
    checksum: str
    global_step: int | None = None
    epoch: int | None = None
    world_size: int | None = None
    writer: str = ""

    def to_json(self) -> bytes:
        """Serialise for the footer."""
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, *, path: str) -> IntegrityRecord:
        """Parse a footer record; a malformed one raises :class:`CheckpointIntegrityError`."""
        try:
            values = json.loads(data.decode())
            if isinstance(values, dict) and values.get("format_version", 0) > FORMAT_VERSION:
                known = {field.name for field in fields(cls)}  # a newer format may add fields: report the version
                values = {key: value for key, value in values.items() if key in known}
            return cls(**values)
        except (ValueError, TypeError) as err:
            raise CheckpointIntegrityError(
                f"Checkpoint '{path}' has a damaged integrity record ({err}). The file was altered after it was "
                "written; use another checkpoint.",
                path=path,
            ) from err


def _record_digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()[:8]


def write_footer(file: IO[bytes], record: IntegrityRecord) -> None:
    """Append the integrity record and trailer to ``file`` (positioned at the end of the payload)."""
    data = record.to_json()
    if len(data) > _MAX_RECORD_BYTES:
        raise ValueError(f"integrity record too large ({len(data)} bytes)")
    file.write(data)
    file.write(_TRAILER.pack(len(data), _record_digest(data), MAGIC))


def read_record(file: IO[bytes], size: int, *, path: str) -> IntegrityRecord | None:
    """Read the footer of an open checkpoint of ``size`` bytes.

    Returns:
        The record, or ``None`` when the file has no footer (not written by ``ddp_strategy``).

    Raises:
        CheckpointIntegrityError: the footer exists but is inconsistent with the file.

    """
    if size < _TRAILER.size:
        return None
    file.seek(size - _TRAILER.size)
    length, record_digest, magic = _TRAILER.unpack(file.read(_TRAILER.size))
    if magic != MAGIC:
        return None
    if length > _MAX_RECORD_BYTES or length > size - _TRAILER.size:
        raise CheckpointIntegrityError(
            f"Checkpoint '{path}' has a damaged integrity trailer (record length {length}). The file was altered "
            "after it was written; use another checkpoint.",
            path=path,
        )
    file.seek(size - _TRAILER.size - length)
    data = file.read(length)
    if _record_digest(data) != record_digest:
        raise CheckpointIntegrityError(
            f"Checkpoint '{path}' has an altered integrity record (its own checksum does not match). The file was "
            "damaged after it was written; use another checkpoint.",
            path=path,
        )
    record = IntegrityRecord.from_json(data, path=path)
    expected = record.payload_bytes + length + _TRAILER.size
    if expected != size:
        raise CheckpointIntegrityError(
            f"Checkpoint '{path}' is {size} bytes but its integrity record describes {expected} bytes: the file was "
            "truncated or extended after it was written. Use another checkpoint.",
            path=path,
        )
    return record


def _zip_end(file: IO[bytes], size: int) -> int | None:
    """Offset just past a zip archive's end-of-central-directory record, or ``None`` if there is none."""
    file.seek(0)
    if not zipfile.is_zipfile(file):
        return None
    tail_start = max(0, size - _EOCD_SEARCH)
    file.seek(tail_start)
    tail = file.read(size - tail_start)
    at = tail.rfind(_EOCD_SIGNATURE)
    if at < 0 or at + 22 > len(tail):
        return None
    comment_length = int.from_bytes(tail[at + 20 : at + 22], "little")
    return tail_start + at + 22 + comment_length


def verify_stream(file: IO[bytes], size: int, *, path: str) -> IntegrityRecord | None:
    """Verify an open checkpoint against its integrity record (see :func:`verify`)."""
    record = read_record(file, size, path=path)
    if record is None:
        end = _zip_end(file, size)
        file.seek(0)
        if end == size:
            return None  # a complete file written by something else (stock Lightning, torch.save)
        if end is not None:
            raise CheckpointIntegrityError(
                f"Checkpoint '{path}' has {size - end} stray bytes after its archive but no complete integrity "
                "record: its footer was cut short (a truncated copy or upload). Use another checkpoint.",
                path=path,
            )
        raise CheckpointIntegrityError(
            f"Checkpoint '{path}' ({size} bytes) is truncated or is not a PyTorch checkpoint: it has neither a "
            "ddp_strategy integrity record nor a complete zip archive. It was probably cut short by a crash during "
            "a save by a writer without atomic replacement; resume from another checkpoint.",
            path=path,
        )
    if record.format_version > FORMAT_VERSION:
        raise CheckpointIntegrityError(
            f"Checkpoint '{path}' uses integrity format {record.format_version}, newer than this ddp_strategy "
            f"understands ({FORMAT_VERSION}). Upgrade ddp_strategy to read it.",
            path=path,
        )
    algorithm, _, expected = record.checksum.partition(":")
    if algorithm not in CHECKSUM_ALGORITHMS and algorithm not in hashlib.algorithms_available:
        raise CheckpointIntegrityError(
            f"Checkpoint '{path}' names an unknown checksum algorithm {algorithm!r}.", path=path
        )
    crc = 0
    digest = hashlib.new(algorithm) if algorithm != "crc32" else None
    file.seek(0)
    remaining = record.payload_bytes
    while remaining > 0:
        chunk = file.read(min(READ_CHUNK, remaining))
        if not chunk:
            break
        if digest is None:
            crc = zlib.crc32(chunk, crc)
        else:
            digest.update(chunk)
        remaining -= len(chunk)
    actual = f"{crc:08x}" if digest is None else digest.hexdigest()
    if remaining or actual != expected:
        raise CheckpointIntegrityError(
            f"Checkpoint '{path}' does not match its checksum ({record.checksum[:23]}...): its content was altered "
            "or damaged after it was written. Use another checkpoint.",
            path=path,
        )
    file.seek(0)
    return record


def filesystem(
    path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None
) -> fsspec.AbstractFileSystem:
    """The fsspec filesystem of ``path`` (local for a plain path; ``s3://``, ``gs://``, ... by protocol)."""
    fs, _ = fsspec.core.url_to_fs(str(path), **(storage_options or {}))
    return fs


def verify(path: str, storage_options: dict[str, Any] | None = None) -> IntegrityRecord | None:
    """Check a checkpoint file against its integrity record.

    Args:
        path: a local path or fsspec URL.
        storage_options: passed to fsspec for remote paths.

    Returns:
        The integrity record, or ``None`` for a complete checkpoint without one (written by stock Lightning or
        ``torch.save``), which cannot be verified.

    Raises:
        CheckpointIntegrityError: the file is truncated, altered, or not a checkpoint.
        FileNotFoundError: there is no file at ``path``.

    """
    fs = filesystem(path, storage_options)
    if not fs.exists(path):
        raise FileNotFoundError(f"Checkpoint '{path}' does not exist.")
    if fs.isdir(path):
        raise CheckpointIntegrityError(
            f"Checkpoint path '{path}' is a directory, not a checkpoint file. Pass the path of a .ckpt file in it "
            "(or ckpt_path='last').",
            path=path,
        )
    size = int(fs.size(path))
    with fs.open(path, "rb") as file:
        return verify_stream(file, size, path=path)
