from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        return
    reason = f"needs >= 2 CUDA devices for NCCL (found {torch.cuda.device_count() if torch.cuda.is_available() else 0})"
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))
