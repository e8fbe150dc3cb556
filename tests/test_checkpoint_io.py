"""``SafeCheckpointIO``, the checkpoint file format, RNG state and the load-side protocol helpers, on real files."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import pathlib
import pickle
import random
import re
import struct
import subprocess
import sys
import textwrap
import warnings
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import lightning
import numpy as np
import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ddp_strategy
from ddp_strategy.checkpoint import io as ddp_io
from ddp_strategy.checkpoint import protocol, rng
from ddp_strategy.checkpoint.format import FORMAT_VERSION, MAGIC, verify
from ddp_strategy.checkpoint.io import SafeCheckpointIO
from ddp_strategy.errors import CheckpointIntegrityError, CheckpointWriteError, UnsafeCheckpointError

pytestmark = pytest.mark.compat  # fast unit tests, also run against the lowest and newest Lightning

TRAILER = struct.Struct("<Q8s8s")  # record length (u64 LE) + record digest + magic, as documented in format.py


# --------------------------------------------------------------------------------------------------- helpers


def make_checkpoint(*, global_step: int = 4, epoch: int = 1, size: int = 16, seed: int = 0) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "state_dict": {
            "layer.weight": torch.randn(size, 3, generator=generator),
            "layer.bias": torch.randn(size, generator=generator),
            "bn.num_batches_tracked": torch.tensor(7),
        },
        "global_step": global_step,
        "epoch": epoch,
        "ddp_strategy": {"world_size": 2, "rng_states": [rng.capture(), rng.capture()]},
    }


def assert_same(actual: Any, expected: Any, where: str = "checkpoint") -> None:
    """Deep equality that compares tensors by value, dtype and shape."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), where
        assert actual.dtype == expected.dtype, where
        assert torch.equal(actual, expected), where
    elif isinstance(expected, dict):
        assert isinstance(actual, dict), where
        assert actual.keys() == expected.keys(), where
        for key, value in expected.items():
            assert_same(actual[key], value, f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)), where
        assert len(actual) == len(expected), where
        for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same(a, e, f"{where}[{index}]")
    else:
        assert actual == expected, where


def temp_leftovers(directory: Path) -> list[str]:
    return sorted(name for name in os.listdir(directory) if ".tmp-" in name)


def record_bounds(data: bytes) -> tuple[int, int]:
    """(start, end) of the JSON record inside a SafeCheckpointIO file's bytes."""
    length, _digest, magic = TRAILER.unpack(data[-TRAILER.size :])
    assert magic == MAGIC
    end = len(data) - TRAILER.size
    return end - length, end


def draw() -> tuple[list[float], list[float], torch.Tensor]:
    """Numbers from every generator ``rng.capture`` covers, including the cached-Gaussian paths."""
    python = [random.random() for _ in range(3)] + [random.gauss(0.0, 1.0) for _ in range(3)]
    numpy = np.random.rand(3).tolist() + np.random.randn(3).tolist()
    return python, numpy, torch.rand(5)


def assert_same_draws(first: tuple[list[float], list[float], torch.Tensor], second: Any) -> None:
    assert first[0] == second[0]
    assert first[1] == second[1]
    assert torch.equal(first[2], second[2])


@pytest.fixture
def checkpoint_io() -> SafeCheckpointIO:
    return SafeCheckpointIO()


@pytest.fixture
def saved(tmp_path: Path, checkpoint_io: SafeCheckpointIO) -> tuple[Path, dict[str, Any]]:
    """A valid checkpoint written by SafeCheckpointIO and the dict it holds."""
    checkpoint = make_checkpoint()
    path = tmp_path / "model.ckpt"
    checkpoint_io.save_checkpoint(checkpoint, path)
    return path, checkpoint


@pytest.fixture
def memory_fs() -> Iterator[fsspec.AbstractFileSystem]:
    fs = fsspec.filesystem("memory")
    fs.store.clear()
    fs.pseudo_dirs[:] = [""]
    yield fs
    fs.store.clear()
    fs.pseudo_dirs[:] = [""]


# --------------------------------------------------------------------------------------------------- round trip


def test_round_trip_preserves_every_value(saved: tuple[Path, dict[str, Any]], checkpoint_io: SafeCheckpointIO) -> None:
    path, checkpoint = saved
    loaded = checkpoint_io.load_checkpoint(path)
    assert_same(loaded, checkpoint)


def test_verify_returns_a_correct_integrity_record(saved: tuple[Path, dict[str, Any]]) -> None:
    path, _ = saved
    data = path.read_bytes()
    record = verify(str(path))
    assert record is not None
    assert record.format_version == FORMAT_VERSION == 2
    assert record.global_step == 4
    assert record.epoch == 1
    assert record.world_size == 2
    assert record.writer == f"ddp_strategy {ddp_strategy.__version__}"
    # the payload is exactly what precedes the JSON record and trailer
    start, end = record_bounds(data)
    assert record.payload_bytes == start
    assert json.loads(data[start:end]) == {
        "format_version": record.format_version,
        "payload_bytes": record.payload_bytes,
        "checksum": record.checksum,
        "global_step": 4,
        "epoch": 1,
        "world_size": 2,
        "writer": record.writer,
    }
    assert record.checksum == f"crc32:{zlib.crc32(data[: record.payload_bytes]):08x}"


def test_record_leaves_out_non_integer_metadata(tmp_path: Path, checkpoint_io: SafeCheckpointIO) -> None:
    path = tmp_path / "bare.ckpt"
    checkpoint_io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "global_step": True, "epoch": 1.5}, path)
    record = verify(str(path))
    assert record is not None
    assert (record.global_step, record.epoch, record.world_size) == (None, None, None)


def test_plain_torch_load_reads_the_file(saved: tuple[Path, dict[str, Any]]) -> None:
    path, checkpoint = saved
    assert_same(torch.load(path, weights_only=True), checkpoint)


class TinyModule(LightningModule):
    def __init__(self, hidden: int = 3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = nn.Linear(2, hidden)


def test_lightning_load_from_checkpoint_reads_the_file(tmp_path: Path, checkpoint_io: SafeCheckpointIO) -> None:
    torch.manual_seed(3)
    source = TinyModule(hidden=5)
    path = tmp_path / "lightning.ckpt"
    checkpoint_io.save_checkpoint(
        {
            "state_dict": source.state_dict(),
            "hyper_parameters": {"hidden": 5},
            "pytorch-lightning_version": lightning.__version__,
            "global_step": 0,
            "epoch": 0,
        },
        path,
    )
    loaded = TinyModule.load_from_checkpoint(path)
    assert loaded.hparams.hidden == 5
    assert torch.equal(loaded.layer.weight, source.layer.weight)
    assert torch.equal(loaded.layer.bias, source.layer.bias)


def test_remove_checkpoint(saved: tuple[Path, dict[str, Any]], checkpoint_io: SafeCheckpointIO) -> None:
    path, _ = saved
    checkpoint_io.remove_checkpoint(path)
    assert not path.exists()
    checkpoint_io.remove_checkpoint(path)  # a missing file is not an error
    assert not path.exists()


# --------------------------------------------------------------------------------------------------- atomicity


def test_save_leaves_only_the_final_file(tmp_path: Path, checkpoint_io: SafeCheckpointIO) -> None:
    path = tmp_path / "sub" / "dir" / "model.ckpt"  # parent directories are created
    checkpoint_io.save_checkpoint(make_checkpoint(), path)
    checkpoint_io.save_checkpoint(make_checkpoint(global_step=8), path)  # overwrite in place
    assert os.listdir(path.parent) == ["model.ckpt"]
    record = verify(str(path))
    assert record is not None
    assert record.global_step == 8


def test_failed_save_keeps_previous_file(
    saved: tuple[Path, dict[str, Any]], checkpoint_io: SafeCheckpointIO, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, checkpoint = saved
    before = path.read_bytes()
    calls = []

    def disk_full(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        calls.append(obj)
        f.write(b"PK\x03\x04" + b"\0" * 10_000)  # a partial archive reaches the temporary file
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ddp_io.torch, "save", disk_full)
    with pytest.raises(CheckpointWriteError) as excinfo:
        checkpoint_io.save_checkpoint(make_checkpoint(global_step=99, size=64), path)
    monkeypatch.undo()

    assert calls, "the failing torch.save was not used"
    assert str(path) in str(excinfo.value)
    assert os.strerror(errno.ENOSPC) in str(excinfo.value)
    assert excinfo.value.path == str(path)
    assert path.read_bytes() == before
    record = verify(str(path))
    assert record is not None
    assert record.global_step == 4
    assert_same(checkpoint_io.load_checkpoint(path), checkpoint)
    assert temp_leftovers(path.parent) == []
    assert os.listdir(path.parent) == ["model.ckpt"]


def test_interrupted_save_keeps_previous_file_and_propagates(
    saved: tuple[Path, dict[str, Any]], checkpoint_io: SafeCheckpointIO, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _ = saved
    before = path.read_bytes()

    def interrupted(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        f.write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(ddp_io.torch, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        checkpoint_io.save_checkpoint(make_checkpoint(global_step=99), path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert temp_leftovers(path.parent) == []


_FSIZE_CHILD = textwrap.dedent(
    """
    import resource, signal, sys
    import torch
    from ddp_strategy.checkpoint.io import SafeCheckpointIO
    from ddp_strategy.errors import CheckpointWriteError

    path, limit = sys.argv[1], int(sys.argv[2])
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    big = {"state_dict": {"w": torch.arange(200_000, dtype=torch.float32)}, "global_step": 99}
    try:
        SafeCheckpointIO().save_checkpoint(big, path)
    except CheckpointWriteError as err:
        print("CheckpointWriteError:", err)
        sys.exit(0 if path in str(err) and err.path == path else 4)
    except BaseException as err:
        print("other:", type(err).__name__, err)
        sys.exit(5)
    print("saved")
    sys.exit(6)
    """
)


@pytest.mark.skipif(not hasattr(os, "fork") or sys.platform == "win32", reason="needs RLIMIT_FSIZE and SIGXFSZ")
def test_file_size_limit_keeps_previous_file(
    saved: tuple[Path, dict[str, Any]], checkpoint_io: SafeCheckpointIO
) -> None:
    path, checkpoint = saved
    before = path.read_bytes()
    limit = len(before) + 4096  # the old file fits, the ~800 KB new one does not
    child = subprocess.run(
        [sys.executable, "-c", _FSIZE_CHILD, str(path), str(limit)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert child.returncode == 0, (child.returncode, child.stdout, child.stderr)
    assert "CheckpointWriteError" in child.stdout
    assert os.strerror(errno.EFBIG) in child.stdout  # the OS's reason, not torch's vague zip-writer message
    assert path.read_bytes() == before
    assert_same(checkpoint_io.load_checkpoint(path), checkpoint)
    assert temp_leftovers(path.parent) == []


def test_save_below_a_regular_file_raises_write_error(tmp_path: Path, checkpoint_io: SafeCheckpointIO) -> None:
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("I am a file")
    path = blocker / "nested" / "model.ckpt"
    with pytest.raises(CheckpointWriteError) as excinfo:
        checkpoint_io.save_checkpoint(make_checkpoint(), path)
    assert str(path) in str(excinfo.value)
    assert excinfo.value.path == str(path)
    assert blocker.read_text() == "I am a file"


# --------------------------------------------------------------------------------------------------- integrity


def _truncate_payload_middle(data: bytes, payload: int) -> bytes:
    return data[: payload // 2]


def _truncate_payload_end(data: bytes, payload: int) -> bytes:
    return data[: payload - 1]


def _truncate_inside_record(data: bytes, payload: int) -> bytes:
    return data[: payload + 5]


def _truncate_inside_trailer(data: bytes, payload: int) -> bytes:
    return data[: len(data) - TRAILER.size // 2]


def _truncate_last_byte(data: bytes, payload: int) -> bytes:
    return data[:-1]


def _flip_payload_byte(data: bytes, payload: int) -> bytes:
    damaged = bytearray(data)
    damaged[payload // 2] ^= 0xFF
    return bytes(damaged)


def _flip_record_byte(data: bytes, payload: int) -> bytes:
    start, end = record_bounds(data)
    damaged = bytearray(data)
    damaged[(start + end) // 2] ^= 0xFF
    return bytes(damaged)


def _flip_checksum_digit(data: bytes, payload: int) -> bytes:
    start, end = record_bounds(data)
    at = data.index(b'"checksum": "', start, end) + len('"checksum": "') + 10  # a hex digit of either algorithm
    damaged = bytearray(data)
    damaged[at] = ord("0") if damaged[at] != ord("0") else ord("1")
    return bytes(damaged)


def _flip_payload_size_digit(data: bytes, payload: int) -> bytes:
    start, end = record_bounds(data)
    at = data.index(b'"payload_bytes": ', start, end) + len('"payload_bytes": ')
    damaged = bytearray(data)
    damaged[at] ^= 0x01  # still a digit, so the record still parses
    return bytes(damaged)


def _absurd_record_length(data: bytes, payload: int) -> bytes:
    return data[: -TRAILER.size] + TRAILER.pack(2**62, b"\0" * 8, MAGIC)


def _random_bytes(data: bytes, payload: int) -> bytes:
    return random.Random(1234).randbytes(5000)


def _empty(data: bytes, payload: int) -> bytes:
    return b""


DAMAGES = [
    _truncate_payload_middle,
    _truncate_payload_end,
    _truncate_inside_record,
    _truncate_inside_trailer,
    _truncate_last_byte,
    _flip_payload_byte,
    _flip_record_byte,
    _flip_checksum_digit,
    _flip_payload_size_digit,
    _absurd_record_length,
    _random_bytes,
    _empty,
]


@pytest.mark.parametrize("damage", DAMAGES, ids=[damage.__name__.lstrip("_") for damage in DAMAGES])
def test_damaged_file_fails_verify_and_load(
    damage: Any, saved: tuple[Path, dict[str, Any]], checkpoint_io: SafeCheckpointIO, caplog: pytest.LogCaptureFixture
) -> None:
    path, _ = saved
    data = path.read_bytes()
    record = verify(str(path))
    assert record is not None
    damaged = damage(data, record.payload_bytes)
    assert damaged != data
    path.write_bytes(damaged)

    with pytest.raises(CheckpointIntegrityError) as excinfo:
        verify(str(path))
    assert str(path) in str(excinfo.value)
    assert excinfo.value.path == str(path)

    with pytest.raises(CheckpointIntegrityError) as excinfo:
        checkpoint_io.load_checkpoint(path)
    assert str(path) in str(excinfo.value)


def test_bit_flip_in_record_metadata_is_detected(saved: tuple[Path, dict[str, Any]]) -> None:
    path, _ = saved
    data = path.read_bytes()
    start, end = record_bounds(data)
    at = data.index(b'"global_step": 4', start, end) + len('"global_step": ')
    damaged = bytearray(data)
    damaged[at] ^= 0x01  # "4" -> "5"
    path.write_bytes(bytes(damaged))
    with pytest.raises(CheckpointIntegrityError, match="altered integrity record"):
        verify(str(path))


def test_directory_path_is_an_integrity_error(tmp_path: Path, checkpoint_io: SafeCheckpointIO) -> None:
    directory = tmp_path / "run.ckpt"
    directory.mkdir()
    with pytest.raises(CheckpointIntegrityError) as excinfo:
        verify(str(directory))
    assert str(directory) in str(excinfo.value)
    with pytest.raises(CheckpointIntegrityError) as excinfo:
        checkpoint_io.load_checkpoint(directory)
    assert str(directory) in str(excinfo.value)


def test_missing_path_is_file_not_found(tmp_path: Path, checkpoint_io: SafeCheckpointIO) -> None:
    missing = tmp_path / "nope.ckpt"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        verify(str(missing))
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        checkpoint_io.load_checkpoint(missing)


def test_foreign_checkpoint_verifies_as_none_and_loads_with_warning(
    tmp_path: Path, checkpoint_io: SafeCheckpointIO, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "stock.ckpt"
    checkpoint = {"state_dict": {"w": torch.arange(6.0).reshape(2, 3)}, "global_step": 3, "epoch": 0}
    torch.save(checkpoint, path)
    assert verify(str(path)) is None

    caplog.set_level(logging.WARNING, logger="ddp_strategy")
    loaded = checkpoint_io.load_checkpoint(path)
    assert_same(loaded, checkpoint)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and r.name.startswith("ddp_strategy")]
    assert len(warnings) == 1
    assert str(path) in warnings[0].getMessage()
    assert "no integrity record" in warnings[0].getMessage()


def test_verified_load_logs_no_warning(
    saved: tuple[Path, dict[str, Any]], checkpoint_io: SafeCheckpointIO, caplog: pytest.LogCaptureFixture
) -> None:
    path, _ = saved
    caplog.set_level(logging.WARNING, logger="ddp_strategy")
    checkpoint_io.load_checkpoint(path)
    assert [r for r in caplog.records if r.name.startswith("ddp_strategy")] == []


def test_non_dict_payload_is_rejected(tmp_path: Path, checkpoint_io: SafeCheckpointIO) -> None:
    path = tmp_path / "tensor.ckpt"
    torch.save(torch.ones(3), path)
    with pytest.raises(CheckpointIntegrityError, match="not a Lightning checkpoint dict"):
        checkpoint_io.load_checkpoint(path)


# --------------------------------------------------------------------------------------------------- format versions


def big_checkpoint() -> dict[str, Any]:
    """Tensors above HashingWriter's 1 MiB threshold (their CRC-32 is taken apart from the small writes'), a view."""
    generator = torch.Generator().manual_seed(5)
    base = torch.randn(1024, 1024, generator=generator)  # 4 MiB
    return {
        "state_dict": {
            "big": base,
            "big_view_t": base.t(),  # shares the storage: one zip record
            "other": torch.randn(600_000, generator=generator, dtype=torch.float64),  # 4.6 MiB
            "small": torch.arange(10),
            "half": torch.randn(300_000, generator=generator).half(),  # 600 KB: hashed as it passes
        },
        "global_step": 7,
        "epoch": 2,
    }


def write_format_1_file(path: Path, checkpoint: dict[str, Any]) -> bytes:
    """A checkpoint exactly as ddp_strategy wrote it before format 2 (SHA-256), built by hand from the layout."""
    import io as stdio

    buffer = stdio.BytesIO()
    torch.save(checkpoint, buffer)
    payload = buffer.getvalue()
    record = json.dumps(
        {
            "format_version": 1,
            "payload_bytes": len(payload),
            "checksum": "sha256:" + hashlib.sha256(payload).hexdigest(),
            "global_step": checkpoint.get("global_step"),
            "epoch": checkpoint.get("epoch"),
            "world_size": None,
            "writer": "ddp_strategy 0.1.0",
        },
        sort_keys=True,
    ).encode()
    data = payload + record + TRAILER.pack(len(record), hashlib.sha256(record).digest()[:8], MAGIC)
    path.write_bytes(data)
    return data


def test_format_1_files_still_verify_and_load(tmp_path: Path, checkpoint_io: SafeCheckpointIO) -> None:
    path = tmp_path / "old.ckpt"
    checkpoint = make_checkpoint(global_step=11)
    write_format_1_file(path, checkpoint)
    record = verify(str(path))
    assert record is not None
    assert record.format_version == 1 and record.checksum.startswith("sha256:") and record.global_step == 11
    assert_same(checkpoint_io.load_checkpoint(path), checkpoint)


@pytest.mark.parametrize("damage", [_flip_payload_byte, _truncate_payload_end, _flip_checksum_digit])
def test_damaged_format_1_file_fails(tmp_path: Path, checkpoint_io: SafeCheckpointIO, damage: Any) -> None:
    path = tmp_path / "old.ckpt"
    data = write_format_1_file(path, make_checkpoint())
    start, _ = record_bounds(data)
    path.write_bytes(damage(data, start))
    with pytest.raises(CheckpointIntegrityError, match=re.escape(str(path))):
        verify(str(path))
    with pytest.raises(CheckpointIntegrityError, match=re.escape(str(path))):
        checkpoint_io.load_checkpoint(path)


def test_sha256_writer_writes_format_1(tmp_path: Path) -> None:
    path = tmp_path / "sha.ckpt"
    checkpoint = big_checkpoint()
    SafeCheckpointIO(checksum="sha256").save_checkpoint(checkpoint, path)
    data = path.read_bytes()
    record = verify(str(path))
    assert record is not None and record.format_version == 1
    assert record.checksum == "sha256:" + hashlib.sha256(data[: record.payload_bytes]).hexdigest()
    assert_same(SafeCheckpointIO().load_checkpoint(path), checkpoint)


def test_unknown_checksum_algorithm_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="md5"):
        SafeCheckpointIO(checksum="md5")


def test_newer_format_is_reported_as_newer(tmp_path: Path, saved: tuple[Path, dict[str, Any]]) -> None:
    path, _ = saved
    data = path.read_bytes()
    start, end = record_bounds(data)
    fields = json.loads(data[start:end])
    fields.update(format_version=FORMAT_VERSION + 1, checksum="blake3:00", new_field=[1, 2])
    record = json.dumps(fields, sort_keys=True).encode()
    path.write_bytes(data[:start] + record + TRAILER.pack(len(record), hashlib.sha256(record).digest()[:8], MAGIC))
    with pytest.raises(CheckpointIntegrityError, match=f"uses integrity format {FORMAT_VERSION + 1}, newer"):
        verify(str(path))


@pytest.mark.parametrize(
    ("parallel", "torch_zip_crcs"),
    [(True, True), (False, True), (False, False)],
    ids=["parallel-crc", "from-zip-directory", "read-back"],
)
def test_crc32_of_large_tensors_matches_the_bytes_on_disk(
    tmp_path: Path, checkpoint_io: SafeCheckpointIO, parallel: bool, torch_zip_crcs: bool, monkeypatch
) -> None:
    """The record's CRC-32 is that of the payload's bytes, however the large writes' CRC-32 was obtained.

    ``parallel``: computed on the helper thread beside each write (torch's zip CRCs off; the default). Otherwise,
    as on torch < 2.6 without ``set_crc32_options``: taken from the zip directory's record CRCs, or, with torch's
    zip CRCs switched off (all zero), by reading the large writes back.
    """
    from ddp_strategy.checkpoint import io as checkpoint_io_module

    monkeypatch.setattr(checkpoint_io_module, "_CAN_SKIP_ZIP_CRCS", parallel)
    path = tmp_path / "big.ckpt"
    checkpoint = big_checkpoint()
    previous = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(torch_zip_crcs)
    try:
        checkpoint_io.save_checkpoint(checkpoint, path)
    finally:
        torch.serialization.set_crc32_options(previous)
    data = path.read_bytes()
    record = verify(str(path))
    assert record is not None and record.format_version == 2
    assert record.checksum == f"crc32:{zlib.crc32(data[: record.payload_bytes]):08x}"
    assert_same(checkpoint_io.load_checkpoint(path), checkpoint)
    # damage inside the largest tensor's bytes is caught
    damaged = bytearray(data)
    damaged[record.payload_bytes // 2] ^= 0x10
    path.write_bytes(bytes(damaged))
    with pytest.raises(CheckpointIntegrityError, match="does not match its checksum"):
        verify(str(path))


def test_hashing_writer_without_read_back_hashes_everything(tmp_path: Path) -> None:
    from ddp_strategy.checkpoint.format import HashingWriter

    path = tmp_path / "payload.bin"
    with open(path, "wb") as file:  # write-only: nothing can be read back, so every byte is hashed as it passes
        writer = HashingWriter(file)
        torch.save(big_checkpoint(), writer)  # type: ignore[arg-type]
        checksum = writer.finish()
    assert checksum == f"crc32:{zlib.crc32(path.read_bytes()):08x}"


def test_large_writes_that_are_not_zip_records_are_read_back() -> None:
    import io as stdio

    from ddp_strategy.checkpoint.format import HashingWriter

    buffer = stdio.BytesIO()
    writer = HashingWriter(buffer, defer_large=True, piece_bytes=1 << 20)
    rng = random.Random(3)
    for size in (10, 3 << 20, 7, 2 << 20, 5):  # no zip archive at all: the deferred writes are read back
        writer.write(rng.randbytes(size))
    assert writer.finish() == f"crc32:{zlib.crc32(buffer.getvalue()):08x}"
    assert writer.bytes_written == len(buffer.getvalue())


def test_parallel_crc32_of_large_writes_matches_every_byte() -> None:
    import io as stdio

    from ddp_strategy.checkpoint.format import HashingWriter

    buffer = stdio.BytesIO()
    written: list[int] = []
    writer = HashingWriter(buffer, parallel=True, piece_bytes=1 << 20, on_written=written.append)
    rng = random.Random(4)
    for size in (10, 3 << 20, 7, (2 << 20) + 3, 5, 1 << 20):  # large writes go to the helper thread
        data = bytearray(rng.randbytes(size))
        writer.write(data)
        data[:] = bytes(size)  # the caller reuses its buffer once write() returns: the CRC was taken before
    assert writer.finish() == f"crc32:{zlib.crc32(buffer.getvalue()):08x}"
    assert writer._helper is None  # finish() stopped the helper thread
    assert written[-1] == writer.bytes_written  # early write-back saw the last (large) write's progress


def test_save_switches_torch_zip_crcs_off_only_while_it_writes(tmp_path: Path, checkpoint_io: SafeCheckpointIO):
    seen: list[bool] = []
    real_save = torch.save

    def spying_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        seen.append(torch.serialization.get_crc32_options())
        if "fail" in obj:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(obj, f, *args, **kwargs)

    assert torch.serialization.get_crc32_options() is True
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "save", spying_save)
        checkpoint_io.save_checkpoint(big_checkpoint(), tmp_path / "a.ckpt")
        with pytest.raises(CheckpointWriteError, match="No space left"):  # a failed save restores the setting too
            checkpoint_io.save_checkpoint({"fail": 1}, tmp_path / "b.ckpt")
    assert seen == [False, False]
    assert torch.serialization.get_crc32_options() is True
    import zipfile

    with zipfile.ZipFile(tmp_path / "a.ckpt") as archive:  # records without CRCs; the footer covers the payload
        assert {info.CRC for info in archive.infolist()} == {0}
    record = verify(str(tmp_path / "a.ckpt"))
    assert record is not None and record.checksum.startswith("crc32:")


def test_zip_crcs_are_switched_off_only_in_the_saving_thread(tmp_path: Path):
    import threading

    release = threading.Event()
    inside = threading.Barrier(3)
    real_save = torch.save
    seen: list[bool] = []

    def slow_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        seen.append(torch.serialization.get_crc32_options())
        inside.wait(10)  # both writes are inside their torch.save section at once
        assert release.wait(10)
        real_save(obj, f, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "save", slow_save)
        threads = [
            threading.Thread(
                target=SafeCheckpointIO().save_checkpoint, args=({"x": torch.ones(3)}, tmp_path / f"{i}.ckpt")
            )
            for i in range(2)
        ]
        for thread in threads:
            thread.start()
        inside.wait(10)
        assert torch.serialization.get_crc32_options() is True  # a torch.save here would still write zip CRCs
        release.set()
        for thread in threads:
            thread.join(10)
    assert seen == [False, False]
    assert torch.serialization.get_crc32_options() is True
    assert all(verify(str(tmp_path / f"{i}.ckpt")) is not None for i in range(2))


def test_crc32_combine_matches_zlib() -> None:
    from ddp_strategy.checkpoint.format import crc32_combine

    rng = random.Random(9)
    for first, second in [(0, 0), (0, 5), (5, 0), (1, 1), (1000, 3), (3, 1 << 16), (777, 123_457)]:
        a, b = rng.randbytes(first), rng.randbytes(second)
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_save_starts_write_back_early_and_survives_its_failure(
    tmp_path: Path, checkpoint_io: SafeCheckpointIO, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ddp_strategy.checkpoint import atomic

    calls: list[tuple[int, int, int]] = []

    def record_call(fd: int, offset: int, nbytes: int, flags: int) -> int:
        calls.append((offset, nbytes, flags))
        return 0

    monkeypatch.setattr(atomic, "_sync_file_range", record_call)
    checkpoint = big_checkpoint()
    checkpoint_io.save_checkpoint(checkpoint, tmp_path / "a.ckpt")
    assert calls and all(flags == 2 for _, _, flags in calls)  # SYNC_FILE_RANGE_WRITE only: never waits
    assert [offset for offset, _, _ in calls] == sorted(offset for offset, _, _ in calls)
    assert verify(str(tmp_path / "a.ckpt")) is not None

    failures: list[int] = []

    def failing(fd: int, offset: int, nbytes: int, flags: int) -> int:
        failures.append(offset)
        return -1  # e.g. a filesystem without support: the final fsync does all the work

    monkeypatch.setattr(atomic, "_sync_file_range", failing)
    checkpoint_io.save_checkpoint(checkpoint, tmp_path / "b.ckpt")
    assert len(failures) == 1  # not retried
    assert_same(checkpoint_io.load_checkpoint(tmp_path / "b.ckpt"), checkpoint)


# --------------------------------------------------------------------------------------------------- safe loading


class TouchOnUnpickle:
    """Unpickling it creates ``marker``: a stand-in for a checkpoint that runs code when loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def test_unsafe_checkpoint_is_refused_before_running_anything(tmp_path: Path, checkpoint_io: SafeCheckpointIO) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.ckpt"
    checkpoint_io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "payload": TouchOnUnpickle(marker)}, path)
    assert verify(str(path)) is not None  # a valid integrity record: the refusal is not an integrity failure
    assert not marker.exists()

    for weights_only in (None, True):
        with pytest.raises(UnsafeCheckpointError) as excinfo:
            checkpoint_io.load_checkpoint(path, weights_only=weights_only)
        assert str(path) in str(excinfo.value)
        assert excinfo.value.path == str(path)
        assert not marker.exists()

    loaded = checkpoint_io.load_checkpoint(path, weights_only=False)
    assert marker.exists()  # the object really runs code when unpickled, so the refusal is what stopped it
    assert torch.equal(loaded["state_dict"]["w"], torch.ones(2))


# --------------------------------------------------------------------------------------------------- remote paths


def test_memory_filesystem_round_trip(memory_fs: fsspec.AbstractFileSystem, checkpoint_io: SafeCheckpointIO) -> None:
    url = "memory://ckpts/a.ckpt"
    checkpoint = make_checkpoint(global_step=12, epoch=3)
    checkpoint_io.save_checkpoint(checkpoint, url)
    assert memory_fs.exists("/ckpts/a.ckpt")

    record = verify(url)
    assert record is not None
    assert (record.global_step, record.epoch, record.world_size) == (12, 3, 2)
    data = memory_fs.cat_file("/ckpts/a.ckpt")
    assert record.checksum == f"crc32:{zlib.crc32(data[: record.payload_bytes]):08x}"

    assert_same(checkpoint_io.load_checkpoint(url), checkpoint)

    checkpoint_io.remove_checkpoint(url)
    assert not memory_fs.exists("/ckpts/a.ckpt")


def test_memory_filesystem_truncated_file_fails(
    memory_fs: fsspec.AbstractFileSystem, checkpoint_io: SafeCheckpointIO
) -> None:
    url = "memory://ckpts/b.ckpt"
    checkpoint_io.save_checkpoint(make_checkpoint(), url)
    data = memory_fs.cat_file("/ckpts/b.ckpt")
    memory_fs.pipe_file("/ckpts/b.ckpt", data[:-1])
    with pytest.raises(CheckpointIntegrityError, match=re.escape(url)):
        verify(url)
    with pytest.raises(CheckpointIntegrityError, match=re.escape(url)):
        checkpoint_io.load_checkpoint(url)


# --------------------------------------------------------------------------------------------------- protocol.resolve


def _save_step(directory: Path, name: str, step: int, mtime: float) -> Path:
    path = directory / name
    SafeCheckpointIO().save_checkpoint(make_checkpoint(global_step=step, epoch=step // 2), path)
    os.utime(path, (mtime, mtime))
    return path


def test_resolve_valid_path_returns_it(saved: tuple[Path, dict[str, Any]]) -> None:
    path, _ = saved
    chosen, record = protocol.resolve(str(path))
    assert chosen == str(path)
    assert record is not None
    assert record.global_step == 4


def test_resolve_damaged_last_falls_back_to_newest_valid(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # the step-4 file is *older* on disk and sorts *first* by name, so only the global step picks it
    step4 = _save_step(tmp_path, "a-step=4.ckpt", 4, mtime=1_000_000)
    _save_step(tmp_path, "b-step=2.ckpt", 2, mtime=2_000_000)
    damaged_sibling = _save_step(tmp_path, "c-step=9.ckpt", 9, mtime=3_000_000)
    damaged_sibling.write_bytes(damaged_sibling.read_bytes()[:-1])
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    last = _save_step(tmp_path, "last.ckpt", 6, mtime=4_000_000)
    last.write_bytes(last.read_bytes()[:-20])

    caplog.set_level(logging.WARNING, logger="ddp_strategy")
    chosen, record = protocol.resolve(str(last))

    assert os.path.samefile(chosen, step4)
    assert record is not None
    assert record.global_step == 4
    warnings = [r.getMessage() for r in caplog.records if r.name.startswith("ddp_strategy")]
    assert len(warnings) == 1
    assert str(last) in warnings[0]
    assert "a-step=4.ckpt" in warnings[0]


def test_resolve_damaged_non_last_path_raises(tmp_path: Path) -> None:
    _save_step(tmp_path, "b-step=2.ckpt", 2, mtime=1_000_000)
    path = _save_step(tmp_path, "epoch=3-step=6.ckpt", 6, mtime=2_000_000)
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(CheckpointIntegrityError) as excinfo:
        protocol.resolve(str(path))
    assert str(path) in str(excinfo.value)


def test_resolve_damaged_last_without_fallback_raises(tmp_path: Path) -> None:
    last = _save_step(tmp_path, "last.ckpt", 6, mtime=1_000_000)
    last.write_bytes(last.read_bytes()[:-1])
    other = _save_step(tmp_path, "epoch=0-step=2.ckpt", 2, mtime=2_000_000)  # damaged too: not a fallback
    other.write_bytes(other.read_bytes()[: len(other.read_bytes()) // 2])
    with pytest.raises(CheckpointIntegrityError) as excinfo:
        protocol.resolve(str(last))
    message = str(excinfo.value)
    assert str(last) in message
    assert "No other valid checkpoint" in message
    assert excinfo.value.path == str(last)


def test_resolve_missing_path_raises_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        protocol.resolve(str(tmp_path / "last.ckpt"))


# --------------------------------------------------------------------------------------------------- RNG state


@pytest.fixture
def seeded() -> Iterator[None]:
    """Seed all generators and leave a cached Gaussian in Python's and NumPy's, so those paths are exercised."""
    saved_state = rng.capture()
    random.seed(11)
    np.random.seed(11)
    torch.manual_seed(11)
    random.gauss(0.0, 1.0)
    np.random.randn(1)
    yield
    rng.restore(saved_state)


@pytest.mark.usefixtures("seeded")
def test_capture_restore_repeats_the_same_numbers() -> None:
    state = rng.capture()
    first = draw()
    assert draw()[0] != first[0]  # the generators really advance
    rng.restore(state)
    assert_same_draws(first, draw())


@pytest.mark.usefixtures("seeded")
def test_rng_state_survives_a_weights_only_round_trip(tmp_path: Path, checkpoint_io: SafeCheckpointIO) -> None:
    state = rng.capture()
    assert isinstance(state["numpy"][1], torch.Tensor)
    assert state["numpy"][3] == 1  # a cached Gaussian is part of the state
    assert state["python"][2] is not None
    first = draw()

    path = tmp_path / "rng.ckpt"
    checkpoint_io.save_checkpoint({"ddp_strategy": {"world_size": 1, "rng_states": [state]}}, path)
    loaded = checkpoint_io.load_checkpoint(path, weights_only=True)
    draw()
    rng.restore(loaded["ddp_strategy"]["rng_states"][0])
    assert_same_draws(first, draw())


@pytest.mark.usefixtures("seeded")
def test_reseed_is_deterministic_and_rank_dependent() -> None:
    seed_a = rng.reseed(7, 1)
    draws_a = draw()
    seed_b = rng.reseed(7, 1)
    draws_b = draw()
    seed_rank0 = rng.reseed(7, 0)
    draws_rank0 = draw()
    seed_step8 = rng.reseed(8, 1)
    assert isinstance(seed_a, int)
    assert seed_a == seed_b
    assert_same_draws(draws_a, draws_b)
    assert seed_rank0 != seed_a
    assert seed_step8 != seed_a
    assert draws_rank0[0] != draws_a[0]
    assert draws_rank0[1] != draws_a[1]
    assert not torch.equal(draws_rank0[2], draws_a[2])


def _two_rank_checkpoint() -> tuple[dict[str, Any], list[Any]]:
    states, expected = [], []
    for seed in (100, 200):
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        states.append(rng.capture())
        expected.append(draw())
    checkpoint = {"global_step": 42, "ddp_strategy": {"world_size": 2, "rng_states": states}}
    return checkpoint, expected


@pytest.mark.usefixtures("seeded")
def test_restore_rng_same_world_size_restores_this_ranks_state(tmp_path: Path, checkpoint_io: SafeCheckpointIO) -> None:
    checkpoint, expected = _two_rank_checkpoint()
    path = tmp_path / "two.ckpt"
    checkpoint_io.save_checkpoint(checkpoint, path)
    loaded = checkpoint_io.load_checkpoint(path)
    for rank in (1, 0):
        draw()
        assert protocol.restore_rng(loaded, rank=rank, world_size=2) is None
        assert_same_draws(expected[rank], draw())


@pytest.mark.usefixtures("seeded")
def test_restore_rng_other_world_size_reseeds_and_warns() -> None:
    checkpoint, expected = _two_rank_checkpoint()
    warning = protocol.restore_rng(checkpoint, rank=1, world_size=3)
    assert warning is not None
    assert "2 ranks" in warning
    assert "resumed on 3" in warning
    after = draw()
    rng.reseed(42, 1)  # what the docs promise: seeded from (global_step, rank)
    assert_same_draws(after, draw())
    assert after[0] != expected[1][0]


@pytest.mark.usefixtures("seeded")
def test_restore_rng_without_section_warns_and_leaves_generators_alone() -> None:
    before = rng.capture()
    warning = protocol.restore_rng({"global_step": 5, "state_dict": {}}, rank=0, world_size=2)
    assert warning is not None
    assert "no per-rank RNG state" in warning
    after = draw()
    rng.restore(before)
    assert_same_draws(after, draw())


# --------------------------------------------------------------------------------------------------- mid-epoch position


def _with_progress(epoch: tuple[int, int, int, int], batches: int | None = 5) -> dict[str, Any]:
    ready, started, processed, completed = epoch
    total = {"ready": ready, "started": started, "processed": processed, "completed": completed}
    fit_loop: dict[str, Any] = {"epoch_progress": {"total": total, "current": dict(total)}}
    if batches is not None:
        current = {"ready": batches, "started": batches, "processed": batches, "completed": batches - 1}
        fit_loop["epoch_loop.batch_progress"] = {"total": dict(current), "current": current}
    return {"loops": {"fit_loop": fit_loop}}


@pytest.mark.parametrize(
    ("epoch", "expected"),
    [
        ((1, 1, 0, 0), 5),  # first epoch, saved after 5 batches
        ((3, 3, 2, 2), 5),  # third epoch started, two finished
        ((1, 1, 1, 1), 0),  # saved at the end of an epoch
        ((2, 2, 2, 1), 0),  # processed but not completed: an end-of-epoch save
        ((0, 0, 0, 0), 0),  # nothing started
        ((2, 1, 0, 0), 0),  # ready but not started
    ],
)
def test_batches_done_mid_epoch(epoch: tuple[int, int, int, int], expected: int) -> None:
    assert protocol.batches_done_mid_epoch(_with_progress(epoch)) == expected


@pytest.mark.parametrize(
    "checkpoint",
    [
        {},
        {"loops": {}},
        {"loops": {"fit_loop": {}}},
        {"loops": {"fit_loop": {"epoch_progress": {}}}},
        {"loops": {"fit_loop": {"epoch_progress": {"total": {"ready": 1, "started": 1}}}}},
        {"loops": None},
        _with_progress((1, 1, 0, 0), batches=None),  # mid-epoch, but no batch progress recorded
    ],
)
def test_batches_done_mid_epoch_missing_keys_is_zero(checkpoint: dict[str, Any]) -> None:
    assert protocol.batches_done_mid_epoch(checkpoint) == 0


class StepModule(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0]).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.filterwarnings("ignore")
def test_real_lightning_checkpoints_through_safe_checkpoint_io(tmp_path: Path) -> None:
    """A stock Trainer with ``plugins=[SafeCheckpointIO()]``: verified files, and Lightning's real loop layout."""
    torch.manual_seed(0)
    loader = DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=2)  # 4 batches per epoch
    checkpoints = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1, filename="{epoch}-{step}")
    trainer = Trainer(
        max_epochs=2,
        accelerator="cpu",
        devices=1,
        plugins=[SafeCheckpointIO()],
        callbacks=[checkpoints],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(StepModule(), loader)
    trainer.save_checkpoint(tmp_path / "final.ckpt")

    expected = {"epoch=0-step=3.ckpt": (3, 3), "epoch=1-step=6.ckpt": (6, 2), "final.ckpt": (8, 0)}
    assert sorted(os.listdir(tmp_path)) == sorted(expected)
    for name, (step, batches) in expected.items():
        path = tmp_path / name
        record = verify(str(path))
        assert record is not None, name
        assert record.global_step == step, name
        assert protocol.batches_done_mid_epoch(SafeCheckpointIO().load_checkpoint(path)) == batches, name


def test_temporary_files_of_dead_writers_are_removed_but_live_ones_kept(tmp_path: Path) -> None:
    import os
    import socket
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    host = socket.gethostname()
    stale = tmp_path / f".last.ckpt.tmp-{host}-{dead_pid}-deadbeef"
    live = tmp_path / f".last.ckpt.tmp-{host}-{os.getpid()}-cafecafe"
    other_host = tmp_path / f".last.ckpt.tmp-otherhost-{dead_pid}-00000000"
    stale_other_name = tmp_path / f".epoch=0-step=3.ckpt.tmp-{host}-{dead_pid}-0badf00d"
    for p in (stale, live, other_host, stale_other_name):
        p.write_bytes(b"partial")
    SafeCheckpointIO().save_checkpoint({"x": torch.ones(2)}, tmp_path / "last.ckpt")
    assert not stale.exists() and not stale_other_name.exists()
    assert live.exists() and other_host.exists()
    assert verify(str(tmp_path / "last.ckpt")) is not None


# --------------------------------------------------------------------------- torch's weights-only switches
class DataDirModule(LightningModule):
    """A realistic module whose saved hyper-parameters hold a pickled object (a ``pathlib.Path``)."""

    def __init__(self, data_dir: pathlib.Path = pathlib.Path("/data/cifar10")) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.lin = nn.Linear(2, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.lin(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit_data_dir_module(ckpt_path: Path | None = None, *, safe: bool = True, max_epochs: int = 1) -> Trainer:
    trainer = Trainer(
        max_epochs=max_epochs,
        accelerator="cpu",
        devices=1,
        plugins=[SafeCheckpointIO()] if safe else [],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(DataDirModule(), DataLoader(TensorDataset(torch.randn(4, 2)), batch_size=2), ckpt_path=ckpt_path)
    return trainer


@pytest.fixture
def path_hparam_checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "data_dir.ckpt"
    fit_data_dir_module().save_checkpoint(path)
    return path


def test_torch_force_no_weights_only_load_lets_pickled_objects_load_with_a_warning_as_in_torch_load(
    path_hparam_checkpoint: Path, checkpoint_io: SafeCheckpointIO, saved: tuple[Path, dict[str, Any]], monkeypatch
) -> None:
    path = path_hparam_checkpoint
    with pytest.raises(UnsafeCheckpointError, match="TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1"):
        checkpoint_io.load_checkpoint(path)  # refusing pickled objects stays the default
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.warns(UserWarning, match="because TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD is set and weights_only was not"):
        loaded = checkpoint_io.load_checkpoint(path)
    assert loaded["hyper_parameters"]["data_dir"] == pathlib.Path("/data/cifar10")
    with pytest.warns(UserWarning, match="TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"):  # torch.load decides the same
        assert torch.load(path)["hyper_parameters"]["data_dir"] == pathlib.Path("/data/cifar10")
    # an explicit weights_only=True still wins over the variable, in torch.load as here
    with pytest.raises(UnsafeCheckpointError):
        checkpoint_io.load_checkpoint(path, weights_only=True)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=True)
    # a file without pickled objects loads as before, without a warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_same(checkpoint_io.load_checkpoint(saved[0]), saved[1])
    # end to end, as the user of the issue: resuming fit(ckpt_path=...) works, with the warning, as in stock Lightning
    with pytest.warns(UserWarning, match="TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"):
        assert fit_data_dir_module(path, max_epochs=2).global_step == 4
    assert fit_data_dir_module(path, safe=False, max_epochs=2).global_step == 4


def test_torch_force_weights_only_load_refuses_pickled_objects_even_with_weights_only_false(
    path_hparam_checkpoint: Path, checkpoint_io: SafeCheckpointIO, monkeypatch
) -> None:
    monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "true")
    with pytest.raises(UnsafeCheckpointError, match="TORCH_FORCE_WEIGHTS_ONLY_LOAD is set, which makes every load"):
        checkpoint_io.load_checkpoint(path_hparam_checkpoint, weights_only=False)
    with pytest.raises(pickle.UnpicklingError):  # torch.load decides the same
        torch.load(path_hparam_checkpoint, weights_only=False)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")  # both: an error, in torch.load as here
    with pytest.raises(RuntimeError, match="Only one of `TORCH_FORCE_WEIGHTS_ONLY_LOAD` or"):
        checkpoint_io.load_checkpoint(path_hparam_checkpoint)
    with pytest.raises(RuntimeError, match="Only one of `TORCH_FORCE_WEIGHTS_ONLY_LOAD` or"):
        torch.load(path_hparam_checkpoint)


@pytest.mark.parametrize(
    ("force", "force_no", "weights_only", "expected"),
    [
        (None, None, None, (True, None)),
        (None, None, False, (False, None)),
        ("1", None, False, (True, "TORCH_FORCE_WEIGHTS_ONLY_LOAD")),
        ("YES", None, None, (True, None)),
        ("0", None, False, (False, None)),
        (None, "y", None, (False, "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")),
        (None, "True", True, (True, None)),
        (None, "no", None, (True, None)),
    ],
)
def test_resolve_weights_only_follows_torch_load(force, force_no, weights_only, expected, monkeypatch) -> None:
    for name, value in (("TORCH_FORCE_WEIGHTS_ONLY_LOAD", force), ("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", force_no)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert ddp_io.resolve_weights_only(weights_only) == expected


# ------------------------------------------------------------------------- protocol: where a step checkpoint resumes
def _fit_loop_state(
    *, epochs: tuple[int, int, int, int], batches: tuple[int, int, int, int], done_in_epoch: int, last: bool
) -> dict[str, Any]:
    """A checkpoint's ``loops`` entry; epoch and batch totals as (ready, started, processed, completed)."""

    def progress(ready: int, started: int, processed: int, completed: int) -> dict[str, int]:
        return {"ready": ready, "started": started, "processed": processed, "completed": completed}

    return {
        "loops": {
            "fit_loop": {
                "epoch_progress": {"total": progress(*epochs), "current": progress(*epochs)},
                "epoch_loop.batch_progress": {
                    "total": progress(*batches),
                    "current": progress(done_in_epoch, done_in_epoch, done_in_epoch, done_in_epoch - 1),
                    "is_last_batch": last,
                },
            }
        }
    }


def test_step_checkpoint_in_the_middle_of_an_epoch_skips_the_batches_done():
    # saved in on_train_batch_end of batch 2 of 4 in epoch 1 (a ModelCheckpoint every 6 steps, or a preemption stop)
    mid = _fit_loop_state(epochs=(2, 2, 1, 1), batches=(6, 6, 6, 5), done_in_epoch=2, last=False)
    assert protocol.batches_done_mid_epoch(mid) == 2
    assert not protocol.saved_after_last_batch(mid)


@pytest.mark.compat
def test_step_checkpoint_after_an_epochs_last_batch_resumes_with_the_next_epoch():
    # saved in on_train_batch_end of batch 4 of 4 in epoch 1: Lightning >= 2.5 counts epoch 1 as done on restore,
    # so nothing is skipped (skipping 4 batches of epoch 2 lost a whole epoch of training, found in CI 2026-11-25)
    last = _fit_loop_state(epochs=(2, 2, 1, 1), batches=(8, 8, 8, 7), done_in_epoch=4, last=True)
    assert protocol.saved_after_last_batch(last)
    assert protocol.batches_done_mid_epoch(last, last_batch_ends_epoch=True) == 0
    # Lightning 2.4 re-enters epoch 1 instead, with its 4 batches done: they are skipped there
    assert protocol.batches_done_mid_epoch(last, last_batch_ends_epoch=False) == 4


def test_epoch_end_checkpoint_skips_nothing():
    done = _fit_loop_state(epochs=(2, 2, 2, 1), batches=(8, 8, 8, 8), done_in_epoch=4, last=True)
    assert protocol.batches_done_mid_epoch(done) == 0
    assert not protocol.saved_after_last_batch(done)


@pytest.mark.compat
def test_the_installed_lightning_resumes_a_last_batch_checkpoint_with_the_next_epoch():
    from ddp_strategy._compat.lightning import LAST_BATCH_CHECKPOINT_RESUMES_NEXT_EPOCH

    major_minor = tuple(int(part) for part in lightning.__version__.split(".")[:2])
    assert (major_minor >= (2, 5)) == LAST_BATCH_CHECKPOINT_RESUMES_NEXT_EPOCH


def test_resume_sampler_skip_belongs_to_its_epoch():
    from torch.utils.data import DistributedSampler

    from ddp_strategy.sampling import ResumeSampler

    data = list(range(8))
    inner = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=3)  # type: ignore[arg-type]
    inner.set_epoch(1)
    epoch1 = list(inner)
    same = ResumeSampler(inner, skip=4, epoch=1)
    same.set_epoch(1)
    assert list(same) == epoch1[4:]  # the saved epoch: its first 4 indices were trained on
    assert list(same) == epoch1  # only the first iteration skips
    # Lightning 2.4 ends a restored epoch with nothing left without drawing from the loader: the next epoch is whole
    moved = ResumeSampler(DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=3), skip=4, epoch=1)  # type: ignore[arg-type]
    moved.set_epoch(2)
    inner.set_epoch(2)
    assert list(moved) == list(inner)
