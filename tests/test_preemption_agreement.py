"""The stop-step agreement of ddp_strategy.preemption, one process: ranks simulated over one HashStore."""

from __future__ import annotations

import re
import signal

import pytest
import torch.distributed as dist

from ddp_strategy.errors import DDPStrategyError
from ddp_strategy.preemption import Preempted, PreemptionAgreement, exit_code, parse_signals, stop_message


def lockstep(agreements: list[PreemptionAgreement], store: dist.Store, *, lag: dict[int, int], steps: int) -> dict:
    """Step the ranks in DDP's lockstep (no rank completes step k+1 before every rank reached boundary k); rank r
    reaches each boundary ``lag[r]`` turns late (0 or 1). Return the step each rank stopped at."""
    stopped: dict[int, int] = {}
    for step in range(1, steps + 1):
        for turn in (0, 1):
            for a in agreements:
                if a.rank in stopped or lag.get(a.rank, 0) != turn:
                    continue
                if a.at_step_boundary(store, step):
                    stopped[a.rank] = step
        if len(stopped) == len(agreements):
            break
    return stopped


@pytest.mark.parametrize("signalled", [[0], [1], [2], [0, 1, 2]])
@pytest.mark.parametrize("lag", [{}, {1: 1}, {0: 1}])
def test_every_rank_stops_at_the_same_step_whoever_got_the_signal(signalled, lag):
    store = dist.HashStore()
    agreements = [PreemptionAgreement(rank=r, world_size=3, poll_interval=0.0) for r in range(3)]
    for r in signalled:
        agreements[r].request(signal.SIGTERM)
    stopped = lockstep(agreements, store, lag=lag, steps=20)
    assert len(stopped) == 3 and len(set(stopped.values())) == 1, stopped
    assert all(a.stop_step == stopped[0] for a in agreements)
    for a in agreements:
        if a.received is None:  # learned it from the store: names a rank that got the signal
            assert re.fullmatch(r"SIGTERM on rank (\d) \(at step \d+\)", a.describe_cause()), a.describe_cause()
            assert a.notice is not None and a.notice.rank in signalled


def test_a_rank_that_polls_late_still_stops_with_the_others():
    store = dist.HashStore()
    a0 = PreemptionAgreement(rank=0, world_size=2, poll_interval=0.0)
    a1 = PreemptionAgreement(rank=1, world_size=2, poll_interval=3600.0)  # its next lookup is an hour away
    a1._next_poll = 0.0
    a1.at_step_boundary(store, 1)  # looked once, found nothing: the next lookup is an hour away
    a0.request(signal.SIGUSR1)
    assert not a0.at_step_boundary(store, 2)  # announced and acked; rank 1 has not acked
    assert not a1.at_step_boundary(store, 2)  # not looking yet
    assert a1.notice is None and a0.stop_step is None
    a1._next_poll = 0.0  # its hour is up
    assert not a1.at_step_boundary(store, 3)  # acks at 3: the stop is after step 4
    assert a1.stop_step == 4
    assert not a0.at_step_boundary(store, 3) and a0.at_step_boundary(store, 4) and a1.at_step_boundary(store, 4)
    assert a1.exit_code() == a0.exit_code() == 128 + signal.SIGUSR1


def test_a_rank_past_the_agreed_step_is_named():
    store = dist.HashStore()
    a = PreemptionAgreement(rank=0, world_size=1, poll_interval=0.0)
    a.request(signal.SIGTERM)
    assert not a.at_step_boundary(store, 3)
    with pytest.raises(DDPStrategyError, match=r"Rank 0 is at step 9, past the step 4 .* SIGTERM on rank 0"):
        a.at_step_boundary(store, 9)


def test_only_the_first_signal_counts():
    a = PreemptionAgreement(rank=0, world_size=1)
    a.request(signal.SIGUSR1)
    a.request(signal.SIGTERM)
    assert a.received == signal.SIGUSR1


def test_signals_are_parsed_and_bad_ones_named():
    assert parse_signals(["SIGTERM", "usr1", 15]) == (signal.SIGTERM, signal.SIGUSR1)
    assert parse_signals(None) == ()
    with pytest.raises(ValueError, match="'SIGNOPE', which is not a signal"):
        parse_signals(["SIGNOPE"])
    with pytest.raises(ValueError, match="SIGKILL, which cannot be handled"):
        parse_signals(["SIGKILL"])


def test_exit_code_and_message():
    assert exit_code(signal.SIGTERM) == 143
    a = PreemptionAgreement(rank=1, world_size=2)
    a.request(signal.SIGTERM)
    text = stop_message(a, step=7, path="/ckpt/last.ckpt", resume='"last"', world_size=2)
    assert text.startswith("ddp_strategy: preempted: rank 1 received SIGTERM; all 2 rank(s) stopped after step 7 (")
    assert text.endswith(
        'saved /ckpt/last.ckpt; resume with trainer.fit(..., ckpt_path="last"). Exiting with code 143 (SIGTERM).'
    )
    err = Preempted(text, signal_name="SIGTERM", code=143, step=7, path="/ckpt/last.ckpt")
    assert isinstance(err, SystemExit) and err.code == 143 and str(err) == text
