from __future__ import annotations

import pytest
import torch
from torch import nn

from ddp_strategy import fingerprint as fp
from ddp_strategy.fingerprint import fingerprint_module, fingerprint_tensors, named_tensors


def host_digest(t: torch.Tensor) -> tuple[int, int] | None:
    """The path used for CPU tensors (CRC-32 of the bytes)."""
    return fingerprint_tensors([("t", "parameter", t)])[0].digest


def device_digest(t: torch.Tensor) -> tuple[int, int]:
    """The path used for accelerator tensors (integer sums on the device), run here on the CPU."""
    a, b = fp._digest(t).tolist()
    return a, b


@pytest.fixture(params=[host_digest, device_digest], ids=["host", "device"])
def digest(request):
    return request.param


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int8, torch.uint8]


@pytest.mark.parametrize("dtype", DTYPES)
def test_equal_tensors_equal_digest_and_one_change_detected(digest, dtype):
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(37, 11, generator=g) * 50).to(dtype)
    b = a.clone()
    assert digest(a) == digest(b)
    b.view(-1)[123] += 1
    assert digest(a) != digest(b)


def test_swapped_elements_are_detected(digest):
    a = torch.arange(2048, dtype=torch.float32)
    b = a.clone()
    b[[5, 900]] = b[[900, 5]]
    assert digest(a) != digest(b)


def test_swapped_rows_across_position_rows_are_detected(digest):
    a = torch.randn(4096)
    b = a.clone()
    b[:1024], b[1024:2048] = a[1024:2048].clone(), a[:1024].clone()
    assert digest(a) != digest(b)


def test_bit_level_differences_count(digest):
    assert digest(torch.tensor([0.0])) != digest(torch.tensor([-0.0]))
    nan = torch.tensor([float("nan")])
    assert digest(nan) == digest(nan.clone())


def test_bool_complex_and_non_contiguous(digest):
    m = torch.rand(6, 6) > 0.5
    assert digest(m) == digest(m.clone())
    c = torch.randn(5, dtype=torch.complex64)
    c2 = c.clone()
    c2[2] = c2[2] * 1j
    assert digest(c) != digest(c2)
    t = torch.randn(8, 8)
    assert digest(t.t()) == digest(t.t().contiguous())


def test_large_tensor_spans_several_chunks(monkeypatch, digest):
    monkeypatch.setattr(fp, "_CHUNK", 1024 * 4)
    a = torch.randn(1024 * 10 + 3)
    b = a.clone()
    b[-1] += 1
    assert digest(a) != digest(b)
    c = a.clone()
    c[5000] += 1
    assert digest(a) != digest(c) != digest(b)


def test_empty_and_meta_tensors():
    assert host_digest(torch.empty(0)) is not None
    assert device_digest(torch.empty(0)) == (0, 0)
    assert host_digest(torch.empty(3, device="meta")) is None


def test_module_fingerprint_names_kinds_and_ddp_prefix():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    names = [(n, k) for n, k, _ in named_tensors(model)]
    assert ("0.weight", "parameter") in names and ("1.running_mean", "buffer") in names
    prints = fingerprint_module(model)
    assert [p.name for p in prints] == [n for n, _ in names]
    assert prints[0].shape == (4, 3) and prints[0].dtype == "torch.float32"
