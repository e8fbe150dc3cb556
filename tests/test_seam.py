"""The seam rule: only ``ddp_strategy._compat`` may touch private Lightning, torchmetrics or torch internals.

Every other module reaches Lightning (public or private) through the seam, so that a Lightning or torch release
that moves an internal is one file's change, and so that the ``pytorch_lightning`` namespace can bind the same code
to the standalone package. The rules, checked on the source (AST) of every module outside ``_compat``:

* no ``import`` of ``lightning``, ``pytorch_lightning``, ``lightning_fabric`` or ``lightning_utilities``;
* no ``import`` of a private module or name (a dotted component starting with ``_``) of torch or torchmetrics;
* no attribute access ``obj._name`` (nor ``getattr(obj, "_name")``) unless ``_name`` is defined by this package
  (a method, class, module global or attribute assigned somewhere outside ``_compat``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "ddp_strategy"
SEAM = PACKAGE / "_compat"
LIGHTNING_ROOTS = {"lightning", "pytorch_lightning", "lightning_fabric", "lightning_utilities"}
PRIVATE_CHECKED_ROOTS = {"torch", "torchmetrics", *LIGHTNING_ROOTS}
# Private-looking names of the standard library's public API.
STDLIB_PRIVATE = {"_getframe", "_current_frames", "_replace", "_asdict", "_fields", "_make", "_exit"}


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if SEAM not in p.parents)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own_private_names() -> set[str]:
    """Private names this package defines outside the seam."""
    names: set[str] = set()
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    names.add(node.attr)
            elif isinstance(node, ast.alias) and node.asname:
                names.add(node.asname)
    return {n for n in names if _private(n)}


def _violations(path: Path, own: set[str]) -> list[str]:
    found = []
    tree = ast.parse(path.read_text())
    rel = path.relative_to(PACKAGE.parent) if PACKAGE.parent in path.parents else path.name
    for node in ast.walk(tree):
        where = f"{rel}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] in LIGHTNING_ROOTS:
                    found.append(f"{where}: imports {alias.name} (use ddp_strategy._compat)")
                elif parts[0] in PRIVATE_CHECKED_ROOTS and any(_private(p) for p in parts):
                    found.append(f"{where}: imports private {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            parts = node.module.split(".")
            if parts[0] in LIGHTNING_ROOTS:
                found.append(f"{where}: imports from {node.module} (use ddp_strategy._compat)")
            elif parts[0] in PRIVATE_CHECKED_ROOTS:
                private = [p for p in parts if _private(p)] + [a.name for a in node.names if _private(a.name)]
                if private:
                    found.append(f"{where}: imports private {private} from {node.module}")
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            if node.attr not in own and node.attr not in STDLIB_PRIVATE:
                found.append(f"{where}: touches private attribute .{node.attr}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
            and node.args[1].value not in own
            and node.args[1].value not in STDLIB_PRIVATE
        ):
            found.append(f"{where}: {node.func.id}(..., {node.args[1].value!r}) touches a private attribute")
    return found


def test_only_the_seam_touches_private_internals() -> None:
    own = _own_private_names()
    found = [v for path in _modules() for v in _violations(path, own)]
    assert not found, "Private Lightning/torch internals outside ddp_strategy._compat:\n" + "\n".join(found)


def test_the_checker_catches_each_kind_of_violation(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import lightning.pytorch as pl\n"
        "from torch.distributed import _functional_collectives\n"
        "from torch.distributed.distributed_c10d import _get_default_store\n"
        "x = trainer._data_connector\n"
        "y = getattr(loop, '_results')\n"
        "z = self._own\n"
    )
    found = _violations(bad, {"_own"})
    assert [line.split(": ", 1)[1] for line in found] == [
        "imports lightning.pytorch (use ddp_strategy._compat)",
        "imports private ['_functional_collectives'] from torch.distributed",
        "imports private ['_get_default_store'] from torch.distributed.distributed_c10d",
        "touches private attribute ._data_connector",
        "getattr(..., '_results') touches a private attribute",
    ], found


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_package_modules_import_each_other_relatively(path: Path) -> None:
    """Absolute ``ddp_strategy`` imports would bind the ``pytorch_lightning`` namespace to ``lightning``'s code."""
    tree = ast.parse(path.read_text())
    absolute = [
        f"line {node.lineno}: from {node.module}"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "ddp_strategy"
    ] + [
        f"line {node.lineno}: import {alias.name}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
        if alias.name.split(".")[0] == "ddp_strategy"
    ]
    assert not absolute, absolute


def _relative_imports(path: Path) -> set[str]:
    """The package modules ``path`` imports, as dotted names relative to ``ddp_strategy``."""
    rel = path.relative_to(PACKAGE).with_suffix("")
    package = list(rel.parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - (node.level - 1)]
            module = [*base, *node.module.split(".")] if node.module else base
            names = [".".join([*module, a.name]) for a in node.names] if not node.module else [".".join(module)]
            found.update(names)
    return found


def test_modules_shared_by_both_namespaces_hold_no_lightning() -> None:
    """A shared module is loaded once for both namespaces, so it must not reach either Lightning package."""
    from ddp_strategy.pytorch_lightning import SHARED_MODULES

    for name in SHARED_MODULES:
        path = PACKAGE / (name.replace(".", "/") + ".py")
        # A shared package would get the namespace-bound copies of its submodules set as its attributes.
        assert path.is_file(), f"shared module {name} must be a plain module, not a package"
        lightning = [line for line in _violations(path, set()) if "(use ddp_strategy._compat)" in line]
        assert not lightning, f"shared module {name} imports Lightning: {lightning}"
        outside = {m for m in _relative_imports(path) if m not in SHARED_MODULES and m != ""}
        assert not outside, f"shared module {name} imports namespace-bound modules {sorted(outside)}"
