"""One process of the distributed runtime: `python -m verl_hpc.runtime.worker`.

Started by the local launcher or by `srun` in a Slurm (het)job; everything it needs
comes from the environment (rank, world, master) and the run directory (config.yaml).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
from pathlib import Path

# Before the heavy imports below (seconds of torch loading): a USR1/TERM that arrives while
# this process starts (a preemption, say) is recorded, not fatal. StopFlag takes it over.
_EARLY_SIGNALS: list[tuple[int, float]] = []
for _sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT):
    signal.signal(_sig, lambda signum, _frame: _EARLY_SIGNALS.append((signum, time.time())))


def _restart_under_allocator() -> None:
    """Restart this worker under the host allocator its own device gets (utils/host_allocator.py), before
    torch is loaded. Workers the local launcher starts on a CPU-only plan inherit it and go on; a
    Slurm task, or a CPU worker beside GPU ones, restarts here once."""
    from verl_hpc.config import load_config
    from verl_hpc.config.placement import plan_for_config
    from verl_hpc.runtime.process.env import JobEnvironment
    from verl_hpc.utils.host_allocator import local_choice, needs_reexec, reexec

    try:
        cfg = load_config(Path(os.environ["VERL_HPC_RUN_DIR"]) / "config.yaml")
        group, _ = plan_for_config(cfg).locate(JobEnvironment.from_env().rank)
    except Exception:  # noqa: BLE001 - main() meets the same problem and reports it, signals guarded
        return
    try:
        chosen = local_choice(cfg.resources.host_allocator, {group.resources.device_type})
    except ValueError as err:
        sys.exit(f"verl-hpc: error: resources.host_allocator: tcmalloc, but {err} on {os.uname().nodename}")
    if needs_reexec(chosen, os.environ):
        for sig in (signal.SIGUSR1, signal.SIGUSR2):  # as the batch script's wrapper left them: ignored
            signal.signal(sig, signal.SIG_IGN)
        reexec(chosen)


if __name__ == "__main__":
    _restart_under_allocator()

import traceback  # noqa: E402

from verl_hpc.config import load_config  # noqa: E402
from verl_hpc.config.placement import plan_for_config  # noqa: E402
from verl_hpc.runtime.process.dist import DistContext, default_store, init_distributed  # noqa: E402
from verl_hpc.runtime.process.endtime import EXIT_AT_DEADLINE  # noqa: E402
from verl_hpc.runtime.process.env import JobEnvironment  # noqa: E402
from verl_hpc.runtime.process.signals import EXIT_STOPPED_UNFINISHED, StopFlag, ignore_notices_until_exit  # noqa: E402
from verl_hpc.runtime.state.time_limit import TimeLimit  # noqa: E402
from verl_hpc.transport.secret import read_run_secret  # noqa: E402
from verl_hpc.utils.logging import get_logger, setup_logging  # noqa: E402
from verl_hpc.utils.proc import exit_now  # noqa: E402  (finished runs leave by it)


def redirect_output(log_dir: str | None, group: str, env: JobEnvironment) -> Path | None:
    """Append this process's stdout/stderr (fds 1 and 2) to `<log_dir>/<group>_rank<N>.out`.

    Why here and not in srun: in a het step srun's `%j` expands to the component's job id
    and `%t` is wrong, so per-rank files must be opened by the rank itself. dup2 moves the
    file descriptors, so C/C++ output (NCCL, gloo, a segfault trace) lands there too. Append
    mode keeps earlier attempts (requeues, resumed jobs) in the same file, after a header.
    """
    if not log_dir:
        return None
    path = Path(log_dir) / f"{group}_rank{env.rank}.out"
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    finally:
        os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    print(f"==== verl-hpc job {env.job_id} restart {env.restart_count} {time.strftime('%Y-%m-%d %H:%M:%S')}: "
          f"{group} rank {env.rank} of {env.world_size} on {env.hostname} (pid {os.getpid()}) ====")
    return path


def apply_comm_env(comm_env: dict[str, str], backend: str) -> None:
    """`resources.comm_env` into this process's environment, before any process group exists.

    NCCL reads its variables once, at communicator creation; setting them here (not in a
    login shell) makes a config file the single place a cluster's interconnect is described.
    With NCCL, asynchronous error handling is on unless the config says otherwise, so a dead
    peer surfaces as an error instead of a hang.
    """
    os.environ.update(comm_env)
    if backend == "nccl":
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")


def main() -> int:
    stop = StopFlag().install()  # kept until exit: a second TERM while shutting down is ignored
    for signum, at in _EARLY_SIGNALS:
        stop.record(signum, at)
    run_dir = Path(os.environ["VERL_HPC_RUN_DIR"])
    cfg = load_config(run_dir / "config.yaml")
    if cfg.trainer.torch_threads:
        import torch

        torch.set_num_threads(cfg.trainer.torch_threads)
    apply_comm_env(cfg.resources.comm_env, cfg.resources.resolved_backend())
    env = JobEnvironment.from_env()
    plan = plan_for_config(cfg)
    group, rank_in_group = plan.locate(env.rank)
    redirect_output(os.environ.get("VERL_HPC_LOG_DIR"), group.name, env)
    # A native crash (SIGSEGV/SIGABRT/SIGBUS in gloo, NCCL, Arrow) prints every thread's Python
    # stack into this rank's log, so the launcher's "last lines" say where it died.
    faulthandler.enable(all_threads=True)
    setup_logging(run_dir / "logs", group.name, env.rank, cfg.logging.level, console=rank_in_group == 0)
    env.write_debug_file(run_dir / "logs" / f"env_{group.name}_rank{env.rank}.json")
    leader = env.rank == plan.group_ranks(plan.groups[0].name)[0]
    # From here on the leader watches the end time: a start-up that eats the attempt still requeues.
    limit = TimeLimit.start(cfg, run_dir, env, leader)
    try:
        ctx = init_distributed(env, plan, cfg.resources.resolved_backend(), cfg.resources.timeout_seconds,
                               secret=read_run_secret(run_dir))
    except BaseException:
        limit.close()
        raise
    get_logger("worker").info("joined the world: rank %d of %d, %s rank %d, backend %s", env.rank,
                              env.world_size, group.name, rank_in_group, cfg.resources.resolved_backend())
    try:
        return exit_code(run_worker(cfg, ctx, run_dir, stop, limit), env, leader)
    except Exception as err:  # the launcher shows a log's last lines: make the cause the last one
        traceback.print_exc()
        get_logger("worker").error("failed: %s", err, exc_info=True)
        print(f"[{group.name} rank {env.rank}] FAILED: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        return 1
    finally:
        limit.close()
        ctx.destroy()


def exit_code(outcome, env: JobEnvironment, leader: bool) -> int:  # outcome: Outcome
    """0, or on the leader of a run that stopped early and was not requeued: under Slurm
    EXIT_STOPPED_UNFINISHED (such a job must not look COMPLETED), under the local launcher
    EXIT_AT_DEADLINE after a stop at the `--time-limit` deadline (how `verl-hpc train` learns
    that the run is not finished)."""
    if outcome.stopped_by is None:
        return 0
    get_logger("worker").info("stopped: %s", outcome.stopped_by)
    if not leader or not outcome.wanted_requeue or outcome.requeued:
        return 0
    if env.scheduler == "slurm":
        return EXIT_STOPPED_UNFINISHED
    return EXIT_AT_DEADLINE if outcome.stop is not None and outcome.stop.path == "deadline" else 0


def run_worker(cfg, ctx: DistContext, run_dir: Path, stop: StopFlag, limit: TimeLimit):  # -> Outcome
    """This process's part of the run: the one loop on the placement the plan gives it."""
    from verl_hpc.runtime.lifecycle import RunLifecycle
    from verl_hpc.runtime.placement import build_distributed
    from verl_hpc.runtime.process.heartbeat import Heartbeat
    from verl_hpc.runtime.state.checkpointing import RunCheckpointer, build_manager
    from verl_hpc.runtime.state.seeding import seed_all
    from verl_hpc.runtime.step.kinds import build_step

    seed_all(cfg.trainer.seed + ctx.env.rank)
    heartbeat = Heartbeat(ctx.plan, ctx.env.rank, default_store())
    heartbeat.start()
    placement = build_distributed(cfg, ctx, run_dir, heartbeat)
    try:
        checkpointer = None
        if ctx.is_role("actor") or ctx.group.name == "critic":  # a critic group writes its part too
            group = ctx.state_group or ctx.process_group
            manager = build_manager(cfg, run_dir, process_group=group,
                                    async_group=ctx.state_async_group or ctx.checkpoint_group)
            checkpointer = RunCheckpointer(cfg, run_dir, manager, {g.name: g.size for g in ctx.plan.groups},
                                           placement.seat.is_leader, group)
        trainer = build_step(cfg, placement, on_stage=heartbeat.enter)
        ctx.barrier("start")
        return RunLifecycle(cfg, run_dir, trainer, checkpointer, stop, limit).run()
    finally:
        heartbeat.close()
        placement.lifecycle.close()


def run() -> int:
    """`main`, then USR1/USR2 ignored for the rest of the process: the batch script may still be
    repeating a notice while Python tears down, when its handlers are already gone."""
    try:
        return main()
    finally:
        ignore_notices_until_exit()


if __name__ == "__main__":
    _code = run()
    if _code == 1:
        # A failing rank leaves the slow way. Rank 0 hosts the rendezvous store, and the
        # survivors read every rank's last phase and pulse from it to name the suspect; an
        # immediate exit there made them blame rank 0 instead of the rank that died.
        sys.exit(_code)
    exit_now(_code)
