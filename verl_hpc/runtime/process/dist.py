"""Process groups for the RL roles, and barriers that say who is missing.

Why this module: the trainer, rollout and reward processes share one torch.distributed
world (one rendezvous, one Slurm het step) but talk in subsets: FSDP inside the trainer,
weight broadcast trainer -> rollout, control messages across everyone. Building every
group here, in one fixed order, is what keeps the ranks from deadlocking at start-up.

The top complaint about multi-role RL jobs is "NCCL hang without a culprit". So control
synchronisation goes through a gloo group and `monitored_barrier`, and a timeout raises
`DistTimeoutError` naming the roles and ranks that never arrived.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist
from torch.distributed import ProcessGroup

from verl_hpc.config.placement import GroupSpec, ProcessPlan
from verl_hpc.runtime.process.env import JobEnvironment
from verl_hpc.transport.weights.base import SyncLinks
from verl_hpc.transport.weights.chain import Relay, chain_links, relay_for
from verl_hpc.transport.weights.shard import ShardLinks

T = TypeVar("T")
TRAINER = "trainer"
_KEY_PREFIX = "verl_hpc/barrier"
# Rank 0's text: "[Rank 0]: Ranks 1, 3 failed to pass monitoredBarrier in 3000 ms"
# (wait_all_ranks=True) or "[Rank 0]: Rank 3 failed to pass ..." (first failure only).
_FAILED_RANKS = re.compile(r"Ranks? ([\d,\s]+?) failed to pass monitoredBarrier")


class DistTimeoutError(RuntimeError):
    """A barrier timed out; `missing` maps each missing global rank to its group name."""

    def __init__(self, message: str, barrier: str, missing: dict[int, str]):
        super().__init__(message)
        self.barrier = barrier
        self.missing = missing


def parse_failed_ranks(text: str) -> list[int]:
    """Ranks named by rank 0's monitored_barrier error; [] when the text names none.

    Only rank 0 learns who failed: other ranks only see that rank 0 did not answer.
    """
    match = _FAILED_RANKS.search(text)
    if match is None:
        return []
    return [int(part) for part in match.group(1).replace(",", " ").split()]


@dataclass
class DistContext:
    """This process's groups, as built by `init_distributed`.

    `groups` and `sync_groups` hold only the groups this rank belongs to: using another
    group's handle is a silent no-op in torch, a KeyError here is a clear bug report.
    """

    env: JobEnvironment
    plan: ProcessPlan
    group: GroupSpec
    rank_in_group: int
    groups: dict[str, ProcessGroup]
    control_group: ProcessGroup
    sync_groups: dict[str, ProcessGroup]
    timeout_seconds: float
    # Per non-trainer group: every trainer rank + that group's ranks (remote role exchanges).
    exchange_groups: dict[str, ProcessGroup] = field(default_factory=dict)
    # With a critic group of its own: gloo over trainer + critic ranks, for the checkpoint both
    # write (and a second one for its async finish); None when the trainers hold every state.
    state_group: ProcessGroup | None = None
    state_async_group: ProcessGroup | None = None
    # gloo over the trainer ranks, for async checkpoint writes (never the training group:
    # DCP's async finish on a group that training also uses deadlocks).
    checkpoint_group: ProcessGroup | None = None
    # This rank's links in the weight sync's chain through several rollout ranks (None: not in one).
    weight_relay: Relay | None = None
    # A sharded trainer's direct weight sync (transport/weights/shard.py): a trainer rank's pair group
    # with the first rollout rank, and that rollout rank's pairs with every trainer rank.
    shard_link: ProcessGroup | None = None
    shard_links: ShardLinks | None = None
    _barrier_counts: dict[str, int] = field(default_factory=dict, repr=False)

    @property
    def process_group(self) -> ProcessGroup:
        """The group of identical processes this rank belongs to (FSDP's world, say)."""
        return self.groups[self.group.name]

    def is_role(self, role: str) -> bool:
        return role in self.group.roles

    def weight_links(self) -> SyncLinks:
        """The groups this rank's weight syncs with the rollout group travel over."""
        return SyncLinks(self.sync_groups.get("rollout"), self.plan.group_ranks(self.plan.groups[0].name)[0],
                         self.weight_relay, self.shard_link, self.shard_links)

    def barrier(self, name: str, timeout_seconds: float | None = None) -> None:
        """Wait for every rank; on timeout raise DistTimeoutError naming who did not arrive.

        Why both monitored_barrier and the store: rank 0 learns the missing ranks from
        monitored_barrier's error, but the other ranks only learn that rank 0 did not
        answer. Each rank therefore records its arrival in the rendezvous store, so every
        rank can name the culprit itself. After a timeout the control group is no longer
        trustworthy (a late rank may still enter): treat the error as fatal.
        """
        timeout = self.timeout_seconds if timeout_seconds is None else timeout_seconds
        seq = self._barrier_counts.get(name, 0) + 1
        self._barrier_counts[name] = seq
        key = f"{_KEY_PREFIX}/{name}/{seq}"
        store = default_store()
        _store_call(lambda: store.append(key, f"{self.env.rank} "))
        try:
            dist.monitored_barrier(group=self.control_group, timeout=timedelta(seconds=timeout),
                                   wait_all_ranks=True)
        except RuntimeError as err:
            missing = self._missing_ranks(str(err), store, key)
            by_rank = {r: self.plan.locate(r)[0].name for r in missing or []}
            raise DistTimeoutError(self._timeout_message(name, timeout, missing, str(err)), name,
                                   by_rank) from err
        if self.env.rank == 0:
            # Everyone has appended by now; drop the key so long runs don't fill the store.
            _store_call(lambda: store.delete_key(key))

    def _missing_ranks(self, text: str, store: dist.Store | None, key: str) -> list[int] | None:
        """Global ranks that did not arrive; None when the store (rank 0's) cannot say."""
        named = parse_failed_ranks(text)
        if named:
            return sorted(dist.get_global_rank(self.control_group, r) for r in named)
        raw = _store_call(lambda: store.get(key) if store.check([key]) else b"")
        if raw is None:
            return None
        arrived = {int(r) for r in raw.decode().split()} | {self.env.rank}
        return [r for r in range(self.env.world_size) if r not in arrived]

    def _timeout_message(self, name: str, timeout: float, missing: list[int] | None, text: str) -> str:
        head = f"barrier {name!r} timed out after {timeout:g} s on rank {self.env.rank} ({self.group.name})"
        if missing is None:
            return (f"{head}: the rendezvous store (hosted by rank 0, or by torchrun's agent) did not "
                    f"answer, so rank 0 ({self.plan.locate(0)[0].name}) has probably died; see its log")
        if not missing:
            return (f"{head}: every rank arrived but rank 0 (the coordinator) did not confirm in time; "
                    f"see rank 0's log. torch said: {text.splitlines()[0] if text else ''}")
        specs = {g.name: g for g in self.plan.groups}
        by_group: dict[str, list[int]] = {}
        for rank in missing:
            by_group.setdefault(self.plan.locate(rank)[0].name, []).append(rank)
        parts = [f"group {g!r} (roles {'/'.join(specs[g].roles)}) rank(s) {', '.join(map(str, ranks))}"
                 for g, ranks in by_group.items()]
        return f"{head}: did not arrive: {'; '.join(parts)}; check those processes' logs"

    def destroy(self) -> None:
        """Tear down every group (idempotent), so a process can exit or re-init cleanly."""
        if dist.is_initialized():
            dist.destroy_process_group()


def default_store() -> dist.Store | None:
    """The rendezvous store of the default group (private in torch, stable since 1.x)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def _store_call(fn: Callable[[], T]) -> T | None:
    """Run a store operation, None on failure: diagnostics must never mask the real error
    (the store dies with rank 0's process, and may be absent under a custom init)."""
    try:
        return fn()
    except Exception:
        return None


def _backend_for(specs: list[GroupSpec], backend: str) -> str:
    """gloo when any member sits on CPU (nccl cannot move CPU tensors), else the default."""
    return "gloo" if any(s.resources.device_type == "cpu" for s in specs) else with_cpu_path(backend)


def with_cpu_path(backend: str) -> str:
    """An NCCL group that also carries CPU tensors, over gloo.

    Why: the trainer group moves CUDA tensors (gradients, FSDP shards) but also the
    runtime's small CPU tensors — metric means, stop and resize flags, advantage
    statistics — and NCCL alone refuses those ("No backend type associated with device
    type cpu", seen on the first GPU run). torch dispatches per tensor device when a group
    is built with one backend per device type.
    """
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else backend


def init_distributed(env: JobEnvironment, plan: ProcessPlan, backend: str,
                     timeout_seconds: float, secret: str | None = None) -> DistContext:
    """Join the world and build every group of the plan.

    Why every rank creates every group, in the same order, even groups it is not in:
    `new_group` is collective over the whole world. torch numbers groups by a per-process
    counter and meets the members through the store under that number, so a rank that
    skipped or reordered a call would pair its next group with a different one on the
    other ranks, and they would wait on each other forever.
    """
    if env.world_size != plan.world_size:
        raise ValueError(f"the job has {env.world_size} processes but the resource plan needs "
                         f"{plan.world_size} ({', '.join(f'{g.name}={g.size}' for g in plan.groups)}); "
                         "launch one process per device slot")
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process; "
                           "call DistContext.destroy() first")
    timeout = timedelta(seconds=timeout_seconds)
    if env.scheduler == "torchrun" or secret is None:  # torchrun's agent hosts (and owns) the store
        dist.init_process_group(with_cpu_path(backend), init_method=_init_method(env), rank=env.rank,
                                world_size=env.world_size, timeout=timeout)
    else:
        dist.init_process_group(with_cpu_path(backend), store=secret_store(env, secret, timeout), rank=env.rank,
                                world_size=env.world_size, timeout=timeout)
    try:
        return _build_groups(env, plan, backend, timeout, timeout_seconds)
    except BaseException:
        dist.destroy_process_group()
        raise


def secret_store(env: JobEnvironment, secret: str, timeout: timedelta) -> dist.Store:
    """Rank 0's TCP store, with every key under a name derived from the run's secret.

    Why: torch's TCPStore has no authentication and listens on all interfaces, so anyone
    who reaches MASTER_PORT could read the ranks' gloo/NCCL addresses and NCCL ids or
    overwrite them. The store has no call that lists keys, so a client that does not know
    the prefix cannot name any key of ours: it can still connect (and load the server),
    but not read or change the rendezvous. The prefix is a hash, never the secret itself,
    so the key names on the wire give away nothing that authenticates to Flight.
    """
    digest = hashlib.sha256(f"verl-hpc rendezvous\0{secret}".encode()).hexdigest()[:32]
    store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=env.rank == 0,
                          timeout=timeout)
    return dist.PrefixStore(f"verl_hpc/{digest}", store)


def _init_method(env: JobEnvironment) -> str:
    """torchrun's agent hosts the store at MASTER_PORT (env://); elsewhere rank 0 hosts it."""
    if env.scheduler == "torchrun":
        return "env://"
    host = f"[{env.master_addr}]" if ":" in env.master_addr else env.master_addr
    return f"tcp://{host}:{env.master_port}"


def _build_groups(env: JobEnvironment, plan: ProcessPlan, backend: str, timeout: timedelta,
                  timeout_seconds: float) -> DistContext:
    control = dist.new_group(backend="gloo", timeout=timeout)
    mine, rank_in_group = plan.locate(env.rank)
    groups: dict[str, ProcessGroup] = {}
    for spec in plan.groups:
        pg = dist.new_group(ranks=plan.group_ranks(spec.name), timeout=timeout,
                            backend=_backend_for([spec], backend))
        if spec.name == mine.name:
            groups[spec.name] = pg
    trainer = next((g for g in plan.groups if g.name == TRAINER), plan.groups[0])
    leader = plan.group_ranks(trainer.name)[0]
    sync_groups: dict[str, ProcessGroup] = {}
    for spec in plan.groups:
        if spec.name == trainer.name:
            continue
        ranks = [leader, *plan.group_ranks(spec.name)]
        pg = dist.new_group(ranks=ranks, timeout=timeout, backend=_backend_for([trainer, spec], backend))
        if env.rank in ranks:
            sync_groups[spec.name] = pg
    trainer_ranks = plan.group_ranks(trainer.name)
    exchange_groups: dict[str, ProcessGroup] = {}
    for spec in plan.groups:
        if spec.name == trainer.name:
            continue
        ranks = [*trainer_ranks, *plan.group_ranks(spec.name)]
        pg = dist.new_group(ranks=ranks, timeout=timeout, backend="gloo")  # Arrow bytes: host memory
        if env.rank in ranks:
            exchange_groups[spec.name] = pg
    relay = _build_relay(env, plan, trainer, leader, backend, timeout)
    shard_link, shard_links = _build_shard_links(env, plan, trainer, backend, timeout)
    ckpt = dist.new_group(ranks=trainer_ranks, timeout=timeout, backend="gloo")
    state_groups: list[ProcessGroup | None] = [None, None]
    if any(spec.name == "critic" for spec in plan.groups):
        state_ranks = [*trainer_ranks, *plan.group_ranks("critic")]
        state_groups = [dist.new_group(ranks=state_ranks, timeout=timeout, backend="gloo") for _ in range(2)]
        if env.rank not in state_ranks:
            state_groups = [None, None]
    return DistContext(env=env, plan=plan, group=mine, rank_in_group=rank_in_group, groups=groups,
                       checkpoint_group=ckpt if env.rank in trainer_ranks else None,
                       control_group=control, sync_groups=sync_groups, timeout_seconds=timeout_seconds,
                       exchange_groups=exchange_groups, state_group=state_groups[0],
                       state_async_group=state_groups[1], weight_relay=relay, shard_link=shard_link,
                       shard_links=shard_links)


def _build_relay(env: JobEnvironment, plan: ProcessPlan, trainer: GroupSpec, leader: int, backend: str,
                 timeout: timedelta) -> Relay | None:
    """The weight sync's chain through a rollout group of several ranks (transport/weights/chain.py).

    Every rank of the world makes every pair group, in the same order (`new_group` is collective)."""
    rollout = _rollout_group(plan, trainer)
    if rollout is None:
        return None
    links = chain_links(leader, plan.group_ranks(rollout.name))
    groups = [dist.new_group(ranks=pair, timeout=timeout, backend=_backend_for([trainer, rollout], backend))
              for pair in links]
    return relay_for(env.rank, links, groups)


def _build_shard_links(env: JobEnvironment, plan: ProcessPlan, trainer: GroupSpec, backend: str,
                       timeout: timedelta) -> tuple[ProcessGroup | None, ShardLinks | None]:
    """Pairs (trainer rank r, first rollout rank) for a sharded trainer group: each trainer rank
    sends its own rows (transport/weights/shard.py). Collective, like the chain's pairs."""
    rollout = _rollout_group(plan, trainer)
    trainer_ranks = plan.group_ranks(trainer.name)
    if rollout is None or len(trainer_ranks) < 2 or trainer.resources.strategy != "fsdp":
        return None, None
    first = plan.group_ranks(rollout.name)[0]
    groups = [dist.new_group(ranks=[r, first], timeout=timeout, backend=_backend_for([trainer, rollout], backend))
              for r in trainer_ranks]
    mine = groups[trainer_ranks.index(env.rank)] if env.rank in trainer_ranks else None
    return mine, ShardLinks(groups, trainer_ranks) if env.rank == first else None


def _rollout_group(plan: ProcessPlan, trainer: GroupSpec) -> GroupSpec | None:
    """The group that hosts the rollout engines in a split run (None: the trainers host them)."""
    return next((spec for spec in plan.groups if spec.name != trainer.name and "rollout" in spec.roles), None)
