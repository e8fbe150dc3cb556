"""The rendezvous that reports: who joined, who is missing, and set-ups that disagree, before ``init_process_group``.

Each rank connects to (rank 0: hosts) the rendezvous ``TCPStore`` as torch's ``env://`` does, announces itself in
the namespace ``ddp_strategy/rendezvous/`` and blocks in one ``wait`` for the ``outcome`` key, woken every
``report_interval`` to say what it sees; the same store then goes to ``init_process_group``. Store operations per
rank, whatever the world size: ``compare_set`` of ``setup`` (the first rank's announcement: the set-up and the
strategy options every later rank compares its own with; that first rank is the reporter), ``compare_set`` of
``rank/<r>`` (its announcement; a second claimant of the rank is named), ``append`` to ``joined-ranks``, ``add`` to
``joined`` (the rank that makes it the world size writes ``outcome = ok``), the ``wait`` and one ``get``. Per
interval: the reporter reads ``joined-ranks`` and the joined ranks' announcements (``multi_get``, 256 keys a call);
every other local rank 0 reads the count (one ``add`` of 0). A rank with another set-up or other options writes the
error as ``outcome``, which wakes every rank that joined; the reporter writes the timeout's.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, NoReturn, cast

import torch.distributed as dist

from .errors import RendezvousError, SetupMismatchError
from .options import default_option_text
from .positions import format_ranks
from .store import Store

__all__ = ["PREFIX", "Member", "join", "member_of", "open_rendezvous"]

log = logging.getLogger(__name__)

PREFIX = "ddp_strategy/rendezvous/"  # beside torch's "default_pg/" and the control plane's "default_pg/ddp_strategy/"
_BATCH = 256  # announcements per multi_get
_LISTED = 12  # node groups listed per line; the rest are counted
_LINGER = 10.0  # seconds the store's host waits for the ranks to read an error before it raises (and exits)


@dataclass(frozen=True)
class Member:
    """What a rank announces: who it is, the set-up it was started for and its strategy's options.

    ``options`` is the JSON text of ``{name: value}`` of the options every rank must be given alike
    (:func:`~ddp_strategy.options.options_to_agree`: those not at their defaults, and the backend); ``made_at`` the
    user's line that made the strategy.
    """

    rank: int
    world_size: int
    num_nodes: int
    devices: int
    node_rank: int
    local_rank: int
    host: str
    environment: str
    options: str = "{}"
    made_at: str = ""

    @property
    def setup(self) -> tuple[int, int, int]:
        """``(world_size, num_nodes, devices)``: what every rank must agree on."""
        return self.world_size, self.num_nodes, self.devices

    def who(self) -> str:
        """E.g. ``"rank 1 (node 1, local rank 0, host gpu7)"``."""
        return f"rank {self.rank} (node {self.node_rank}, local rank {self.local_rank}, host {self.host})"

    def setup_text(self) -> str:
        """E.g. ``"world size 2 (num_nodes=2, devices=1)"``."""
        return f"world size {self.world_size} (num_nodes={self.num_nodes}, devices={self.devices})"

    def option_values(self) -> dict[str, str]:
        """``options`` as ``{name: value}``."""
        return dict(json.loads(self.options))

    def to_json(self) -> str:
        """The announcement as stored."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: bytes | str) -> Member:
        """An announcement read from the store."""
        return cls(**json.loads(text))


def member_of(strategy: Any, options: Mapping[str, str], made_at: str = "") -> Member:
    """This rank's announcement, from a DDP strategy whose world ranks are set (``set_world_ranks``).

    Args:
        strategy: the strategy.
        options: the options every rank must be given alike (``SafeDDPStrategy.agreed_options``).
        made_at: the user's line that made the strategy (``SafeDDPStrategy.made_at``).

    """
    return Member(
        rank=int(strategy.global_rank),
        world_size=int(strategy.world_size),
        num_nodes=int(strategy.num_nodes),
        devices=int(strategy.num_processes),
        node_rank=int(strategy.node_rank),
        local_rank=int(strategy.local_rank),
        host=socket.gethostname(),
        environment=type(strategy.cluster_environment).__name__,
        options=json.dumps(dict(options), sort_keys=True),
        made_at=made_at,
    )


def open_rendezvous(
    me: Member, address: str, port: int, *, interval: float, timeout: timedelta | None, pg_timeout: timedelta
) -> Any:
    """Connect to (rank 0: host) the store at ``address:port``, join, and return the store for ``init_process_group``.

    Under torchrun with ``TORCHELASTIC_USE_AGENT_STORE`` every rank is a client of the agent's store; a restarted
    attempt's keys get the prefix ``/worker/attempt_<n>`` (pytorch/pytorch#135712: without it the restarted workers
    read the previous attempt's addresses).

    Args:
        me: this rank's announcement.
        address: ``MASTER_ADDR``.
        port: ``MASTER_PORT``.
        interval: seconds between report lines while ranks are missing (or while the store cannot be reached).
        timeout: how long to wait for every rank; ``None``: ``pg_timeout``.
        pg_timeout: the process group's timeout, which the returned store keeps.

    Raises:
        RendezvousError: the store cannot be reached, or ranks are missing, when the timeout ends.
        SetupMismatchError: ranks were started for different set-ups, or two claim one rank.

    """
    deadline = time.monotonic() + (timeout or pg_timeout).total_seconds()
    where = f"{address}:{port}"
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and (
        os.environ.get("MASTER_ADDR"),
        os.environ.get("MASTER_PORT"),
    ) == (address, str(port))
    hosts = me.rank == 0 and not agent
    store: Any
    if hosts:  # as torch's env:// (multi-tenant, libuv), except that it does not wait for the workers to connect
        store = dist.TCPStore(  # type: ignore[attr-defined]
            address, port, me.world_size, True, timedelta(seconds=interval), wait_for_workers=False, multi_tenant=True
        )
    else:
        store = _connect(me, address, port, interval, deadline)
    store.set_timeout(pg_timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if agent and attempt not in ("", "0"):
        store = dist.PrefixStore(f"/worker/attempt_{attempt}", store)  # type: ignore[attr-defined]
    namespace = cast(Store, dist.PrefixStore(PREFIX, store))  # type: ignore[attr-defined]
    join(namespace, me, where=where, interval=interval, deadline=deadline, hosts=hosts)
    return store


def _connect(me: Member, address: str, port: int, interval: float, deadline: float) -> Any:
    """A client of the store at ``address:port``: one line per ``interval`` while unreachable; raise at ``deadline``."""
    start = time.monotonic()
    while True:
        tried = time.monotonic()
        try:
            wait = timedelta(seconds=max(1.0, min(interval, deadline - tried)))
            client = dist.TCPStore(address, port, me.world_size, False, wait, wait_for_workers=False)  # type: ignore[attr-defined]
            return client
        except dist.DistError as err:  # torch retried inside for `wait`: refused, unresolvable, timed out
            message = (
                f"Rendezvous: {me.who()} cannot reach the rendezvous store at {address}:{port} "
                f"(MASTER_ADDR:MASTER_PORT) after {time.monotonic() - start:.0f} s ({str(err).splitlines()[0]}). "
                f"Check that node 0 (NODE_RANK=0, global rank 0) is running, that MASTER_ADDR={address} is node 0's "
                f"address as this host reaches it, that MASTER_PORT={port} is the same on every node, and that no "
                "firewall blocks that port."
            )
            if time.monotonic() >= deadline:
                raise RendezvousError(message, address=f"{address}:{port}", missing_ranks=[0]) from err
            log.warning(message)
            time.sleep(max(0.0, min(interval - (time.monotonic() - tried), deadline - time.monotonic())))


def join(store: Store, me: Member, *, where: str, interval: float, deadline: float, hosts: bool = False) -> None:
    """Announce ``me``, then wait until every rank joined, reporting every ``interval`` (module docstring: the keys).

    Args:
        store: the rendezvous namespace of the store.
        me: this rank's announcement.
        where: ``MASTER_ADDR:MASTER_PORT``, for the messages.
        interval: seconds between report lines.
        deadline: ``time.monotonic()`` at which the wait ends with :class:`RendezvousError`.
        hosts: whether this process hosts the store: it gives the others time to read an error before raising.

    """
    mine = me.to_json()
    first = Member.from_json(store.compare_set("setup", "", mine))
    if first.setup != me.setup or not 0 <= me.rank < me.world_size:
        _decide(store, me, _mismatch(me, first, int(store.add("joined", 0))), where, hosts, joined=False)
    if first.options != me.options:
        _decide(store, me, _options_mismatch(me, first, int(store.add("joined", 0))), where, hosts, joined=False)
    holder = Member.from_json(store.compare_set(f"rank/{me.rank}", "", mine))
    if holder != me:
        _decide(store, me, _duplicate(me, holder), where, hosts, joined=False)
    store.append("joined-ranks", f"{me.rank},")
    if int(store.add("joined", 1)) == me.world_size:
        store.compare_set("outcome", "", "ok")
    reporter, start, grace = first == me, time.monotonic(), 0.0
    while not _outcome_set(store, min(interval, deadline + grace - time.monotonic()), me, where):
        if time.monotonic() < deadline:
            _report(store, me, first, where, time.monotonic() - start, reporter=reporter)
        elif reporter:
            _decide(store, me, _timed_out(store, me, where, time.monotonic() - start), where, hosts, joined=True)
        elif not grace:  # the reporter names the missing ranks: give it a moment to write that outcome
            grace = min(interval, _LINGER)
        else:
            _timed_out_unnamed(store, me, where, time.monotonic() - start)
    outcome = store.get("outcome")
    if outcome != b"ok":
        _raise(store, me, json.loads(outcome), hosts)


def _outcome_set(store: Store, seconds: float, me: Member, where: str) -> bool:
    """Wait up to ``seconds`` for the ``outcome`` key; whether it is set (``False``: the wait timed out)."""
    if seconds <= 0:
        return False
    try:  # at least 10 ms: a timeout that rounds to 0 ms would wait forever (torch's kNoTimeout)
        store.wait(["outcome"], timedelta(seconds=max(seconds, 0.01)))
    except dist.DistNetworkError as err:
        raise RendezvousError(_gone(me, where), address=where, missing_ranks=[0]) from err
    except dist.DistStoreError:  # the wait timed out
        return False
    return True


def _report(store: Store, me: Member, first: Member, where: str, waited: float, *, reporter: bool) -> None:
    """One line while ranks are missing: the reporter lists them by node, another local rank 0 gives the count."""
    head = f"Rendezvous at {where}: "
    if reporter:
        joined = _joined(store)
        log.warning(head + _missing_text(me, joined, waited) + " " + _causes(me, where))
    elif me.local_rank == 0:
        count = int(store.add("joined", 0))
        log.warning(
            f"{head}{me.who()} waits for the other ranks: {count} of {me.world_size} joined after {waited:.0f} s; "
            f"{first.who()}, the first to join, lists the missing ones."
        )


def _joined(store: Store) -> dict[int, Member]:
    """The joined ranks' announcements (the reporter only: one ``get`` and ``W/256`` ``multi_get`` calls)."""
    ranks = sorted({int(r) for r in store.get("joined-ranks").decode().split(",") if r})
    members: dict[int, Member] = {}
    for i in range(0, len(ranks), _BATCH):
        batch = ranks[i : i + _BATCH]
        for rank, text in zip(batch, store.multi_get([f"rank/{r}" for r in batch]), strict=True):
            members[rank] = Member.from_json(text)
    return members


def _missing_text(me: Member, joined: dict[int, Member], waited: float) -> str:
    missing = [r for r in range(me.world_size) if r not in joined]
    hosts: dict[tuple[int, str], list[int]] = {}
    for member in joined.values():
        hosts.setdefault((member.node_rank, member.host), []).append(member.rank)
    nodes: dict[int, list[int]] = {}
    for rank in missing:
        nodes.setdefault(rank // me.devices, []).append(rank)
    seen = [f"node {n} on {h}: {_ranks(r)}" for (n, h), r in sorted(hosts.items())]
    gaps = [f"node {n}: {_ranks(r)}" for n, r in sorted(nodes.items())]
    return (
        f"{len(joined)} of {me.world_size} ranks joined after {waited:.0f} s (started for {me.setup_text()}, "
        f"cluster environment {me.environment}). Joined: {_listed(seen)}. Missing: {_listed(gaps)}."
    )


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {format_ranks(ranks)}"


def _listed(groups: list[str]) -> str:
    more = f"; and {len(groups) - _LISTED} more nodes" if len(groups) > _LISTED else ""
    return "; ".join(groups[:_LISTED]) + more if groups else "none"


def _causes(me: Member, where: str) -> str:
    """The likely causes of missing ranks under the launcher in use."""
    port = where.rsplit(":", 1)[1]
    if me.environment == "SLURMEnvironment":
        return (
            f"Likely causes: SLURM started fewer than {me.world_size} tasks: the job needs --nodes={me.num_nodes} and "
            f"--ntasks-per-node={me.devices} (equal to Trainer(devices=...)), and the script must run under srun; "
            f"or a task failed before this point (see its output); or a firewall blocks port {port} between the nodes."
        )
    if me.environment == "TorchElasticEnvironment":
        return (
            "Likely causes: torchrun's agents had all met before they started the workers, so a missing rank is a "
            "worker that failed or hangs before the strategy's setup (see that node's output), e.g. Lightning's "
            "ValueError when Trainer(num_nodes=..., devices=...) does not match torchrun's --nnodes/--nproc-per-node."
        )
    return (
        f"Likely causes: a node that was not started, or failed before this point (see its output); a node started "
        f"with another MASTER_ADDR/MASTER_PORT (every node needs {where}, node 0's address as the others reach it); "
        f"two nodes with the same NODE_RANK (each needs its own, 0 to {me.num_nodes - 1}); a node started with other "
        f"num_nodes/devices; a firewall that blocks port {port} between the hosts."
    )


def _mismatch(me: Member, first: Member, joined: int) -> dict[str, Any]:
    names = ("world_size", "num_nodes", "devices")
    fields = [name for name, a, b in zip(names, first.setup, me.setup, strict=True) if a != b]
    if not fields:  # the same set-up, but a rank outside it: NODE_RANK >= num_nodes
        return {
            "fields": ["rank"],
            "message": f"{me.who()} is outside {me.setup_text()}: its NODE_RANK ({me.node_rank}) must be 0 to "
            f"{me.num_nodes - 1}. Give each node its own NODE_RANK below num_nodes.",
        }
    return {
        "fields": fields,
        "message": f"The ranks were started for different set-ups: {me.who()} for {me.setup_text()}, but "
        f"{first.who()}, the first of the {joined} rank(s) that joined before it, for {first.setup_text()} "
        f"({_environments(me, first)}). Start every node with the same "
        "Trainer(num_nodes=..., devices=...) (under SLURM: --nodes and --ntasks-per-node; under torchrun: --nnodes "
        "and --nproc-per-node), each with its own NODE_RANK.",
    }


def _options_mismatch(me: Member, first: Member, joined: int) -> dict[str, Any]:
    mine, theirs = me.option_values(), first.option_values()
    fields = sorted(name for name in {*mine, *theirs} if mine.get(name) != theirs.get(name))

    def listed(member: Member, values: dict[str, str]) -> str:
        text = ", ".join(
            f"{name}={values[name]}" if name in values else f"{name}={default_option_text(name)} (the default)"
            for name in fields
        )
        return f"{text} (strategy made at {member.made_at})" if member.made_at else text

    return {
        "fields": fields,
        "message": f"The ranks were started with different strategy options: {me.who()} has {listed(me, mine)}, "
        f"but {first.who()}, the first of the {joined} rank(s) that joined before it, has {listed(first, theirs)}. "
        "These options decide which collectives a rank makes (preemption_signals: Lightning's broadcast before every "
        "training batch; weight_check, sharding_check, uneven_inputs, handshake: the control plane's gathers; "
        "exact_evaluation: the evaluation batches; DDP's keyword arguments: the gradient all-reduces), so ranks "
        "given different ones would wait for each other forever or mix their values. Give every rank the same "
        "SafeDDPStrategy(...) arguments: look for a value read from the rank's environment (LOCAL_RANK, NODE_RANK, "
        "the host name) or from a file that differs between nodes.",
    }


def _environments(me: Member, first: Member) -> str:
    if me.environment == first.environment:
        return f"cluster environment {me.environment}"
    return f"cluster environments {me.environment} and {first.environment}"


def _duplicate(me: Member, holder: Member) -> dict[str, Any]:
    return {
        "fields": ["rank"],
        "message": f"Two processes claim global rank {me.rank}: {holder.who()} and {me.who()}. Each node needs its "
        f"own NODE_RANK (0 to {me.num_nodes - 1}), and each process of a node its own LOCAL_RANK.",
    }


def _timed_out(store: Store, me: Member, where: str, waited: float) -> dict[str, Any]:
    joined = _joined(store)
    return {
        "missing": [r for r in range(me.world_size) if r not in joined],
        "message": f"The rendezvous at {where} timed out: {_missing_text(me, joined, waited)} {_causes(me, where)} "
        "Raise SafeDDPStrategy(rendezvous_timeout=...) if some nodes start that much later.",
    }


def _timed_out_unnamed(store: Store, me: Member, where: str, waited: float) -> NoReturn:
    count = int(store.add("joined", 0))
    raise RendezvousError(
        f"The rendezvous at {where} timed out for {me.who()}: {count} of {me.world_size} ranks joined after "
        f"{waited:.0f} s; the first rank to join names the missing ones in its output.",
        address=where,
        missing_ranks=[],
    )


def _gone(me: Member, where: str) -> str:
    return (
        f"The rendezvous store at {where} went away while {me.who()} waited for the other ranks: its host (global "
        "rank 0, node 0) ended; its output says why."
    )


def _decide(store: Store, me: Member, verdict: dict[str, Any], where: str, hosts: bool, *, joined: bool) -> NoReturn:
    """Write ``verdict`` as the outcome unless one exists (every joined rank wakes with it), then raise it.

    ``joined``: whether this rank is counted in ``joined`` (its readers are the joined ranks, and itself).
    """
    verdict = {**verdict, "where": where, "readers": int(store.add("joined", 0)) + (0 if joined else 1)}
    outcome = store.compare_set("outcome", "", json.dumps(verdict))
    _raise(store, me, verdict if outcome == b"ok" else json.loads(outcome), hosts)


def _raise(store: Store, me: Member, verdict: dict[str, Any], hosts: bool) -> NoReturn:
    """Raise the agreed error; the store's host first waits (bounded) until every rank that joined has read it."""
    try:
        if int(store.add("seen", 1)) >= verdict["readers"]:
            store.set("seen-all", "1")
        if hosts:
            store.wait(["seen-all"], timedelta(seconds=_LINGER))
    except dist.DistError as err:  # the host left (no one waits for this rank), or a rank did not read in time
        log.warning("Rendezvous: not every rank may have read the error (%s); those report the store as gone.", err)
    if "missing" in verdict:
        raise RendezvousError(verdict["message"], address=verdict["where"], missing_ranks=verdict["missing"])
    raise SetupMismatchError(verdict["message"], fields=verdict["fields"])
