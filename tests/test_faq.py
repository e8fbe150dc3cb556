"""The FAQ's claims (docs/faq.md), each demonstrated by a test that fails if the claim is false.

Most claims are read off one real 2-process run of ``tests/scripts/faq_ddp.py`` (module-scoped fixture): each
rank reports its initial weights, gradients, weights after the first step, the samples it trained and evaluated
on, and what it saw right after ``trainer.save_checkpoint``. The single-device answers are recomputed here.
"""

from __future__ import annotations

import doctest
import importlib
import inspect
import json
import pkgutil
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ddp_strategy
from ddp_strategy.checkpoint.export import load_into
from tests.proc import ROOT, SCRIPTS, run_script

FAQ_SCRIPT = str(SCRIPTS / "faq_ddp.py")
SEED001 = str(ROOT / "examples" / "seed001" / "train.py")


@pytest.fixture(scope="module")
def faq(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("faq")
    run = run_script([FAQ_SCRIPT, "--dir", str(out)], timeout=240)
    assert run.returncode == 0 and not run.orphans, run.describe()
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    return {"dir": out, "output": run.output, "ranks": ranks}


def as_tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: torch.tensor(v) for k, v in state.items()}


def single_device_step(initial: dict[str, Any], x: torch.Tensor, y: torch.Tensor, loss_scale: float, lr: float):
    """One SGD step of nn.Linear(4, 3) on one device with loss = loss_scale * sum of per-sample losses."""
    net = nn.Linear(4, 3)
    net.load_state_dict(as_tensors(initial))
    loss = loss_scale * nn.functional.cross_entropy(net(x), y, reduction="sum")
    loss.backward()
    with torch.no_grad():
        for p in net.parameters():
            p -= lr * p.grad
    return {k: v.detach() for k, v in net.state_dict().items()}


def first_batch(record: dict[str, Any]) -> list[int]:
    epoch, indices = record["train"][0]
    assert epoch == 0
    return indices


def train_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)  # faq_ddp.Indexed(16, seed=0)
    x = torch.randn(16, 4, generator=g)
    return x, torch.randint(0, 3, (16,), generator=g)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


# ---------------------------------------------------------------------------------------------- multi-process


@pytest.mark.multiprocess
def test_ranks_start_from_rank0_weights_even_when_initialised_differently(faq: dict[str, Any]):
    """Q5/Q18: DDP broadcasts rank 0's weights when it wraps the model, so every rank starts from them."""
    r0, r1 = (rank["mean"] for rank in faq["ranks"])
    assert max_diff(as_tensors(r0["initial"]), as_tensors(r1["initial"])) > 0.01  # different seeds per rank
    assert r0["after_wrapping"] == r0["initial"]
    assert r1["after_wrapping"] == r0["initial"]  # rank 1's own initialisation is gone


@pytest.mark.multiprocess
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_gradients_are_averaged_so_two_ranks_take_the_step_of_one_device_on_the_concatenated_batch(
    faq: dict[str, Any], reduction: str
):
    """Q4/Q6: a 2-rank step with batch B each equals a 1-device step on the 2B samples, at the same learning rate."""
    r0, r1 = (rank[reduction] for rank in faq["ranks"])
    lr, world = faq["ranks"][0]["lr"], faq["ranks"][0]["world_size"]
    x, y = train_data()
    both = torch.tensor(first_batch(r0) + first_batch(r1))
    b = len(first_batch(r0))
    # DDP averages the ranks' gradients: mean loss -> mean over the 2B samples; sum loss -> (sum over 2B) / W
    scale = 1 / (world * b) if reduction == "mean" else 1 / world
    expected = single_device_step(r0["initial"], x[both], y[both], scale, lr)
    for record in (r0, r1):
        assert max_diff(as_tensors(record["after_first_step"]), expected) < 1e-6
    # if gradients were summed instead, the step would be W times larger: far from what the ranks did
    summed = single_device_step(r0["initial"], x[both], y[both], scale * world, lr)
    assert max_diff(as_tensors(r0["after_first_step"]), summed) > 1e-3


@pytest.mark.multiprocess
def test_gradients_are_identical_on_every_rank_when_backward_returns(faq: dict[str, Any]):
    """Q3: no barrier is needed before evaluating: backward itself all-reduces the gradients."""
    r0, r1 = (rank["mean"] for rank in faq["ranks"])
    assert first_batch(r0) != first_batch(r1)  # different data ...
    assert r0["grads"] == r1["grads"]  # ... yet the same gradients, bit for bit


@pytest.mark.multiprocess
def test_each_rank_trains_on_its_own_shard_and_the_order_changes_every_epoch(faq: dict[str, Any]):
    """Q10/Q14: Lightning inserts a DistributedSampler and calls set_epoch; no code of yours needed."""
    r0, r1 = (rank["mean"] for rank in faq["ranks"])
    orders = {}
    for epoch in (0, 1):
        shards = [[i for e, batch in r["train"] if e == epoch for i in batch] for r in (r0, r1)]
        assert not set(shards[0]) & set(shards[1])  # no sample on two ranks
        assert sorted(shards[0] + shards[1]) == list(range(16))  # every sample once per epoch
        assert len(shards[0]) == len(shards[1]) == 8  # 2 steps of B=4 per rank: effective batch W x B = 8
        orders[epoch] = shards
    assert orders[0] != orders[1]  # set_epoch(epoch) reshuffles; without it every epoch repeats epoch 0's order


@pytest.mark.multiprocess
def test_every_rank_evaluates_its_own_samples_once_and_the_result_is_printed_once(faq: dict[str, Any]):
    """Q2/Q13: evaluation runs on every rank, each of the 9 samples once (no padding); rank 0 prints."""
    r0, r1 = (rank["mean"] for rank in faq["ranks"])
    for epoch in (0, 1):
        shards = [[i for e, batch in r["val"] if e == epoch for i in batch] for r in (r0, r1)]
        assert shards[0] and shards[1]  # both ranks evaluate
        assert sorted(shards[0] + shards[1]) == list(range(9))  # a padded DistributedSampler would give 10
        assert faq["output"].count(f"faq: epoch {epoch} validated") == 1


@pytest.mark.multiprocess
def test_save_returns_on_every_rank_only_once_rank0_has_written_the_file(faq: dict[str, Any]):
    """Q1/Q16/Q19: one writer (rank 0), and no rank continues before the file is complete: no barrier needed."""
    assert sorted(p.name for p in faq["dir"].glob("written-by-*")) == ["written-by-rank0"]
    for rank in faq["ranks"]:
        record = rank["mean"]
        assert record["save_returned_after_s"] >= 2.0  # rank 0's write was delayed by 2 s; rank 1 waited too
        assert record["file_valid_right_after_save"] is True


@pytest.mark.multiprocess
def test_checkpoint_has_no_module_prefix_and_loads_into_a_plain_model(faq: dict[str, Any]):
    """Q12: Lightning saves the LightningModule, not the DDP wrapper: keys are 'net.weight', never 'module.'."""
    path = faq["dir"] / "faq.ckpt"
    state = torch.load(path, weights_only=True, map_location="cpu")["state_dict"]
    assert sorted(state) == ["net.bias", "net.weight"]
    plain = nn.Linear(4, 3)
    load_into(plain, str(path), strip_prefix="net")
    expected = as_tensors(faq["ranks"][0]["mean"]["final"])
    assert max_diff({k: v.detach() for k, v in plain.state_dict().items()}, expected) == 0.0


@pytest.mark.multiprocess
def test_spawn_needs_an_importable_main_module(tmp_path: Path):
    """Q15: with a spawn launcher, a model class defined in `python -c` code (or a notebook) cannot be unpickled."""
    code = (
        "import lightning.pytorch as pl, torch\n"
        "from torch import nn\n"
        "from torch.utils.data import DataLoader, TensorDataset\n"
        "import ddp_strategy\n"
        "class M(pl.LightningModule):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.net = nn.Linear(4, 2)\n"
        "    def training_step(self, b, i):\n"
        "        return nn.functional.cross_entropy(self.net(b[0]), b[1])\n"
        "    def configure_optimizers(self):\n"
        "        return torch.optim.SGD(self.parameters(), lr=0.1)\n"
        "data = DataLoader(TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,))), batch_size=4)\n"
        "pl.Trainer(accelerator='cpu', devices=2, strategy='safe_ddp_spawn', max_epochs=1, logger=False,\n"
        "           enable_checkpointing=False, enable_progress_bar=False).fit(M(), data)\n"
    )
    run = run_script(["-c", code], timeout=150)
    assert run.returncode != 0 and not run.orphans, run.describe()
    assert "Can't get attribute 'M' on <module '__main__'" in run.output, run.describe()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_seed001_migrated_script_trains_and_resumes(tmp_path: Path):
    """docs/migrating.md: the seed 001 script as a LightningModule trains on 2 processes and resumes."""
    common = ["--devices", "2", "--train-samples", "128", "--val-samples", "50", "--no-archive"]
    common += ["--data-dir", str(tmp_path / "data"), "--ckpt-dir", str(tmp_path / "ckpt")]
    first = run_script([SEED001, *common, "--max-epochs", "1"], timeout=240)
    assert first.returncode == 0 and not first.orphans, first.describe()
    assert "resumed: False; finished epoch 0" in first.output and first.output.count("Finished Training") == 1
    assert first.output.count("Accuracy for class: plane") == 1  # printed once, not once per rank
    second = run_script([SEED001, *common, "--max-epochs", "2", "--resume"], timeout=240)
    assert second.returncode == 0 and not second.orphans, second.describe()
    assert "resumed: True; finished epoch 1" in second.output, second.describe()


# ---------------------------------------------------------------------------------------------- documentation


def public_names() -> list[tuple[str, str, Any]]:
    found = []
    for info in pkgutil.walk_packages(ddp_strategy.__path__, "ddp_strategy."):
        if info.name.startswith("ddp_strategy.pytorch_lightning."):
            continue  # the same source files, bound to pytorch_lightning (the package itself is kept)
        module = importlib.import_module(info.name)
        found.append((info.name, "<module>", module))
        for name in getattr(module, "__all__", []):
            found.append((info.name, name, getattr(module, name)))
    return found


def test_every_public_module_class_and_function_has_a_docstring():
    missing = [
        f"{module}.{name}"
        for module, name, obj in public_names()
        if (inspect.ismodule(obj) or inspect.isclass(obj) or inspect.isfunction(obj)) and not inspect.getdoc(obj)
    ]
    assert not missing, f"public names without a docstring: {missing}"


def test_public_methods_defined_here_have_docstrings():
    """Methods of our public classes that are not Lightning hook overrides are documented."""
    missing = []
    for module, name, obj in public_names():
        if not inspect.isclass(obj) or not obj.__module__.startswith("ddp_strategy"):
            continue
        bases = [b for b in obj.__mro__[1:] if not b.__module__.startswith("ddp_strategy")]
        for attr, value in vars(obj).items():
            if attr.startswith("_") or any(hasattr(b, attr) for b in bases):
                continue  # private, or an override of a documented Lightning/torch method
            func = value.fget if isinstance(value, property) else value
            if inspect.isfunction(func) and not inspect.getdoc(func):
                missing.append(f"{module}.{name}.{attr}")
    assert not missing, f"public methods without a docstring: {missing}"


DOCTEST_MODULES = ["ddp_strategy.positions", "ddp_strategy.evaluation.coordinator"]


@pytest.mark.parametrize("name", DOCTEST_MODULES)
def test_docstring_examples_run(name: str):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


FAQ = ROOT / "docs" / "faq.md"


def test_faq_answers_every_seed_question_with_a_linked_test():
    """Each of the 19 answers links at least one test that exists."""
    text = FAQ.read_text()
    sections = re.split(r"^## ", text, flags=re.MULTILINE)[1:]
    numbered = [s for s in sections if re.match(r"\d+\. ", s)]
    assert [int(s.split(".", 1)[0]) for s in numbered] == list(range(1, 20))
    for section in numbered:
        links = re.findall(r"tests/(test_\w+\.py)(?:::(\w+))?", section)
        assert links, f"no test linked in: {section.splitlines()[0]}"
        for file, test in links:
            source = (ROOT / "tests" / file).read_text()
            assert not test or f"def {test}(" in source, f"{file}::{test} does not exist"


def test_faq_answers_beyond_the_seed_questions_link_tests_that_exist():
    """Answers after the 19 seed questions (e.g. "my ranks end with different weights") link existing tests too."""
    sections = re.split(r"^## ", FAQ.read_text(), flags=re.MULTILINE)[1:]
    extra = [s for s in sections if not re.match(r"\d+\. ", s)]
    assert any("different weights" in s.splitlines()[0] for s in extra)
    for section in extra:
        links = re.findall(r"tests/(test_\w+\.py)(?:::(\w+))?", section)
        assert links, f"no test linked in: {section.splitlines()[0]}"
        for file, test in links:
            assert not test or f"def {test}(" in (ROOT / "tests" / file).read_text(), f"{file}::{test} does not exist"


LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", flags=re.MULTILINE | re.DOTALL)
REPO_URL = "https://github.com/ddp-strategy/ddp_strategy"  # links to the repository itself are checked locally
LINKED_PAGES = [
    "README.md",
    "bench/README.md",
    *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")),
]


def headings(page: Path) -> list[str]:
    """The text of every ATX heading of a Markdown page, outside fenced code blocks (where `#` is a comment)."""
    return re.findall(r"^#{1,6} +(.+?) *#*$", FENCE.sub("", page.read_text()), flags=re.MULTILINE)


def github_anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the headings of ``page``: inline Markdown dropped, lower case, punctuation other than
    ``-`` and ``_`` removed, each space a ``-``; a repeated anchor gets ``-1``, ``-2``, ..."""
    seen: dict[str, int] = {}
    anchors = set()
    for heading in headings(page):
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # [text](target) -> text
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def mkdocs_anchors(page: Path) -> set[str]:
    """The anchors the documentation site gives the headings of ``page`` (Python-Markdown's toc extension)."""
    import markdown

    md = markdown.Markdown(extensions=["toc", "tables", "pymdownx.superfences"])
    md.convert(page.read_text())

    def walk(tokens: list[dict[str, Any]]) -> set[str]:
        return {t["id"] for t in tokens} | {i for t in tokens for i in walk(t["children"])}

    return walk(md.toc_tokens)  # type: ignore[attr-defined]


def test_anchor_rules_match_known_headings():
    """The link check's anchor rules, on headings whose anchors GitHub and mkdocs are known to give."""
    bench = github_anchors(ROOT / "bench" / "README.md")
    assert "checkpoint-save-benchcheckpoint_savepy-make-bench-extra" in bench
    assert "checkpoint-save-benchcheckpoint_savepy" not in bench  # the anchor README linked before (issue 17)
    faq = ROOT / "docs" / "faq.md"
    seventeen = "17-what-is-the-proper-bug-free-way-to-save-during-ddp-training-and-resume-on-all-ranks-map_location"
    assert seventeen in github_anchors(faq) and seventeen in mkdocs_anchors(faq)
    assert "node-0-its-address-10001" not in github_anchors(ROOT / "docs" / "multinode.md")  # a comment in a code block


@pytest.mark.parametrize("page", LINKED_PAGES)
def test_relative_links_in_docs_and_readme_resolve(page: str):
    """Every relative link (and every link to this repository on GitHub) points to an existing file, and every
    anchor to an existing heading: as GitHub renders it, and for links between docs pages also as the site does."""
    source = ROOT / page
    broken = []
    for target in LINK.findall(source.read_text()):
        if target.startswith(REPO_URL):
            rest = target[len(REPO_URL) :]
            rest = re.sub(r"^/(?:tree|blob)/main/", "", rest).lstrip("/")
            path, _, anchor = rest.partition("#")
            resolved = ROOT / (path or "README.md")
        elif re.match(r"[a-z]+://|mailto:", target):
            continue
        else:
            path, _, anchor = target.partition("#")
            resolved = (source.parent / path).resolve() if path else source
        if not resolved.exists():
            broken.append(target)
        elif anchor and resolved.suffix == ".md":
            if anchor not in github_anchors(resolved):
                broken.append(f"{target} (no such heading on GitHub)")
            both_in_docs = source.parent == ROOT / "docs" and resolved.parent == ROOT / "docs"
            if both_in_docs and anchor not in mkdocs_anchors(resolved):
                broken.append(f"{target} (no such heading in the documentation site)")
    assert not broken, f"{page}: broken links {broken}"


def test_readme_table_names_tests_that_exist():
    """Every test named in the "shown by" column of README's table exists (``::name`` continues the file named
    before it in the same cell; ``name_*`` is any test of that prefix), and every row names at least one."""
    table = (ROOT / "README.md").read_text().split("## What it adds to stock Lightning DDP", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| situation")]
    assert len(rows) >= 10
    missing = []
    for row in rows:
        cell = row.rstrip(" |").rsplit(" | ", 1)[1]
        refs = re.findall(r"`(tests/test_\w+\.py)?(?:::(\w+\*?))?`", cell)
        assert [r for r in refs if any(r)], f"no test named in: {row[:80]}"
        current = None
        for file, test in refs:
            current = file or current
            assert current is not None, f"'::{test}' without a file before it in: {row[:80]}"
            path = ROOT / current
            if not path.exists():
                missing.append(current)
            elif test and not re.search("^def " + test.replace("*", r"\w*") + r"\(", path.read_text(), re.MULTILINE):
                missing.append(f"{current}::{test}")
    assert not missing, f"README names tests that do not exist: {missing}"
