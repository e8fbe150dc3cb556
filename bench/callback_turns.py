"""What Lightning's turns over the strategy's callbacks cost per training step, and what merging them would save.

    python bench/callback_turns.py             # bench/results/callback_turns.{json,md}
    python bench/callback_turns.py --quick     # smoke run: bench/results/callback_turns-quick.*

``bench/call_count.py --count opcodes`` found that half of the bytecodes ``SafeDDPStrategy`` adds to a training step
(about 252 of 511) are Lightning's ``_call_callback_hooks`` turning over the strategy's callbacks in its six per-batch
hooks, although each has set those hooks to ``None`` (``ddp_strategy._compat.callback_hooks``). A default fit has
three of them (``ShardingCheck``, ``WeightSyncCheck``, ``PreemptionStop``: the ``trainer.callbacks`` of a 2-rank fit
of the tiny model, looked at by hand); ``_ReloadedTrainingBatchesCheck`` joins them at a fit's first dataloader
reload. Merging the three into one dispatcher would cut those turns to a third; this script says what that is worth.

It times Lightning's own ``_call_callback_hooks`` for the six per-batch hooks of one training step, on a Trainer set
up as ``bench/tiny_step.py``'s (no checkpointing, progress bar or model summary: no callback of its own, ``stock``),
with three callbacks whose per-batch hooks are skipped the way the
strategy's are (``safe``: :func:`~ddp_strategy._compat.callback_hooks.skip_inherited_batch_hooks`), and with one
such callback (``merged``). The variants take turns in a new random order each round, each timing ``--calls``
steps; per round the fastest of ``--repeats`` timings per variant. Report: the median over rounds and per-round
(paired) differences to stock, in microseconds per step. Hot caches: the figure is a lower bound of a real step's.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

import lightning  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch import Trainer  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from lightning.pytorch.trainer.call import _call_callback_hooks  # noqa: E402

from ddp_strategy._compat.callback_hooks import BATCH_HOOKS, skip_inherited_batch_hooks  # noqa: E402

#: The per-batch hooks Lightning runs through ``_call_callback_hooks`` in one automatic-optimization training step.
STEP_HOOKS = tuple(h for h in BATCH_HOOKS if not h.startswith(("on_validation", "on_test", "on_predict")))
#: How many callbacks each variant adds to Lightning's defaults.
ADDED = {"stock": 0, "safe": 3, "merged": 1}


class SkippedHooks(Callback):
    """A callback whose per-batch hooks are skipped, as the strategy's are while they have nothing to do."""

    def __init__(self) -> None:
        skip_inherited_batch_hooks(self)


def step_caller(trainer: Trainer) -> Callable[[], None]:
    """One training step's turns of Lightning's callback loop (the hooks get no arguments: none is called)."""

    def step() -> None:
        for hook in STEP_HOOKS:
            _call_callback_hooks(trainer, hook)

    return step


def time_steps(step: Callable[[], None], calls: int, repeats: int) -> float:
    """The fastest of ``repeats`` timings of ``calls`` steps, in seconds per step."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            step()
        best = min(best, time.perf_counter() - start)
    return best / calls


def measure(rounds: int, calls: int, repeats: int, seed: int = 0) -> dict[str, Any]:
    """Per variant, the seconds per step of every round; the variants' callback counts."""
    # as bench/tiny_step.py's fits: no logger, checkpointing, progress bar or summary (none of their hooks runs here)
    trainer = Trainer(
        logger=False,
        accelerator="cpu",
        devices=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    defaults = list(trainer.callbacks)
    callbacks = {name: defaults + [SkippedHooks() for _ in range(n)] for name, n in ADDED.items()}
    per_round: dict[str, list[float]] = {name: [] for name in ADDED}
    order = list(ADDED)
    rng = random.Random(seed)
    step = step_caller(trainer)
    for _ in range(rounds):
        rng.shuffle(order)
        for name in order:
            trainer.callbacks[:] = callbacks[name]
            per_round[name].append(time_steps(step, calls, repeats))
    trainer.callbacks[:] = defaults
    return {
        "per_round_s": per_round,
        "callbacks": {name: len(cbs) for name, cbs in callbacks.items()},
        "default_callbacks": [type(cb).__name__ for cb in defaults],
    }


def analyse(measured: dict[str, Any]) -> dict[str, Any]:
    """Medians over rounds and paired differences to stock, in microseconds per step."""
    per_round = measured["per_round_s"]
    stock = per_round["stock"]
    out: dict[str, Any] = {"median_us": {name: statistics.median(v) * 1e6 for name, v in per_round.items()}}
    out["added_us"] = {}
    for name in ("safe", "merged"):
        diffs = [(a - b) * 1e6 for a, b in zip(per_round[name], stock, strict=True)]
        out["added_us"][name] = {"median": statistics.median(diffs), "min": min(diffs), "max": max(diffs)}
    added = ADDED["safe"] * len(STEP_HOOKS)
    out["per_turn_us"] = out["added_us"]["safe"]["median"] / added
    out["merge_saves_us"] = out["added_us"]["safe"]["median"] - out["added_us"]["merged"]["median"]
    return out


def render(result: dict[str, Any]) -> str:
    """The Markdown report."""
    a, m = result["analysis"], result["measured"]
    lines = [
        f"Measured {result['date']} on {result['machine']['platform']}, Python {result['machine']['python']}, torch "
        f"{result['machine']['torch']}, Lightning {result['machine']['lightning']}: Lightning's "
        f"`_call_callback_hooks` for the {len(STEP_HOOKS)} per-batch hooks of one training step, "
        f"{result['rounds']} interleaved rounds of {result['calls']} steps (fastest of {result['repeats']} per "
        f"round), hot caches. Lightning's own callbacks in the Trainer: {', '.join(m['default_callbacks']) or 'none'}.",
        "",
        "| variant | callbacks | per step (us, median) | added over stock, paired (us): median [min, max] |",
        "|---|---|---|---|",
    ]
    for name in ADDED:
        added = a["added_us"].get(name)
        cell = f"{added['median']:+.2f} [{added['min']:+.2f}, {added['max']:+.2f}]" if added else "-"
        lines.append(f"| {name} | {m['callbacks'][name]} | {a['median_us'][name]:.2f} | {cell} |")
    lines += [
        "",
        f"Per turn of a callback whose hook is skipped: {a['per_turn_us'] * 1000:.0f} ns. Merging the strategy's "
        f"{ADDED['safe']} callbacks into one would save {a['merge_saves_us']:.2f} us per step (hot caches).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 3 rounds of 200 steps")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 15, quick 3)")
    parser.add_argument("--calls", type=int, default=None, help="steps per timing (default 5000, quick 200)")
    parser.add_argument("--repeats", type=int, default=3, help="timings per variant and round (the fastest counts)")
    parser.add_argument("--out", type=Path, default=None, help="results path, no suffix")
    args = parser.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 15)
    calls = args.calls or (200 if args.quick else 5000)
    out = args.out or ROOT / "bench" / "results" / ("callback_turns-quick" if args.quick else "callback_turns")
    measured = measure(rounds, calls, args.repeats)
    result = {
        "date": datetime.now().strftime("%Y-%m-%d %H:%M"),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "lightning": lightning.__version__,
        },
        "rounds": rounds,
        "calls": calls,
        "repeats": args.repeats,
        "measured": measured,
        "analysis": analyse(measured),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    text = render(result)
    out.with_suffix(".md").write_text(text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
