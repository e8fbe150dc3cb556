from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist


def cuda_devices() -> int:
    """CUDA devices visible to this process (0 without a usable CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip each ``gpu`` test, with a reason naming the device count it needs, where there are too few devices.

    ``@pytest.mark.gpu`` needs one CUDA device, ``@pytest.mark.gpu(devices=2)`` two. A GPU runner sets
    ``DDP_STRATEGY_REQUIRE_GPUS=N`` (``.github/workflows/gpu.yml``): with fewer than N devices the run fails instead
    of skipping everything.
    """
    found = cuda_devices()
    required = int(os.environ.get("DDP_STRATEGY_REQUIRE_GPUS", "0"))
    if found < required:
        raise pytest.UsageError(f"DDP_STRATEGY_REQUIRE_GPUS={required}, but this machine has {found} CUDA device(s)")
    nccl = dist.is_available() and dist.is_nccl_available()
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        needed = int(marker.kwargs.get("devices", 1))
        if found < needed or not nccl:
            what = f"{found} found" if nccl else f"{found} found, and this torch has no NCCL"
            item.add_marker(pytest.mark.skip(reason=f"needs {needed} CUDA device(s) and NCCL ({what})"))
