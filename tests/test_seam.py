"""The seam rule: only ``ddp_strategy._compat`` may touch private Lightning, torchmetrics or torch internals.

Every other module reaches Lightning (public or private) through the seam, so that a Lightning or torch release
that moves an internal is one file's change, and so that the ``pytorch_lightning`` namespace can bind the same code
to the standalone package. The rules, checked on the source (AST) of every module outside ``_compat``:

* no ``import`` of ``lightning``, ``pytorch_lightning``, ``lightning_fabric`` or ``lightning_utilities``;
* no ``import`` of a private module or name (a dotted component starting with ``_``) of torch or torchmetrics;
* no relative import of a private name (``from .control import _KEY``): a module's private names are its own;
* no attribute access ``obj._name`` (nor ``getattr``/``setattr``/``hasattr``/``delattr(obj, "_name")``) unless the
  same module defines ``_name``: as a module global, a function, a class, a method or class attribute of a class in
  it, or an attribute it assigns as ``self._name``/``cls._name``. For ``self._name``, ``cls._name`` and
  ``super()._name`` inside a class, also when that class or one of its base classes defined in the package (outside
  ``_compat``) defines it. A few private names of the standard library's public API (``STDLIB_PRIVATE``) pass;
* a private name that a class's base class from Lightning, torch, torchmetrics or the seam defines (on the installed
  release: its class attributes and the ``self._name`` its source assigns) is that base's, never the package's:
  defining it in the class (``def _name``, a class attribute) is an override of a private, allowed only for the
  ones in ``ALLOWED_PRIVATE_OVERRIDES`` (each with why it is needed; the list must hold no other entry), and
  ``self._name`` passes only for those (``super()._name`` only inside the override itself). A base class the
  checker cannot resolve (through the module's imports, or in the package's source) fails the check;
* no attribute named after a Lightning loop or its progress counters (``LOOP_ATTRIBUTES``: ``trainer.fit_loop``,
  ``.epoch_loop``, ``.epoch_progress``, ``.batch_progress``, ...), nor ``getattr`` of one: reading the loops is the
  seam's job (e.g. ``epochs_processed(trainer)``).
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import functools
import inspect
import textwrap
from dataclasses import dataclass, field
from importlib import import_module
from pathlib import Path
from typing import Any

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "ddp_strategy"
SEAM = PACKAGE / "_compat"
LIGHTNING_ROOTS = {"lightning", "pytorch_lightning", "lightning_fabric", "lightning_utilities"}
PRIVATE_CHECKED_ROOTS = {"torch", "torchmetrics", *LIGHTNING_ROOTS}
# Private-looking names of the standard library's public API.
STDLIB_PRIVATE = {"_getframe", "_current_frames", "_replace", "_asdict", "_fields", "_make", "_exit"}
# Lightning's loops and their progress counters (Trainer -> fit/validate/test/predict loop -> epoch loop -> ...).
LOOP_ATTRIBUTES = {
    "fit_loop",
    "validate_loop",
    "test_loop",
    "predict_loop",
    "epoch_loop",
    "val_loop",
    "manual_optimization",
    "epoch_progress",
    "batch_progress",
    "scheduler_progress",
    "optim_progress",
    "optim_step_progress",
    "_results",
    "_combined_loader",
    "_data_fetcher",
}
# Deliberate overrides of a private method of a Lightning base class ("Class.method"), each with why it is needed:
# Lightning calls these methods itself and offers no public hook at that point. Any other definition of a private
# name that a Lightning (torch, torchmetrics) base class defines fails the test, and so does an entry here that is
# no longer such an override.
ALLOWED_PRIVATE_OVERRIDES = {
    "SafeDDPStrategy._configure_launcher": (
        "the Trainer's accelerator connector builds the strategy's launcher by calling it while the Trainer is "
        "built, and runs no public strategy hook before the launch; the override lets Lightning build its launcher "
        "and hands it to the seam's configure_launcher, which wraps it (the spawn launcher's main process exits "
        "with the ranks' preemption code; a backend error caused by diverged collectives becomes the error the "
        "ranks agreed on)"
    ),
}


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if SEAM not in p.parents)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _in_seam(module: str) -> bool:
    return any(part == "_compat" for part in module.split(".")[1:]) and module.startswith("ddp_strategy.")


def _package_file(module: str) -> Path | None:
    """The source file of a package module outside the seam (``None`` for anything else)."""
    parts = module.split(".")
    if parts[0] != "ddp_strategy" or _in_seam(module):
        return None
    base = PACKAGE.joinpath(*parts[1:])
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _walk_outside_functions(node: ast.AST) -> list[ast.AST]:
    """``node`` and everything under it except the bodies of functions and lambdas (class bodies included)."""
    found = [node]
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            found.extend(_walk_outside_functions(child))
    return found


def _self_stores(tree: ast.AST) -> set[str]:
    """Names assigned as ``self._name``/``cls._name`` anywhere in ``tree``."""
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Store)
        and isinstance(node.value, ast.Name)
        and node.value.id in ("self", "cls")
    }


def _class_body_names(node: ast.ClassDef) -> dict[str, int]:
    """Private names the class body itself defines (methods, nested classes, class attributes), with their lines."""
    names: dict[str, int] = {}
    for stmt in node.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.setdefault(stmt.name, stmt.lineno)
            continue
        for sub in _walk_outside_functions(stmt):
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                names.setdefault(sub.id, sub.lineno)
    return {name: line for name, line in names.items() if _private(name)}


@functools.cache
def _foreign_private_names(cls: type) -> dict[str, str]:
    """Private names a class outside the package defines: ``{name: "module.Class"}`` (first in its MRO wins).

    Its class attributes, and the ``self._name`` its source assigns; only classes of Lightning, torch, torchmetrics
    and the seam count (a standard-library base's private names are not the seam's concern).
    """
    names: dict[str, str] = {}
    for klass in cls.__mro__:
        module = klass.__module__
        if module.split(".")[0] not in PRIVATE_CHECKED_ROOTS and not _in_seam(module):
            continue
        owner = f"{module}.{klass.__qualname__}"
        defined = set(vars(klass))
        with contextlib.suppress(OSError, TypeError, SyntaxError):  # without Python source: its attributes only
            defined |= _self_stores(ast.parse(textwrap.dedent(inspect.getsource(klass))))
        for name in sorted(defined):
            if _private(name):
                names.setdefault(name, owner)
    return names


@dataclass
class _ClassInfo:
    """What the checker knows of a class defined in the package (outside the seam)."""

    name: str
    #: private names this class and its package base classes define (body, ``self._name`` assignments)
    package: set[str] = field(default_factory=set)
    #: private names a base class from Lightning, torch, torchmetrics or the seam defines: ``{name: owner}``
    foreign: dict[str, str] = field(default_factory=dict)


class _Module:
    """A module's source, its imports (local name -> absolute dotted name) and its classes."""

    def __init__(self, name: str, tree: ast.Module, *, is_package: bool) -> None:
        self.name, self.tree = name, tree
        package = name.split(".") if is_package else name.split(".")[:-1]
        self.imports: dict[str, str] = {}
        self.errors: list[tuple[int, str]] = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        self.imports[alias.asname] = alias.name
                    else:
                        root = alias.name.split(".")[0]
                        self.imports[root] = root
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[: len(package) - (node.level - 1)]
                    module = ".".join([*base, *(node.module.split(".") if node.module else [])])
                else:
                    module = node.module or ""
                for alias in node.names:
                    self.imports[alias.asname or alias.name] = f"{module}.{alias.name}"
        self.classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
        self._infos: dict[int, _ClassInfo] = {}

    def info(self, node: ast.ClassDef) -> _ClassInfo:
        if id(node) in self._infos:
            return self._infos[id(node)]
        info = _ClassInfo(node.name)
        self._infos[id(node)] = info  # a cycle (impossible in valid code) cannot recurse forever
        info.package |= set(_class_body_names(node)) | {n for n in _self_stores(node) if _private(n)}
        for base in node.bases:
            resolved = self._resolve_base(base)
            if isinstance(resolved, _ClassInfo):
                info.package |= resolved.package
                for name, owner in resolved.foreign.items():
                    info.foreign.setdefault(name, owner)
            elif isinstance(resolved, type):
                for name, owner in _foreign_private_names(resolved).items():
                    info.foreign.setdefault(name, owner)
            elif resolved is None:
                self.errors.append((base.lineno, f"cannot resolve the base class {ast.unparse(base)} of {node.name}"))
        return info

    def _resolve_base(self, base: ast.expr) -> _ClassInfo | type | None:
        """A base class: a package class (its info), another class (the object), or ``None`` when unknown."""
        if isinstance(base, ast.Subscript):  # Generic[T], Protocol[T]
            base = base.value
        chain: list[str] = []
        while isinstance(base, ast.Attribute):
            chain.insert(0, base.attr)
            base = base.value
        if not isinstance(base, ast.Name):
            return None
        if not chain and base.id in self.classes:
            return self.info(self.classes[base.id])
        if base.id in self.imports:
            return _resolve_dotted(".".join([self.imports[base.id], *chain]))
        obj = getattr(builtins, base.id, None)
        return obj if isinstance(obj, type) and not chain else None


@functools.cache
def _package_module(name: str) -> _Module | None:
    path = _package_file(name)
    if path is None:
        return None
    return _Module(name, ast.parse(path.read_text()), is_package=path.name == "__init__.py")


def _resolve_dotted(dotted: str) -> _ClassInfo | type | None:
    """The class an absolute dotted name denotes: in a package module, from its source; else by importing."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1) if parts[0] == "ddp_strategy" and not _in_seam(dotted) else ():
        module = _package_module(".".join(parts[:cut]))
        if module is None:
            continue
        first, rest = parts[cut], parts[cut + 1 :]
        if not rest and first in module.classes:
            return module.info(module.classes[first])
        return _resolve_dotted(".".join([module.imports[first], *rest])) if first in module.imports else None
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attribute in parts[cut:]:
                obj = getattr(obj, attribute)
        except AttributeError:
            return None
        return obj if isinstance(obj, type) else None
    return None


def _defined_private_names(module: _Module) -> set[str]:
    """Private names ``module`` defines, minus those a class of it shares with a Lightning/torch base class."""
    tree = module.tree
    names = {
        node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    }
    names |= _self_stores(tree)
    names |= {name for node in ast.walk(tree) if isinstance(node, ast.Global) for name in node.names}
    for node in _walk_outside_functions(tree):  # module globals and class attributes
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name.split(".")[0])
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            info = module.info(node)
            names -= set(info.foreign)
    return {name for name in names if _private(name)}


@dataclass
class _Report:
    violations: list[str]
    #: every override of a Lightning/torch private found, allowed or not ("Class.name")
    overrides: set[str]


class _Checker(ast.NodeVisitor):
    def __init__(self, module: _Module) -> None:
        self.module = module
        self.own = _defined_private_names(module)
        self.classes: list[_ClassInfo] = []
        self.functions: list[str] = []
        self.found: list[tuple[int, str]] = []
        self.overrides: set[str] = set()

    def report(self, line: int, message: str) -> None:
        self.found.append((line, message))

    # ---------------------------------------------------------------- imports
    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            parts = alias.name.split(".")
            if parts[0] in LIGHTNING_ROOTS:
                self.report(node.lineno, f"imports {alias.name} (use ddp_strategy._compat)")
            elif parts[0] in PRIVATE_CHECKED_ROOTS and any(_private(p) for p in parts):
                self.report(node.lineno, f"imports private {alias.name}")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            for alias in node.names:
                target = self.module.imports[alias.asname or alias.name]
                if _private(alias.name) and not target.endswith("ddp_strategy._compat"):
                    module = target.rsplit(".", 1)[0]
                    self.report(
                        node.lineno,
                        f"imports the private name {alias.name} of {module} (make it public, or reach it through a "
                        "public function)",
                    )
            return
        if not node.module:
            return
        parts = node.module.split(".")
        if parts[0] in LIGHTNING_ROOTS:
            self.report(node.lineno, f"imports from {node.module} (use ddp_strategy._compat)")
        elif parts[0] in PRIVATE_CHECKED_ROOTS:
            private = [p for p in parts if _private(p)] + [a.name for a in node.names if _private(a.name)]
            if private:
                self.report(node.lineno, f"imports private {private} from {node.module}")

    # ---------------------------------------------------------------- scopes
    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        info = self.module.info(node)
        for name, line in _class_body_names(node).items():
            if name in info.foreign:
                key = f"{node.name}.{name}"
                self.overrides.add(key)
                if key not in ALLOWED_PRIVATE_OVERRIDES:
                    self.report(
                        line,
                        f"{key} overrides the private {info.foreign[name]}.{name} (reach it through "
                        "ddp_strategy._compat, or list it in ALLOWED_PRIVATE_OVERRIDES with why it is needed)",
                    )
        for decorator in node.decorator_list:
            self.visit(decorator)
        for base in [*node.bases, *node.keywords]:
            self.visit(base)
        self.classes.append(info)
        for stmt in node.body:
            self.visit(stmt)
        self.classes.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.functions.append(node.name)
        self.generic_visit(node)
        self.functions.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    # ---------------------------------------------------------------- attributes
    def visit_Attribute(self, node: ast.Attribute) -> None:
        self.check_name(node, node.value, node.attr, f"touches private attribute .{node.attr}")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if (
            isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            name = node.args[1].value
            self.check_name(node, node.args[0], name, f"{node.func.id}(..., {name!r}) touches a private attribute")
        self.generic_visit(node)

    def check_name(self, node: ast.expr, receiver: ast.expr, name: str, private_message: str) -> None:
        if _private(name) and name not in STDLIB_PRIVATE and not self.own_name(receiver, name):
            foreign = self.classes[-1].foreign.get(name) if self.classes and _selfish(receiver) else None
            if foreign is not None:
                private_message += f", a private of {foreign}"
            self.report(node.lineno, private_message)
        elif name in LOOP_ATTRIBUTES and not _reads_loop(receiver):
            self.report(node.lineno, f"reads Lightning's loop attribute .{name} (use a function of the seam)")

    def own_name(self, receiver: ast.expr, name: str) -> bool:
        """Whether ``receiver._name`` is the package's own attribute (see the module docstring)."""
        if not (self.classes and _selfish(receiver)):
            return name in self.own
        info = self.classes[-1]
        if name in info.foreign:
            key = f"{info.name}.{name}"
            is_super = isinstance(receiver, ast.Call)
            return key in ALLOWED_PRIVATE_OVERRIDES and (not is_super or self.functions[-1:] == [name])
        return name in self.own or name in info.package


def _selfish(receiver: ast.expr) -> bool:
    """``self``, ``cls`` or ``super()``."""
    if isinstance(receiver, ast.Name):
        return receiver.id in ("self", "cls")
    return isinstance(receiver, ast.Call) and isinstance(receiver.func, ast.Name) and receiver.func.id == "super"


def _reads_loop(expr: ast.expr) -> bool:
    """Whether ``expr`` already reads a loop attribute (``trainer.fit_loop.epoch_loop`` is reported once)."""
    while isinstance(expr, ast.Attribute):
        if expr.attr in LOOP_ATTRIBUTES:
            return True
        expr = expr.value
    return False


def _module_name(path: Path) -> str:
    parts = ["ddp_strategy", *(path.relative_to(PACKAGE) if PACKAGE in path.parents else Path(path.name)).parts]
    parts[-1] = parts[-1].removesuffix(".py")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _check(path: Path, source: str | None = None) -> _Report:
    """The seam rules on one module: ``path``'s file, or ``source`` as if it were the module at ``path``."""
    tree = ast.parse(path.read_text() if source is None else source)
    module = _Module(_module_name(path), tree, is_package=path.name == "__init__.py")
    rel = path.relative_to(PACKAGE.parent) if PACKAGE.parent in path.parents else path.name
    checker = _Checker(module)
    checker.visit(tree)
    found = sorted(checker.found + module.errors, key=lambda item: item[0])
    return _Report([f"{rel}:{line}: {message}" for line, message in found], checker.overrides)


def _violations(path: Path, source: str | None = None) -> list[str]:
    return _check(path, source).violations


def test_only_the_seam_touches_private_internals() -> None:
    reports = [_check(path) for path in _modules()]
    found = [v for report in reports for v in report.violations]
    assert not found, "Private Lightning/torch internals outside ddp_strategy._compat:\n" + "\n".join(found)
    overrides = set().union(*(report.overrides for report in reports))
    stale = sorted(set(ALLOWED_PRIVATE_OVERRIDES) - overrides)
    assert not stale, f"ALLOWED_PRIVATE_OVERRIDES lists what is no longer an override of a private: {stale}"


def test_the_checker_catches_each_kind_of_violation(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import lightning.pytorch as pl\n"
        "from torch.distributed import _functional_collectives\n"
        "from torch.distributed.distributed_c10d import _get_default_store\n"
        "x = trainer._data_connector\n"
        "y = getattr(loop, '_results')\n"
        "z = self._own\n"
        "_own = None\n"
    )
    found = _violations(bad)
    assert [line.split(": ", 1)[1] for line in found] == [
        "imports lightning.pytorch (use ddp_strategy._compat)",
        "imports private ['_functional_collectives'] from torch.distributed",
        "imports private ['_get_default_store'] from torch.distributed.distributed_c10d",
        "touches private attribute ._data_connector",
        "getattr(..., '_results') touches a private attribute",
    ], found


STRICT_SNIPPET = """\
from . import control
from ._compat.lightning import DDPStrategy
from .control import _FAILED_KEY


class SafeDDPStrategy(DDPStrategy):
    def _configure_launcher(self) -> None:  # listed in ALLOWED_PRIVATE_OVERRIDES
        super()._configure_launcher()
        self._helper()

    def _helper(self) -> None:  # the package's own: no base class defines it
        self._launcher = None


class OtherStrategy(DDPStrategy):
    def _configure_launcher(self) -> None:  # not listed
        super()._configure_launcher()


def trainer_of(module):
    return module._trainer


def epoch(trainer):
    return trainer.fit_loop.epoch_progress.current.processed, control._POSITION_KEY
"""


def test_the_stricter_rules_catch_overrides_and_other_modules_privates() -> None:
    """An un-listed override of a Lightning private, ``module._trainer``, a loop read, another module's private."""
    found = _violations(PACKAGE / "snippet.py", STRICT_SNIPPET)
    ddp = "lightning.pytorch.strategies.ddp.DDPStrategy"
    assert found == [
        "ddp_strategy/snippet.py:3: imports the private name _FAILED_KEY of ddp_strategy.control (make it "
        "public, or reach it through a public function)",
        f"ddp_strategy/snippet.py:12: touches private attribute ._launcher, a private of {ddp}",
        "ddp_strategy/snippet.py:16: OtherStrategy._configure_launcher overrides the private "
        f"{ddp}._configure_launcher (reach it through ddp_strategy._compat, or list it in "
        "ALLOWED_PRIVATE_OVERRIDES with why it is needed)",
        f"ddp_strategy/snippet.py:17: touches private attribute ._configure_launcher, a private of {ddp}",
        "ddp_strategy/snippet.py:21: touches private attribute ._trainer",
        "ddp_strategy/snippet.py:25: reads Lightning's loop attribute .fit_loop (use a function of the seam)",
        "ddp_strategy/snippet.py:25: touches private attribute ._POSITION_KEY",
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
        lightning = [line for line in _violations(path) if "(use ddp_strategy._compat)" in line]
        assert not lightning, f"shared module {name} imports Lightning: {lightning}"
        outside = {m for m in _relative_imports(path) if m not in SHARED_MODULES and m != ""}
        assert not outside, f"shared module {name} imports namespace-bound modules {sorted(outside)}"
