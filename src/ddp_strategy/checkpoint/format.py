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
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import io
import json
import logging
import os
import struct
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import IO, Any

import fsspec

from ..errors import CheckpointIntegrityError

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

log = logging.getLogger(__name__)

MAGIC = b"DDPSCKPT"
FORMAT_VERSION = 2  # the newest format this version reads and, with the default checksum, writes
CHECKSUM_ALGORITHM = "crc32"  # the default payload checksum; "sha256" (format 1) is still written on request
_FORMAT_OF_ALGORITHM = {"sha256": 1, "crc32": 2}  # the oldest format that can carry each checksum
CHECKSUM_ALGORITHMS = tuple(_FORMAT_OF_ALGORITHM)  # what HashingWriter (and so SafeCheckpointIO) can write
_TRAILER = struct.Struct("<Q8s8s")  # record length, first 8 bytes of the record's SHA-256, magic
_MAX_RECORD_BYTES = 16 * 1024  # keeps the footer far inside the 64 KiB a zip reader scans for its end record
_READ_CHUNK = 8 * 1024 * 1024
_EOCD_SIGNATURE = b"PK\x05\x06"  # zip end-of-central-directory record
_EOCD_SEARCH = 22 + 65535 + _MAX_RECORD_BYTES + _TRAILER.size
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # zip local file header: signature ... file name length, extra length
_LOCAL_SIGNATURE = b"PK\x03\x04"
DEFER_MIN_BYTES = 1 << 20  # writes at least this large take their CRC-32 from the zip directory
WRITEBACK_PIECE_BYTES = 4 << 20  # large writes are passed on in pieces this large when write-back is started early


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


def _multiply_mod_p(a: int, b: int) -> int:
    """``a * b`` modulo the CRC-32 polynomial, in zlib's bit-reflected representation."""
    product = 0
    bit = 1 << 31
    while True:
        if a & bit:
            product ^= b
            if not a & (bit - 1):
                return product
        bit >>= 1
        b = (b >> 1) ^ 0xEDB88320 if b & 1 else b >> 1


_X_POW_2_POW = [1 << 30]  # x^(2^k) modulo the polynomial, k = 0..31
for _ in range(31):
    _X_POW_2_POW.append(_multiply_mod_p(_X_POW_2_POW[-1], _X_POW_2_POW[-1]))


def crc32_combine(crc1: int, crc2: int, length2: int) -> int:
    """The CRC-32 of ``A + B`` from ``crc1 = crc32(A)``, ``crc2 = crc32(B)`` and ``length2 = len(B)`` (as zlib's)."""
    power = 1 << 31  # x^(8 * length2), built from the table
    k = 3
    n = length2
    while n:
        if n & 1:
            power = _multiply_mod_p(_X_POW_2_POW[k & 31], power)
        n >>= 1
        k += 1
    return _multiply_mod_p(power, crc1) ^ crc2


class _PositionalReader(io.RawIOBase):
    """A read-only view of the first ``size`` bytes of a stream, read with ``pread`` (shares no file position)."""

    def __init__(self, pread: Callable[[int, int], bytes], size: int) -> None:
        super().__init__()
        self._pread = pread
        self._size = size
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._position, os.SEEK_END: self._size}[whence]
        self._position = max(0, base + offset)
        return self._position

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        data = self._pread(self._position, min(len(view), max(0, self._size - self._position)))
        view[: len(data)] = data
        self._position += len(data)
        return len(data)


def _pread_of(file: Any) -> Callable[[int, int], bytes] | None:
    """A ``pread(offset, n)`` over what was written to ``file``, or ``None`` if it cannot be read back."""
    if isinstance(file, io.BytesIO):

        def pread_bytesio(offset: int, n: int) -> bytes:
            with file.getbuffer() as buffer:
                return bytes(buffer[offset : offset + n])

        return pread_bytesio
    try:
        fd = file.fileno()
        readable = file.readable()
    except (AttributeError, OSError, ValueError):
        return None
    if not readable:
        return None

    def pread_fd(offset: int, n: int) -> bytes:
        parts = []
        while n > 0:
            part = os.pread(fd, n, offset)
            if not part:
                break
            parts.append(part)
            offset += len(part)
            n -= len(part)
        return b"".join(parts)

    return pread_fd


class HashingWriter:
    """A write-only binary stream that forwards to ``file`` and checksums and counts what passes through.

    ``torch.save`` streams into it, so the checksum costs no second read of the file and nothing is buffered.

    With the default CRC-32 (format 2), writes of at least 1 MiB (tensor data; ``torch.save`` passes each storage
    in one ``write``) are checksummed by a helper thread *while* the same bytes are written to ``file``
    (``zlib.crc32`` and the file write both release the GIL), so on a machine with a spare core the checksum adds
    almost no time; ``SafeCheckpointIO`` switches ``torch.save``'s own zip CRCs off meanwhile, which would compute
    the same kind of checksum a second time. The CRC-32 of the whole payload is combined from the pieces'.

    Alternatively (``parallel=False``, ``defer_large`` true), large writes are not hashed here: their CRC-32 is
    taken from the zip directory ``torch.save`` wrote (:meth:`finish` reads it back, a few bytes per record) and
    combined with the CRC-32 of the bytes in between. A large write that is not exactly one record's data, or
    whose record has no CRC, is read back and hashed instead. This needs ``file`` to be readable (``"w+b"``).

    Args:
        file: the binary stream to write to, positioned at the start of the payload.
        algorithm: ``"crc32"`` (format 2) or ``"sha256"`` (format 1).
        on_written: called with the number of payload bytes written so far after every large write (and after
            every piece of one, see ``piece_bytes``); :class:`~ddp_strategy.checkpoint.atomic.EarlyWriteback`
            uses it to start the disk write early.
        piece_bytes: pass large writes on to ``file`` in pieces of at most this many bytes (0: unsplit).
        defer_large: with ``parallel=False``, take large writes' CRC-32 from the zip directory (``None``: when
            ``file`` can be read back and this torch's zip CRCs were checked to be zlib's; ``False``: hash every
            byte as it passes).
        parallel: checksum large writes (CRC-32 only) in a helper thread beside their file write.
    """

    def __init__(
        self,
        file: IO[bytes],
        *,
        algorithm: str = CHECKSUM_ALGORITHM,
        on_written: Callable[[int], None] | None = None,
        piece_bytes: int = 0,
        defer_large: bool | None = None,
        parallel: bool = False,
    ) -> None:
        if algorithm not in _FORMAT_OF_ALGORITHM:
            raise ValueError(f"unsupported checksum algorithm {algorithm!r}; use one of {sorted(_FORMAT_OF_ALGORITHM)}")
        self._file = file
        self.algorithm = algorithm
        self._hash = hashlib.new(algorithm) if algorithm != "crc32" else None
        self._parallel = parallel and algorithm == "crc32"
        self._helper: concurrent.futures.ThreadPoolExecutor | None = None
        self._pread = _pread_of(file) if algorithm == "crc32" and not self._parallel else None
        self._defer = self._pread is not None and (defer_large if defer_large is not None else _zip_crcs_usable())
        self._on_written = on_written
        self._piece_bytes = piece_bytes
        # CRC-32 pieces in payload order: [crc or None (deferred), offset, length]
        self._pieces: list[list[Any]] = []
        self._run_crc = 0
        self._run_start = 0
        self._checksum: str | None = None
        self.bytes_written = 0
        #: The first ``OSError`` the underlying file raised (disk full, file too large, ...), if any.
        self.error: OSError | None = None

    @property
    def format_version(self) -> int:
        """The format version a record with this writer's checksum has."""
        return _FORMAT_OF_ALGORITHM[self.algorithm]

    def write(self, data: bytes | bytearray | memoryview) -> int:
        """Write ``data`` to the file and account for it in the payload checksum; return its size in bytes."""
        view = memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)
        size = view.nbytes
        large = size >= DEFER_MIN_BYTES
        pending: concurrent.futures.Future[int] | None = None
        if self._hash is not None:
            self._hash.update(view)
        elif large and self._parallel:
            if self._helper is None:
                self._helper = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ddp_strategy-crc32")
            pending = self._helper.submit(zlib.crc32, view)  # beside the write below; done before we return
        elif large and self._defer:
            self._end_run()
            self._pieces.append([None, self.bytes_written, size])
            self._run_start = self.bytes_written + size
        else:
            self._run_crc = zlib.crc32(view, self._run_crc)
        try:
            if large and self._piece_bytes and self._on_written is not None:
                for start in range(0, size, self._piece_bytes):
                    piece = view[start : start + self._piece_bytes]
                    self._file.write(piece)
                    self._on_written(self.bytes_written + start + piece.nbytes)
            else:
                self._file.write(view)
                if large and self._on_written is not None:
                    self._on_written(self.bytes_written + size)
        except OSError as err:  # torch's C++ zip writer replaces this with a vague message: keep the original
            self.error = err
            raise
        finally:
            crc = pending.result() if pending is not None else None  # the caller may reuse ``data`` after we return
        if crc is not None:
            self._end_run()
            self._pieces.append([crc, self.bytes_written, size])
            self._run_start = self.bytes_written + size
        self.bytes_written += size
        return size

    def close(self) -> None:
        """Stop the helper thread (if one was started); :meth:`finish` does this too."""
        if self._helper is not None:
            self._helper.shutdown(wait=True)
            self._helper = None

    def _end_run(self) -> None:
        if self.bytes_written > self._run_start:
            self._pieces.append([self._run_crc, self._run_start, self.bytes_written - self._run_start])
        self._run_crc = 0
        self._run_start = self.bytes_written

    def flush(self) -> None:
        """Flush the underlying file's buffer."""
        self._file.flush()

    def writable(self) -> bool:
        """Return ``True``: this is a write-only stream."""
        return True

    def finish(self) -> str:
        """The checksum of everything written (call once the payload is complete), ``"<algorithm>:<hex>"``."""
        self.close()
        if self._checksum is None:
            if self._hash is not None:
                self._checksum = f"{self.algorithm}:{self._hash.hexdigest()}"
            else:
                self._end_run()
                self._resolve_deferred()
                crc = 0
                for piece_crc, _offset, length in self._pieces:
                    crc = crc32_combine(crc, piece_crc, length)
                self._checksum = f"crc32:{crc:08x}"
        return self._checksum

    @property
    def checksum(self) -> str:
        """``"<algorithm>:<hex>"`` of everything written (completes the payload: see :meth:`finish`)."""
        return self.finish()

    def _resolve_deferred(self) -> None:
        deferred = [piece for piece in self._pieces if piece[0] is None]
        if not deferred:
            return
        assert self._pread is not None
        self._file.flush()
        pread = self._pread
        known = _zip_record_crcs(pread, self.bytes_written)
        for piece in deferred:
            _crc, offset, length = piece
            entry = known.get(offset)
            if entry is not None and entry[0] == length and entry[1] != 0:
                piece[0] = entry[1]
                continue
            crc = 0  # not exactly one record's data, or the archive has no CRC for it: read it back
            for start in range(offset, offset + length, _READ_CHUNK):
                chunk = pread(start, min(_READ_CHUNK, offset + length - start))
                if not chunk:
                    raise OSError(f"could not read back {length} bytes at offset {offset} of the checkpoint payload")
                crc = zlib.crc32(chunk, crc)
            piece[0] = crc


def _zip_record_crcs(pread: Callable[[int, int], bytes], size: int) -> dict[int, tuple[int, int]]:
    """``{data offset: (size, CRC-32)}`` of the stored (uncompressed) records of a zip archive of ``size`` bytes."""
    records: dict[int, tuple[int, int]] = {}
    try:
        with zipfile.ZipFile(_PositionalReader(pread, size)) as archive:
            infos = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        return records
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED or info.compress_size < DEFER_MIN_BYTES:
            continue
        header = pread(info.header_offset, _LOCAL_HEADER.size)
        if len(header) != _LOCAL_HEADER.size:
            continue
        signature, name_length, extra_length = _LOCAL_HEADER.unpack(header)
        if signature != _LOCAL_SIGNATURE:
            continue
        data_offset = info.header_offset + _LOCAL_HEADER.size + name_length + extra_length
        records[data_offset] = (info.compress_size, info.CRC)
    return records


@functools.cache
def _zip_crcs_usable() -> bool:
    """Whether this torch's zip records carry the standard CRC-32 (checked once per process on a small save)."""
    try:
        import torch

        buffer = io.BytesIO()
        writer = HashingWriter(buffer, defer_large=True)  # the probe itself takes the CRC from the zip directory
        torch.save({"probe": torch.arange(DEFER_MIN_BYTES // 4, dtype=torch.int32)}, writer)  # type: ignore[arg-type]
        combined = writer.finish()
        direct = f"crc32:{zlib.crc32(buffer.getvalue()):08x}"
    except Exception as err:  # pragma: no cover - never seen; hashing every byte is always correct
        log.debug("ddp_strategy: zip CRC probe failed (%s); hashing every byte", err)
        return False
    if combined != direct:  # pragma: no cover - a torch whose zip CRCs are not zlib's
        log.warning("ddp_strategy: torch's zip record CRCs do not match zlib's CRC-32; hashing every byte")
        return False
    return True


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
    if algorithm not in _FORMAT_OF_ALGORITHM and algorithm not in hashlib.algorithms_available:
        raise CheckpointIntegrityError(
            f"Checkpoint '{path}' names an unknown checksum algorithm {algorithm!r}.", path=path
        )
    crc = 0
    digest = hashlib.new(algorithm) if algorithm != "crc32" else None
    file.seek(0)
    remaining = record.payload_bytes
    while remaining > 0:
        chunk = file.read(min(_READ_CHUNK, remaining))
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
