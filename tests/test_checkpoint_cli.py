"""``ddp-ckpt`` (inspect / verify / export) and ``ddp_strategy.checkpoint.export`` on real files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from ddp_strategy.checkpoint.cli import main
from ddp_strategy.checkpoint.export import (
    export,
    load_into,
    load_plain_state_dict,
    plain_state_dict,
    prefix_hint,
)
from ddp_strategy.checkpoint.format import verify
from ddp_strategy.checkpoint.io import SafeCheckpointIO
from ddp_strategy.errors import CheckpointIntegrityError, UnsafeCheckpointError


def make_net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    with torch.no_grad():  # non-default buffers, so a skipped buffer would show
        for buffer in net.buffers():
            buffer.copy_(torch.randint(1, 9, buffer.shape))
    return net


def assert_same_weights(loaded: nn.Module, reference: nn.Module) -> None:
    expected = reference.state_dict()
    actual = loaded.state_dict()
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(actual[key], value), key


class NotATensor:
    """Pickled by reference, so ``weights_only`` loading must refuse it."""


@pytest.fixture
def net() -> nn.Sequential:
    return make_net()


@pytest.fixture
def lightning_ckpt(tmp_path: Path, net: nn.Sequential) -> Path:
    path = tmp_path / "epoch=1-step=3.ckpt"
    checkpoint = {
        "state_dict": {f"net.{key}": value for key, value in net.state_dict().items()},
        "global_step": 3,
        "epoch": 1,
        "ddp_strategy": {"world_size": 2, "rng_states": [{"torch": torch.get_rng_state()}, {"torch": torch.zeros(1)}]},
    }
    SafeCheckpointIO().save_checkpoint(checkpoint, path)
    return path


def save_prefixed(path: Path, net: nn.Module, prefix: str) -> Path:
    torch.save({prefix + key: value for key, value in net.state_dict().items()}, path)
    return path


@pytest.fixture
def plain_pt(tmp_path: Path, net: nn.Sequential) -> Path:
    return save_prefixed(tmp_path / "plain.pt", net, "")


@pytest.fixture
def ddp_pt(tmp_path: Path, net: nn.Sequential) -> Path:
    return save_prefixed(tmp_path / "ddp.pt", net, "module.")


@pytest.fixture
def compiled_pt(tmp_path: Path, net: nn.Sequential) -> Path:
    return save_prefixed(tmp_path / "compiled.pt", net, "_orig_mod.")


# ---------------------------------------------------------------------------------------------- damaged inputs
def _truncate_half(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _truncate_last_byte(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-1])


def _flip_payload_byte(path: Path) -> None:
    record = verify(str(path))
    assert record is not None
    data = bytearray(path.read_bytes())
    data[record.payload_bytes // 2] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE: dict[str, Callable[[Path], None]] = {
    "truncated-half": _truncate_half,
    "truncated-last-byte": _truncate_last_byte,
    "flipped-payload-byte": _flip_payload_byte,
}


def damaged_path(kind: str, lightning_ckpt: Path, tmp_path: Path) -> Path:
    if kind in DAMAGE:
        DAMAGE[kind](lightning_ckpt)
        return lightning_ckpt
    if kind == "directory":
        (tmp_path / "ckpts").mkdir()
        return tmp_path / "ckpts"
    if kind == "random-bytes":
        path = tmp_path / "random.ckpt"
        path.write_bytes(os.urandom(4096))
        return path
    assert kind == "missing"
    return tmp_path / "missing.ckpt"


BAD_KINDS = ["truncated-half", "truncated-last-byte", "flipped-payload-byte", "directory", "random-bytes", "missing"]


# ---------------------------------------------------------------------------------------------- verify
def test_verify_ok_line(lightning_ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(lightning_ckpt)]) == 0
    assert capsys.readouterr().out.splitlines() == [f"OK {lightning_ckpt} (step 3, epoch 1, world size 2)"]


def test_verify_foreign_file_is_no_record_and_fails_only_with_strict(
    plain_pt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["verify", str(plain_pt)]) == 0
    assert capsys.readouterr().out.splitlines() == [f"NO-RECORD {plain_pt} (complete file without an integrity record)"]
    assert main(["verify", "--strict", str(plain_pt)]) == 1
    assert capsys.readouterr().out.startswith(f"NO-RECORD {plain_pt}")


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_verify_invalid(kind: str, lightning_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = damaged_path(kind, lightning_ckpt, tmp_path)
    assert main(["verify", str(path)]) == 1
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"INVALID {path}: "), lines
    assert len(lines[0]) > len(f"INVALID {path}: ") + 10  # carries a reason
    assert err == ""


def test_verify_several_files_reports_each_and_fails_if_any_is_invalid(
    lightning_ckpt: Path, plain_pt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing.ckpt"
    assert main(["verify", str(lightning_ckpt), str(plain_pt), str(missing)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["OK", "NO-RECORD", "INVALID"]
    assert "does not exist" in lines[2]


def test_verify_safetensors_export(lightning_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "model.safetensors"
    export(str(lightning_ckpt), str(out), strip_prefix="net.")
    assert main(["verify", str(out)]) == 0
    assert capsys.readouterr().out.startswith(f"NO-RECORD {out}")
    _truncate_last_byte(out)
    assert main(["verify", str(out)]) == 1
    assert capsys.readouterr().out.startswith(f"INVALID {out}: ")


# ---------------------------------------------------------------------------------------------- inspect
def inspect_json(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    code = main(["inspect", "--json", str(path)])
    document: dict[str, Any] = json.loads(capsys.readouterr().out)
    return code, document


def test_inspect_json_lightning_checkpoint(
    lightning_ckpt: Path, net: nn.Sequential, capsys: pytest.CaptureFixture[str]
) -> None:
    code, doc = inspect_json(lightning_ckpt, capsys)
    assert code == 0
    assert doc["integrity"]["status"] == "verified"
    record = doc["integrity"]["record"]
    assert record["global_step"] == 3 and record["epoch"] == 1 and record["world_size"] == 2
    assert record["checksum"].startswith("crc32:")
    assert record["writer"].startswith("ddp_strategy ")
    assert (doc["global_step"], doc["epoch"], doc["world_size"]) == (3, 1, 2)
    assert doc["kind"] == "lightning"
    assert doc["top_level_keys"] == ["state_dict", "global_step", "epoch", "ddp_strategy"]
    assert doc["rng_states"] == {"ranks": 2, "present": [True, True]}
    state = net.state_dict()
    assert [row["name"] for row in doc["tensors"]] == [f"net.{key}" for key in state]
    first = doc["tensors"][0]
    assert first == {"name": "net.0.weight", "shape": [4, 3], "dtype": "float32", "numel": 12, "bytes": 48}
    assert doc["total_parameters"] == sum(t.numel() for t in state.values())
    assert doc["total_bytes"] == sum(t.numel() * t.element_size() for t in state.values())


def test_inspect_json_foreign_state_dict(ddp_pt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, doc = inspect_json(ddp_pt, capsys)
    assert code == 0
    assert doc["integrity"]["status"] == "no-record"
    assert doc["kind"] == "state_dict"
    assert doc["rng_states"] is None
    assert doc["global_step"] is None and doc["world_size"] is None
    assert doc["tensors"][0]["name"] == "module.0.weight"


def test_inspect_reports_missing_rng_state_of_a_rank(
    tmp_path: Path, net: nn.Sequential, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "partial.ckpt"
    checkpoint = {"state_dict": net.state_dict(), "ddp_strategy": {"rng_states": [{"torch": torch.zeros(1)}, {}]}}
    SafeCheckpointIO().save_checkpoint(checkpoint, path)
    assert inspect_json(path, capsys)[1]["rng_states"] == {"ranks": 2, "present": [True, False]}
    assert main(["inspect", str(path)]) == 0
    assert "2 ranks, present for ranks 0; missing for ranks 1" in capsys.readouterr().out


def test_inspect_text(lightning_ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(lightning_ckpt)]) == 0
    out = capsys.readouterr().out
    assert "integrity:      verified (format 2" in out
    assert "global_step:    3" in out
    assert "epoch:          1" in out
    assert "world_size:     2" in out
    assert "rng states:     2 ranks, present for ranks 0, 1" in out
    assert "state_dict:     9 tensors, 43 parameters" in out
    table = out.split("\n\n", 1)[1].splitlines()
    assert table[0].split() == ["name", "shape", "dtype", "size"]
    assert table[1].split() == ["net.0.weight", "(4,", "3)", "float32", "48", "B"]


@pytest.mark.parametrize("kind", BAD_KINDS[:-1])
def test_inspect_invalid_file(
    kind: str, lightning_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = damaged_path(kind, lightning_ckpt, tmp_path)
    code, doc = inspect_json(path, capsys)
    assert code == 1
    assert doc["integrity"]["status"] == "invalid"
    assert doc["integrity"]["error"]
    assert "tensors" not in doc


def test_inspect_missing_file_is_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(tmp_path / "nope.ckpt")]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1
    assert err.startswith("ddp-ckpt: error: ") and "does not exist" in err


def test_inspect_refuses_pickled_code_unless_trusted(
    tmp_path: Path, net: nn.Sequential, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "unsafe.ckpt"
    SafeCheckpointIO().save_checkpoint({"state_dict": net.state_dict(), "hparams": NotATensor()}, path)
    assert main(["inspect", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ddp-ckpt: error: ") and "--trust" in err and "Traceback" not in err
    assert main(["inspect", "--trust", str(path)]) == 0
    assert "hparams" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------- export
def load_exported(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        return load_file(str(path))
    loaded: dict[str, torch.Tensor] = torch.load(path, weights_only=True)
    return loaded


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
@pytest.mark.parametrize(
    ("source", "strip"), [("lightning_ckpt", ["--strip-prefix", "net."]), ("ddp_pt", []), ("compiled_pt", [])]
)
def test_export_output_loads_into_plain_model_strictly(
    suffix: str,
    source: str,
    strip: list[str],
    net: nn.Sequential,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path: Path = request.getfixturevalue(source)
    out = tmp_path / f"exported{suffix}"
    assert main(["export", str(path), str(out), *strip]) == 0
    assert capsys.readouterr().out.strip() == (
        f"wrote 9 tensors (176 B of tensor data, {out.stat().st_size} bytes on disk) to {out}"
    )
    fresh = make_net(seed=1)
    assert not torch.equal(fresh.state_dict()["0.weight"], net.state_dict()["0.weight"])
    fresh.load_state_dict(load_exported(out), strict=True)
    assert_same_weights(fresh, net)
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []


def test_export_keeps_lightning_attribute_prefix_without_strip_prefix(lightning_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "kept.pt"
    state = export(str(lightning_ckpt), str(out))
    assert all(key.startswith("net.") for key in state)
    assert load_exported(out).keys() == state.keys()


def test_export_safetensors_handles_shared_and_non_contiguous_tensors(tmp_path: Path) -> None:
    weight = torch.randn(5, 3)
    source = tmp_path / "tied.pt"
    torch.save({"embed.weight": weight, "head.weight": weight, "proj.weight": weight.t()}, source)
    out = tmp_path / "tied.safetensors"
    export(str(source), str(out))
    loaded = load_file(str(out))
    assert torch.equal(loaded["embed.weight"], weight)
    assert torch.equal(loaded["head.weight"], weight)
    assert torch.equal(loaded["proj.weight"], weight.t())


def test_export_refuses_to_overwrite_its_input(lightning_ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = lightning_ckpt.read_bytes()
    assert main(["export", str(lightning_ckpt), str(lightning_ckpt)]) == 1
    assert "over itself" in capsys.readouterr().err
    assert lightning_ckpt.read_bytes() == before
    same_file_other_spelling = lightning_ckpt.parent / "." / lightning_ckpt.name
    with pytest.raises(ValueError, match="over itself"):
        export(str(lightning_ckpt), str(same_file_other_spelling))


def test_export_failure_leaves_previous_output_and_no_temp_file(
    ddp_pt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out.pt"
    out.write_bytes(b"previous")

    def broken_save(obj: object, f: Any) -> None:
        f.write(b"partial")  # the export streams into an open temporary file
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        export(str(ddp_pt), str(out))
    assert out.read_bytes() == b"previous"
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []


def test_export_of_a_damaged_checkpoint_fails_without_output(
    lightning_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _flip_payload_byte(lightning_ckpt)
    out = tmp_path / "out.safetensors"
    assert main(["export", str(lightning_ckpt), str(out), "--strip-prefix", "net."]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ddp-ckpt: error: ") and "checksum" in err
    assert not out.exists()


def test_export_wrong_strip_prefix_names_the_shared_one(
    lightning_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["export", str(lightning_ckpt), str(tmp_path / "o.pt"), "--strip-prefix", "model."]) == 1
    err = capsys.readouterr().err
    assert "strip_prefix='model.'" in err and "'net.'" in err


# ---------------------------------------------------------------------------------------------- library API
@pytest.mark.parametrize("prefix", ["module.", "_orig_mod.", "module._orig_mod.", "_orig_mod.module."])
def test_plain_state_dict_strips_wrapper_prefixes(prefix: str, net: nn.Sequential) -> None:
    state = net.state_dict()
    plain = plain_state_dict({prefix + key: value for key, value in state.items()})
    assert list(plain) == list(state)


def test_plain_state_dict_strip_prefix_under_ddp_wrapper(net: nn.Sequential) -> None:
    wrapped = {f"module.net.{key}": value for key, value in net.state_dict().items()}
    assert list(plain_state_dict(wrapped, strip_prefix="net")) == list(net.state_dict())
    assert list(plain_state_dict(wrapped, strip_prefix="module.net.")) == list(net.state_dict())


def test_plain_state_dict_keeps_a_prefix_not_shared_by_every_key() -> None:
    state = {"module.weight": torch.zeros(1), "other.weight": torch.ones(1)}
    assert list(plain_state_dict(state)) == ["module.weight", "other.weight"]


def test_plain_state_dict_rejects_non_tensors() -> None:
    with pytest.raises(ValueError, match=r"'lr' is a float, not a tensor"):
        plain_state_dict({"weight": torch.zeros(1), "lr": 0.1})
    with pytest.raises(ValueError, match="no tensors"):
        plain_state_dict({"state_dict": {}})


def test_load_into_ddp_prefixed_file(ddp_pt: Path, net: nn.Sequential) -> None:
    fresh = make_net(seed=1)
    load_into(fresh, str(ddp_pt))
    assert_same_weights(fresh, net)


def test_load_into_lightning_checkpoint_with_strip_prefix(lightning_ckpt: Path, net: nn.Sequential) -> None:
    fresh = make_net(seed=1)
    load_into(fresh, str(lightning_ckpt), strip_prefix="net.")
    assert_same_weights(fresh, net)


def test_load_into_mismatch_names_keys_and_the_prefix_to_strip(lightning_ckpt: Path) -> None:
    with pytest.raises(ValueError) as info:
        load_into(make_net(seed=1), str(lightning_ckpt))
    message = str(info.value)
    assert "9 missing" in message and "0.weight" in message
    assert "9 unexpected" in message and "net.0.weight" in message
    assert "strip_prefix='net.'" in message


def test_load_into_lists_at_most_ten_keys(tmp_path: Path) -> None:
    big = nn.Sequential(*[nn.Linear(1, 1) for _ in range(12)])  # 24 keys
    path = save_prefixed(tmp_path / "big.pt", big, "")
    with pytest.raises(ValueError) as info:
        load_into(nn.Linear(1, 1), str(path))
    message = str(info.value)
    assert "24 unexpected" in message and "... and 14 more" in message
    assert "strip_prefix=" not in message


def test_load_into_non_strict_ignores_missing_keys_but_not_shapes(ddp_pt: Path, net: nn.Sequential) -> None:
    bigger = nn.Sequential(*make_net(seed=1), nn.ReLU(), nn.Linear(2, 2))
    load_into(bigger, str(ddp_pt), strict=False)
    assert torch.equal(bigger.state_dict()["0.weight"], net.state_dict()["0.weight"])
    with pytest.raises(ValueError, match="size mismatch"):
        load_into(nn.Sequential(nn.Linear(3, 5), nn.BatchNorm1d(4), nn.Linear(4, 2)), str(ddp_pt), strict=False)


def test_prefix_hint_model_side() -> None:
    assert "submodule at 'net'" in prefix_hint(["0.weight"], ["net.0.weight"])
    assert prefix_hint(["a.weight"], ["b.weight"]) == ""


def test_load_plain_state_dict_reads_safetensors_and_verifies(lightning_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "model.safetensors"
    written = export(str(lightning_ckpt), str(out), strip_prefix="net.")
    loaded = load_plain_state_dict(str(out))
    assert loaded.keys() == written.keys()
    assert all(torch.equal(loaded[key], written[key]) for key in written)
    _truncate_half(lightning_ckpt)
    with pytest.raises(CheckpointIntegrityError):
        load_plain_state_dict(str(lightning_ckpt))


def test_load_plain_state_dict_refuses_pickled_code(tmp_path: Path, net: nn.Sequential) -> None:
    path = tmp_path / "unsafe.ckpt"
    SafeCheckpointIO().save_checkpoint({"state_dict": net.state_dict(), "hparams": NotATensor()}, path)
    with pytest.raises(UnsafeCheckpointError):
        load_plain_state_dict(str(path))
    assert list(load_plain_state_dict(str(path), weights_only=False)) == list(net.state_dict())


# ---------------------------------------------------------------------------------------------- console script
def test_console_script(lightning_ckpt: Path, tmp_path: Path) -> None:
    script = Path(sys.executable).parent / "ddp-ckpt"
    assert script.exists(), f"{script} missing: run pip install -e . to install the console script"
    missing = tmp_path / "missing.ckpt"
    run = subprocess.run(
        [str(script), "verify", str(lightning_ckpt), str(missing)], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 1, run
    assert run.stdout.splitlines() == [
        f"OK {lightning_ckpt} (step 3, epoch 1, world size 2)",
        f"INVALID {missing}: Checkpoint '{missing}' does not exist.",
    ]
    assert "Traceback" not in run.stderr
