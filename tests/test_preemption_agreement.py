"""The stop-step agreement of ddp_strategy.preemption, one process: ranks simulated over one HashStore."""

from __future__ import annotations

import re
import signal
import time
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from ddp_strategy.errors import DDPStrategyError
from ddp_strategy.preemption import (
    NoticeWatch,
    Preempted,
    PreemptionAgreement,
    exit_code,
    parse_signals,
    stop_message,
)


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


def _fake_trainer(environment: object) -> SimpleNamespace:
    from ddp_strategy._compat.lightning import pl

    trainer = SimpleNamespace(
        _accelerator_connector=SimpleNamespace(cluster_environment=environment),
        strategy=SimpleNamespace(launcher=None, root_device="cpu"),
        world_size=1,
        local_rank=0,
    )
    trainer._signal_connector = pl.trainer.connectors.signal_connector._SignalConnector(trainer)
    return trainer


def test_lightning_keeps_its_other_handlers_and_ours_restores_at_teardown(monkeypatch):
    from ddp_strategy._compat.lightning import fabric
    from ddp_strategy._compat.signals import handle_signals_during_run

    monkeypatch.setenv("SLURM_JOB_ID", "1")  # Lightning's auto-requeue handler for SIGUSR1 is registered
    seen: list[tuple[str, int]] = []

    def user(signum: int, frame: object) -> None:  # a handler the script had before fit
        seen.append(("user", signum))

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    signal.signal(signal.SIGTERM, user)
    try:
        environment = fabric.plugins.environments.SLURMEnvironment(auto_requeue=True)
        trainer = _fake_trainer(environment)
        connector, restored = trainer._signal_connector, []
        handle_signals_during_run(
            trainer, [signal.SIGTERM], lambda s: seen.append(("ours", s)), lambda: restored.append(1)
        )
        connector.register_signal_handlers()
        usr1 = signal.getsignal(signal.SIGUSR1)
        assert [h.__name__ for h in usr1.signal_handlers] == ["_slurm_sigusr_handler_fn"]  # Lightning's, untouched
        signal.raise_signal(signal.SIGTERM)
        assert seen == [("ours", signal.SIGTERM), ("user", signal.SIGTERM)]
        assert not connector.received_sigterm  # Lightning's notifier (and its broadcast) did not run
        connector.teardown()
        assert signal.getsignal(signal.SIGTERM) is user and restored == [1]
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_a_signal_that_led_to_no_stop_is_delivered_again():
    from ddp_strategy import SafeDDPStrategy
    from ddp_strategy.callbacks.preemption_stop import PreemptionStop

    strategy = SafeDDPStrategy(preemption_signals=["SIGUSR1"])
    agreement = PreemptionAgreement(rank=0, world_size=1)
    agreement.request(signal.SIGUSR1)  # received after the ranks' last agreement: no stop happened
    strategy._preemption.stop = PreemptionStop(agreement, lambda: None, lambda: None)
    seen: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda s, f: seen.append(s))
    try:
        strategy._preemption.deliver_unused_signal()
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen == [signal.SIGUSR1]
        strategy._preemption.stop.stopped = (3, "x")  # after a stop: nothing is delivered again
        strategy._preemption.deliver_unused_signal()
        time.sleep(0.1)
        assert seen == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, previous)


def _stopped_rank_that_aborts_at_exit(out: str) -> None:
    """A spawn rank that stops for SIGTERM (``Preempted``) with something that aborts at interpreter exit, as the
    SIGABRT once seen after a correct stop ("terminate called without an active exception"); it has a child
    process of its own, as a DataLoader worker."""
    import atexit
    import multiprocessing
    import os
    import sys

    worker = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(600,), daemon=True)
    worker.start()
    with open(out, "w") as f:
        f.write(str(worker.pid))
    atexit.register(os.abort)
    print("the stop line", flush=False)
    sys.stdout.write("unflushed tail")
    raise Preempted("stopped", signal_name="SIGTERM", code=exit_code(signal.SIGTERM), step=6, path=None)


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(")")[-1].split()[0] != "Z"  # a zombie has ended


@pytest.mark.timeout(120)
@pytest.mark.parametrize("at_once", [True, False], ids=["exit_at_once_on_stop", "plain"])
def test_a_stopped_spawn_rank_exits_with_its_code_whatever_happens_at_interpreter_exit(tmp_path, capfd, at_once):
    """The spawn launcher runs each rank's function through exit_at_once_on_stop: a preemption stop ends the
    process with 143 before finalization (flushing output, ending its child processes), so an abort at exit cannot
    turn it into SIGABRT. The plain case shows the hazard the wrapper removes."""
    import functools
    import multiprocessing

    from ddp_strategy._compat.launchers import exit_at_once_on_stop

    out = tmp_path / "worker.pid"
    target = functools.partial(_stopped_rank_that_aborts_at_exit, str(out))
    if at_once:
        target = functools.partial(exit_at_once_on_stop, target, frozenset({143, 138}), None)
    rank = multiprocessing.get_context("spawn").Process(target=target)
    rank.start()
    rank.join(60)
    worker = int(out.read_text())
    if at_once:
        assert rank.exitcode == 143
        assert not _alive(worker), "the rank's own child process was left running"
        assert "the stop line\nunflushed tail" in capfd.readouterr().out
    else:
        assert rank.exitcode == -signal.SIGABRT
        if _alive(worker):
            import os

            os.kill(worker, signal.SIGKILL)


def test_exit_at_once_on_stop_passes_other_exits_and_errors_on():
    from ddp_strategy._compat.launchers import exit_at_once_on_stop

    def raising(error: BaseException) -> None:
        raise error

    with pytest.raises(SystemExit) as stop:
        exit_at_once_on_stop(raising, frozenset({143}), None, SystemExit(1))
    assert stop.value.code == 1
    with pytest.raises(ValueError, match="bad"):
        exit_at_once_on_stop(raising, frozenset({143}), None, ValueError("bad"))
    assert exit_at_once_on_stop(lambda x: x + 1, frozenset({143}), None, 1) == 2


class _CountingStore:
    """The training thread's store: counts its operations (the watch uses the store underneath directly)."""

    def __init__(self, inner: dist.Store) -> None:
        self.inner, self.ops = inner, 0

    def __getattr__(self, name: str):
        method = getattr(self.inner, name)

        def counted(*args, **kwargs):
            self.ops += 1
            return method(*args, **kwargs)

        return counted


def _await(condition, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "not within the bound"
        time.sleep(0.005)


@pytest.mark.timeout(60)
def test_with_watches_no_store_work_per_step_before_a_signal_and_every_rank_learns_at_once():
    """Issue 32: each rank's NoticeWatch blocks in one store wait; the training thread reads no store per step before
    a signal, and learns of rank 1's signal within milliseconds although its own lookup would be an hour away."""
    inner = dist.HashStore()
    store = _CountingStore(inner)
    watches = [NoticeWatch(inner, rank=r, renew=3600) for r in range(3)]
    agreements = [PreemptionAgreement(rank=r, world_size=3, poll_interval=3600.0, watch=watches[r]) for r in range(3)]
    for step in range(1, 51):
        assert not any(a.at_step_boundary(store, step) for a in agreements)
    assert store.ops == 0  # 150 step boundaries, no store operation
    agreements[1].request(signal.SIGTERM)
    assert not agreements[1].at_step_boundary(store, 51)  # publishes the notice and acks
    _await(lambda: all(w.notice is not None for w in watches))  # the store woke every watch
    stopped: dict[int, int] = {}
    for step in range(52, 60):  # lockstep from the next boundary on: ranks 0 and 2 ack at 52
        for a in agreements:
            if a.rank not in stopped and a.at_step_boundary(store, step):
                stopped[a.rank] = step
    assert stopped == {0: 53, 1: 53, 2: 53}  # max(acks 51, 52, 52) + 1
    assert store.ops <= 3 * 6  # per rank: publish or read the notice, append, count, stop-step lookups at 52-53
    assert all(not w.thread.is_alive() for w in watches)


@pytest.mark.timeout(60)
def test_a_watch_ends_when_the_run_ends_without_a_notice():
    inner = dist.HashStore()
    watches = [NoticeWatch(inner, rank=r, renew=3600) for r in range(2)]
    NoticeWatch.close_for_all(inner)
    _await(lambda: not any(w.thread.is_alive() for w in watches))
    assert all(w.notice is None for w in watches)
    late = NoticeWatch(inner, rank=2, renew=3600)  # a watch started after the end sees the end at once
    _await(lambda: not late.thread.is_alive())
    assert late.notice is None
