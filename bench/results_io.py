"""What the benchmarks of issue 30 (`strategy_cost.py`, `step_pauses.py`) record of the machine; how they write."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch


def machine() -> dict[str, Any]:
    """The platform and the versions a result was measured with, and when."""
    return {
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "lightning": pl.__version__,
        },
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }


def write(results_dir: str, name: str, result: dict[str, Any], lines: list[str]) -> None:
    """``<name>.json`` and ``<name>.md`` into ``results_dir``; the Markdown printed."""
    out = Path(results_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2))
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
