from __future__ import annotations

import os
import signal
from types import FrameType

import pytest
import torch
import torch.distributed as dist


def _interrupt_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"pytest received signal {signum}")


def pytest_configure(config: pytest.Config) -> None:
    """SIGTERM to pytest (a CI job's timeout, ``kill``) ends the run like Ctrl-C, through every ``finally``.

    Without this, SIGTERM ends the interpreter at once: a test's ``finally`` that kills the process group of the
    script it started (``tests/proc.py``, the SIGKILL trials) never runs, and a 1000-epoch training job of that
    test kept two cores busy for half an hour after its pytest was killed (seen here).
    """
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _interrupt_on_sigterm)


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
