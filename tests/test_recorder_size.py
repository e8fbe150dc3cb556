"""A process group the strategy did not make: torch's Flight Recorder keeps 2000 calls, and the audit stops dumping it.

Torch sizes its recorder once, when the process's first group is made: a group made by the user's own
``init_process_group`` under torchrun, or by an earlier stock fit in the same processes, keeps torch's 2000 entries,
whose dump holds the GIL 20-30 ms (issue 30, point 2: no pause over 1 ms). ``tests/scripts/user_made_group.py``
counts every dump made while the strategy's training steps run and the entries each held.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from ddp_strategy.collective_record import TRACE_ENTRIES
from tests.proc import run_script

SCRIPT = Path(__file__).parent / "scripts" / "user_made_group.py"
TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
WARNING = re.compile(r"UserWarning: ddp_strategy: torch's Flight Recorder keeps (\d+) collectives in this process")


def dumps_per_rank(output: str) -> dict[int, list[int]]:
    found = re.findall(r"rank=(\d) dumps-in-training=(\[[\d, ]*\])", output)
    return {int(rank): ast.literal_eval(sizes) for rank, sizes in found}


@pytest.mark.multiprocess
@pytest.mark.parametrize("group", ["user", "user-sized", "earlier-fit", "strategy"])
def test_the_audit_dumps_during_training_only_a_recorder_of_its_own_size(group: str):
    # user-sized: the user's group, with the size the warning names set in the launch environment
    env = {"TORCH_FR_BUFFER_SIZE": str(TRACE_ENTRIES)} if group == "user-sized" else None
    run = run_script([*TORCHRUN, str(SCRIPT), group.removesuffix("-sized")], timeout=180, env=env)
    assert not run.timed_out and not run.orphans and run.returncode == 0, run.describe()
    assert run.output.count("fit-done") == 2, run.describe()
    dumps = dumps_per_rank(run.output)
    assert set(dumps) == {0, 1}, run.describe()
    warned = [int(n) for n in WARNING.findall(run.output)]
    if group in ("strategy", "user-sized"):  # sized for the audit: dumps during training, none over it, no warning
        assert warned == [], run.describe()
        assert all(sizes and max(sizes) <= TRACE_ENTRIES for sizes in dumps.values()), run.describe()
        return
    assert len(warned) == 1 and warned[0] > TRACE_ENTRIES, run.describe()  # rank 0's, with what it saw
    assert "TORCH_FR_BUFFER_SIZE=8" in run.output, run.describe()
    # the strategy did not make the process's first group: it knows at set-up that the recorder keeps torch's 2000
    # (the launch environment sets no size), and no dump is made while the training steps run
    assert warned == [2000] and dumps == {0: [], 1: []}, run.describe()
