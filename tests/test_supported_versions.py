"""The supported versions are stated once and run by CI: pyproject.toml, the README table, the seam's range, and
the pins of the compatibility environments (lowest) and of the main suite (constraints.txt) agree."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from ddp_strategy._compat import SUPPORTED_LIGHTNING

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
RANGES = {Requirement(r).name: Requirement(r).specifier for r in PROJECT["dependencies"]} | {
    Requirement(r).name: Requirement(r).specifier for r in PROJECT["optional-dependencies"]["pytorch-lightning"]
}


def pins(path: Path) -> dict[str, Version]:
    found = {}
    for line in path.read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.-]+)==(\S+)", line)
        if match:
            found[match.group(1).lower().replace("_", "-")] = Version(match.group(2))
    return found


def test_readme_states_the_declared_ranges():
    readme = (ROOT / "README.md").read_text()
    rows = {
        "torch": "| torch |",
        "lightning": "| lightning (`lightning.pytorch`) |",
        "pytorch-lightning": "| pytorch-lightning (standalone) |",
        "torchmetrics": "| torchmetrics |",
    }
    for name, row in rows.items():
        line = next(line for line in readme.splitlines() if line.startswith(row))
        stated = SpecifierSet(re.findall(r"`(>=[^`]+)`", line)[0])
        assert stated == RANGES[name], (name, line)
    python = next(line for line in readme.splitlines() if line.startswith("| Python |"))
    assert SpecifierSet(re.findall(r"`(>=[^`]+)`", python)[0]) == SpecifierSet(PROJECT["requires-python"])


def test_the_seam_checks_the_declared_lightning_range():
    assert SpecifierSet(",".join(SUPPORTED_LIGHTNING)) == RANGES["lightning"] == RANGES["pytorch-lightning"]


def test_ci_runs_the_lowest_declared_versions_and_pins_the_main_suite_inside_the_ranges():
    low, main = pins(ROOT / ".ci/compat/low.txt"), pins(ROOT / "constraints.txt")
    for name in ("torch", "lightning", "pytorch-lightning", "torchmetrics"):
        floor = next(Version(s.version) for s in RANGES[name] if s.operator == ">=")
        assert Version(low[name].base_version) == floor or low[name] == floor, (name, low[name], floor)
        assert main[name] in RANGES[name], (name, main[name])
