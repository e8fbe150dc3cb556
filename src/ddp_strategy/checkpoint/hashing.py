"""The payload checksum of a checkpoint file, computed while ``torch.save`` streams the payload out.

:class:`HashingWriter` is the stream ``torch.save`` writes into; :func:`crc32_combine` joins the CRC-32s of the
payload's pieces. The file layout the checksum goes into, and its verification: :mod:`ddp_strategy.checkpoint.format`
(which re-exports :class:`HashingWriter`, :func:`crc32_combine` and the checksum algorithms).
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import io
import logging
import os
import struct
import zipfile
import zlib
from collections.abc import Callable
from typing import IO, Any

__all__ = [
    "CHECKSUM_ALGORITHM",
    "CHECKSUM_ALGORITHMS",
    "DEFER_MIN_BYTES",
    "READ_CHUNK",
    "WRITEBACK_PIECE_BYTES",
    "HashingWriter",
    "crc32_combine",
]

log = logging.getLogger(__name__)

CHECKSUM_ALGORITHM = "crc32"  # the default payload checksum; "sha256" (format 1) is still written on request
_FORMAT_OF_ALGORITHM = {"sha256": 1, "crc32": 2}  # the oldest format that can carry each checksum
CHECKSUM_ALGORITHMS = tuple(_FORMAT_OF_ALGORITHM)  # what HashingWriter (and so SafeCheckpointIO) can write
READ_CHUNK = 8 * 1024 * 1024  # bytes read back at a time, to checksum them
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # zip local file header: signature ... file name length, extra length
_LOCAL_SIGNATURE = b"PK\x03\x04"
DEFER_MIN_BYTES = 1 << 20  # writes at least this large take their CRC-32 from the zip directory
WRITEBACK_PIECE_BYTES = 4 << 20  # large writes are passed on in pieces this large when write-back is started early


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
            for start in range(offset, offset + length, READ_CHUNK):
                chunk = pread(start, min(READ_CHUNK, offset + length - start))
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
