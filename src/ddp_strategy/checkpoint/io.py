"""``SafeCheckpointIO``: crash-safe, verified checkpoint files (a Lightning ``CheckpointIO``).

Saving streams ``torch.save`` into a temporary file *in the destination directory* (so the final rename never
crosses a filesystem), checksumming on the way (CRC-32, computed by a helper thread beside each large write while
``torch.save``'s own zip CRCs are off; see :class:`~ddp_strategy.checkpoint.format.HashingWriter`) and starting the
disk write of each part as soon as it is written (:class:`~ddp_strategy.checkpoint.atomic.EarlyWriteback`), appends
the integrity record, ``fsync``s the file, ``os.replace``s it over the destination and ``fsync``s the directory.
Until that rename, the previous file at the destination is untouched; after it, the new file is complete and
durable. Nothing is buffered in RAM beyond ``torch.save``'s own chunks. Remote fsspec paths are written to a local
temporary file, uploaded, and verified by size and footer.

Loading verifies the integrity record first (:func:`~ddp_strategy.checkpoint.format.verify`), then calls
``torch.load`` with ``weights_only=True`` unless the caller explicitly passes ``weights_only=False``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import torch
from typing_extensions import override

from .._compat.lightning import CheckpointIO, CheckpointPath
from ..errors import CheckpointIntegrityError, CheckpointWriteError, UnsafeCheckpointError
from .atomic import EarlyWriteback, atomic_file
from .format import (
    CHECKSUM_ALGORITHM,
    CHECKSUM_ALGORITHMS,
    WRITEBACK_PIECE_BYTES,
    HashingWriter,
    IntegrityRecord,
    filesystem,
    verify,
    write_footer,
)
from .keys import WORLD_SIZE_KEY, package_state

__all__ = ["SafeCheckpointIO"]

log = logging.getLogger(__name__)


_CAN_SKIP_ZIP_CRCS = hasattr(torch.serialization, "set_crc32_options")  # torch >= 2.6


@contextlib.contextmanager
def _zip_crcs_off() -> Iterator[None]:
    """Make ``torch.save`` skip the CRC-32 of each zip record while a checkpoint is written.

    The integrity record's CRC-32 of the whole payload is computed beside the write instead
    (:class:`~ddp_strategy.checkpoint.format.HashingWriter` with ``parallel=True``), and ``torch.load`` never checks
    zip CRCs. torch's serialization settings are per thread (``torch.utils.serialization.config``), so a
    ``torch.save`` in another thread meanwhile is not affected; the calling thread's setting is restored after.
    """
    previous = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(previous)


def _is_local(path: str) -> bool:
    return "://" not in path or path.startswith("file://")


def _local_path(path: str) -> str:
    return path[len("file://") :] if path.startswith("file://") else path


def _writer_tag() -> str:
    from .. import __version__

    return f"ddp_strategy {__version__}"


def _optional_int(value: Any) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


class SafeCheckpointIO(CheckpointIO):
    """Atomic, fsynced, checksummed checkpoint files that ``torch.load`` still reads as usual.

    ``SafeDDPStrategy`` uses it by default; it can also be given to any Lightning strategy with
    ``Trainer(plugins=[SafeCheckpointIO()])``.

    Args:
        checksum: the payload checksum written into the integrity record: ``"crc32"`` (format 2, the default) or
            ``"sha256"`` (format 1, readable by ddp_strategy versions before format 2; about 3x the CPU time of a
            plain ``torch.save`` on top of it). Loading reads both.
    """

    def __init__(self, checksum: str = CHECKSUM_ALGORITHM) -> None:
        super().__init__()
        if checksum not in CHECKSUM_ALGORITHMS:
            raise ValueError(f"checksum must be one of {CHECKSUM_ALGORITHMS}, not {checksum!r}")
        self.checksum = checksum

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: CheckpointPath, storage_options: Any | None = None
    ) -> None:
        """Write ``checkpoint`` to ``path`` atomically with its integrity record.

        Raises:
            CheckpointWriteError: the write failed (disk full, permission denied, file size limit, ...). The
                previous file at ``path``, if any, is unchanged.

        """
        path = str(path)
        try:
            if _is_local(path):
                self._save_local(checkpoint, _local_path(path))
            else:
                self._save_remote(checkpoint, path, storage_options)
        except CheckpointWriteError:
            raise
        except (OSError, RuntimeError, pickle.PicklingError) as err:
            raise CheckpointWriteError(
                f"Saving checkpoint '{path}' failed: {err}. The previous checkpoint at that path (if any) is "
                "unchanged. Check free space, permissions and file size limits of the checkpoint directory.",
                path=path,
            ) from err

    def _record(self, checkpoint: dict[str, Any], writer: HashingWriter) -> IntegrityRecord:
        ours = package_state(checkpoint)
        return IntegrityRecord(
            format_version=writer.format_version,
            payload_bytes=writer.bytes_written,
            checksum=writer.finish(),
            global_step=_optional_int(checkpoint.get("global_step")),
            epoch=_optional_int(checkpoint.get("epoch")),
            world_size=_optional_int(ours.get(WORLD_SIZE_KEY)),
            writer=_writer_tag(),
        )

    def _write_stream(self, checkpoint: dict[str, Any], file: Any, writeback: bool = False) -> IntegrityRecord:
        early = EarlyWriteback(file.fileno(), file.tell()) if writeback else None
        algorithm = getattr(self, "checksum", CHECKSUM_ALGORITHM)  # subclasses may skip __init__
        parallel = algorithm == "crc32" and _CAN_SKIP_ZIP_CRCS
        writer = HashingWriter(
            file,
            algorithm=algorithm,
            on_written=early.advance if early is not None else None,
            piece_bytes=WRITEBACK_PIECE_BYTES,
            parallel=parallel,
        )
        try:
            with _zip_crcs_off() if parallel else contextlib.nullcontext():
                torch.save(checkpoint, writer)  # type: ignore[arg-type]  # any object with write() works
            record = self._record(checkpoint, writer)
        except RuntimeError as err:
            if writer.error is not None:  # report the OS's reason (e.g. "No space left on device")
                raise writer.error from err
            raise
        finally:
            writer.close()
            if early is not None:
                early.close()  # before the file (and its descriptor) is closed
        write_footer(file, record)
        return record

    def _save_local(self, checkpoint: dict[str, Any], path: str) -> None:
        with atomic_file(path) as file:
            self._write_stream(checkpoint, file, writeback=True)

    def _save_remote(self, checkpoint: dict[str, Any], path: str, storage_options: Any | None) -> None:
        fs = filesystem(path, **(storage_options or {}))
        parent = path.rsplit("/", 1)[0]
        fs.makedirs(parent, exist_ok=True)
        with tempfile.NamedTemporaryFile(suffix=".ckpt") as local:
            record = self._write_stream(checkpoint, local)
            local.flush()
            fs.put_file(local.name, path)
            size = int(fs.size(path))
            local_size = os.path.getsize(local.name)
        if size != local_size:
            raise CheckpointWriteError(
                f"Uploading checkpoint '{path}' left {size} bytes instead of {local_size}.", path=path
            )
        if verify(path, storage_options) != record:
            raise CheckpointWriteError(f"Uploaded checkpoint '{path}' does not verify.", path=path)

    @override
    def load_checkpoint(
        self,
        path: CheckpointPath,
        map_location: Callable[..., Any] | torch.device | str | dict[str, str] | None = None,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Verify, then load a checkpoint.

        Args:
            path: local path or fsspec URL.
            map_location: passed to ``torch.load``; ``SafeDDPStrategy`` passes each rank's own device.
            weights_only: ``None`` or ``True`` loads only tensors and primitive containers; a checkpoint carrying
                other pickled objects is refused before anything in it runs. Pass ``False`` explicitly to allow
                arbitrary pickled objects from a checkpoint you trust.

        Raises:
            FileNotFoundError: no file at ``path``.
            CheckpointIntegrityError: the file is truncated, altered, a directory, or not a checkpoint.
            UnsafeCheckpointError: the file needs arbitrary unpickling and ``weights_only`` was not ``False``.

        """
        path = str(path)
        record = verify(path)
        if record is None:
            log.warning(
                "ddp_strategy: checkpoint '%s' has no integrity record (it was not written by ddp_strategy), so it "
                "cannot be verified; loading it as is.",
                path,
            )
        safe = weights_only is not False
        fs = filesystem(path)
        with fs.open(path, "rb") as file:
            try:
                loaded = torch.load(file, map_location=map_location, weights_only=safe)
            except pickle.UnpicklingError as err:
                if not safe:
                    raise CheckpointIntegrityError(
                        f"Checkpoint '{path}' cannot be unpickled: {err}", path=path
                    ) from err
                raise UnsafeCheckpointError(
                    f"Checkpoint '{path}' contains pickled Python objects that are not plain tensors or containers, "
                    f"so it was refused and nothing in it was run ({str(err).splitlines()[0]}). If you trust its "
                    "source, load it with trainer.fit(..., weights_only=False); otherwise keep only tensors and "
                    "primitives in hyperparameters and callback/module state.",
                    path=path,
                ) from err
            except (RuntimeError, EOFError) as err:
                raise CheckpointIntegrityError(
                    f"Checkpoint '{path}' could not be read by torch.load: {err}", path=path
                ) from err
        if not isinstance(loaded, dict):
            raise CheckpointIntegrityError(
                f"'{path}' holds a {type(loaded).__name__}, not a Lightning checkpoint dict.", path=path
            )
        return loaded

    @override
    def remove_checkpoint(self, path: CheckpointPath) -> None:
        """Remove a checkpoint file if it exists."""
        fs = filesystem(path)
        if fs.exists(path):
            fs.rm(path, recursive=True)
