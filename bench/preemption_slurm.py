"""Preemption recovery under Slurm: a real preemption on the local cluster, timed from the run's own records.

`python -m bench preemption --slurm` (or `python -m bench preemption_slurm`). One job per
repetition, configs alternating: `verl-hpc submit configs/slurm_local.yaml` (split: a
3-component hetjob, 4 tasks on 3 nodes) or `configs/slurm_grpo_colocated.yaml` (a plain job,
2 tasks on 1 node; --quick runs the hetjob only), both on the `low` partition. After a
few completed steps a job that wants every node is
submitted to the `high` partition. Slurm preempts ours the way it does on a real cluster
(`PreemptMode=REQUEUE`: the job's `--signal` USR1 at once, SIGTERM after GraceTime); the
runtime finishes the step, saves, and rank 0 requeues the job, which the scheduler starts
again once the nodes are free; the job resumes from the checkpoint.

What is timed, all on this host's wall clock, each from the most precise record there is:
- signal: just before the preempting `sbatch` is called (Slurm signals on submission);
- checkpoint committed: the checkpoint manifest's `time`; its `save_seconds` is the write;
- requeued / running again: the job's `Restarts` and `JobState` (`scontrol`, polled 4 Hz);
- restore: the trainer leader's "resumed from" log record (`restore_s`, `unix_time`);
- first completed step after the restart: its row in metrics.jsonl (polled 10 Hz).
So: save = signal -> committed (the step in flight, the stop agreement, the write);
requeue call = committed -> requeued (other roles stopped, `scontrol requeue`); requeue
wait = requeued -> running (the scheduler's part: munge's cred_expire, the preempting job,
scheduling passes; the scheduler is poked once a second as in tests/slurm, else a hetjob
sits 60-110 s); start-up = running -> restore begins (batch shell, srun, imports, process
group, roles); restore; first step = restore done -> first step recorded. Baseline in the
same repetition: the job's cold start (running -> first step recorded).

Needs the local cluster (docs/slurm-local.md): the one SLURM_CONF or VERL_HPC_SLURM_CONF
names, else one started for the run in a fresh folder and stopped after. Without the
Slurm binaries the result says "skipped" and why. Not part of `bench all`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CONFIGS = ["configs/slurm_local.yaml", "configs/slurm_grpo_colocated.yaml"]
SLURM_LOCAL = REPO / "tools" / "slurm-local"
EXIT_UNAVAILABLE = 3  # tools/slurm-local: Slurm/munge missing and not installable
TARGET_S, TARGET_LOST = 30.0, 1
SIGNAL_AFTER = 3  # completed steps before the preemption
PHASES = ["save_s", "requeue_call_s", "requeue_wait_s", "startup_s", "restore_s", "first_step_s"]


@dataclass
class Cluster:
    """Slurm commands against one cluster (its slurm.conf)."""

    conf: Path
    owned: bool = False

    def run(self, *args: str, check: bool = True, timeout: float = 60) -> str:
        done = subprocess.run(list(args), env={**os.environ, "SLURM_CONF": str(self.conf)}, text=True,
                              capture_output=True, timeout=timeout, check=False)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} -> {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def job(self, job_id: int) -> dict[str, str]:
        """The leader record of `scontrol show job` as Key=Value pairs ({} once it is gone)."""
        text = self.run("scontrol", "show", "job", str(job_id), check=False)
        first = re.split(r"\n\s*\n", text)[0]
        return dict(re.findall(r"(\w+)=(\S*)", first)) if "JobId=" in first else {}

    def poke(self) -> None:
        """Make the scheduler run now (what `tools/slurm-local poke` does)."""
        self.run("scontrol", "update", "PartitionName=low", "State=UP", check=False)


def find_cluster(work: Path) -> Cluster | str:
    """A running cluster to use, or why there is none (a string)."""
    named = os.environ.get("VERL_HPC_SLURM_CONF") or os.environ.get("SLURM_CONF")
    if named:
        cluster = Cluster(Path(named).resolve())
        try:
            cluster.run("sinfo", "-h", timeout=20)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as err:
            return f"the cluster of {named} does not answer: {err}"
        return cluster
    if shutil.which("sbatch") is None:
        return "no Slurm binaries (sbatch) on PATH; tools/slurm-local start installs them where apt-get can"
    done = subprocess.run([sys.executable, str(SLURM_LOCAL), "start", "--dir", str(work / "slurm")],
                          text=True, capture_output=True, timeout=300, check=False)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        return f"tools/slurm-local start failed ({done.returncode}): {tail}"
    return Cluster(work / "slurm" / "slurm.conf", owned=True)


def stop_cluster(cluster: Cluster) -> None:
    if cluster.owned:
        subprocess.run([sys.executable, str(SLURM_LOCAL), "stop", "--dir", str(cluster.conf.parent)],
                       capture_output=True, timeout=120, check=False)


def _rows(run_dir: Path) -> dict[int, dict[str, Any]]:
    path = run_dir / "tensorboard" / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return {row["step"]: row for row in (json.loads(line) for line in lines if line.endswith("}"))}


def _poll(what: str, condition: Callable[[], Any], timeout: float, every: float, tick: Callable[[], None]) -> Any:
    """Call `condition` every `every` s until it returns a truthy value; `tick` once a second (a poke)."""
    deadline, next_tick = time.time() + timeout, 0.0
    while time.time() < deadline:
        value = condition()
        if value:
            return value
        if time.time() >= next_tick:
            tick()
            next_tick = time.time() + 1.0
        time.sleep(every)
    raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")


def _submit(cluster: Cluster, config: str, run_dir: Path, model: Path) -> int:
    cmd = [sys.executable, "-m", "verl_hpc", "submit", config, "--run-dir", str(run_dir), f"model.path={model}",
           "trainer.total_steps=100000", "checkpoint.interval_steps=100000", "logging.progress=off",
           "slurm.max_requeues=5"]
    done = subprocess.run(cmd, cwd=REPO, text=True, capture_output=True, timeout=300, check=False,
                          env={**os.environ, "SLURM_CONF": str(cluster.conf), "TOKENIZERS_PARALLELISM": "false"})
    if done.returncode != 0:
        raise RuntimeError(f"verl-hpc submit failed ({done.returncode}): {done.stderr[-2000:]}")
    return int(next(line.split()[-1] for line in done.stdout.splitlines() if line.startswith("submitted job")))


def _restore_record(run_dir: Path, step: int) -> dict[str, Any]:
    """The newest "resumed from ... at step `step`" record with its timing fields (trainer leader's log)."""
    records = []
    for path in (run_dir / "logs").glob("*.log"):
        for line in path.read_text().splitlines():
            if '"restore_s"' in line and f"at step {step} " in line:
                records.append(json.loads(line))
    return max(records, key=lambda r: r["unix_time"]) if records else {}


def _running(cluster: Cluster, job: int, restarts: int) -> Callable[[], float | None]:
    def check() -> float | None:
        record = cluster.job(job)
        ok = record.get("JobState") == "RUNNING" and int(record.get("Restarts", -1)) == restarts
        return time.time() if ok else None
    return check


def _step_seen(run_dir: Path, step: int, cluster: Cluster, job: int) -> Callable[[], tuple[float, dict] | None]:
    def check() -> tuple[float, dict] | None:
        row = _rows(run_dir).get(step)
        if row is None and cluster.job(job).get("JobState") in {"FAILED", "CANCELLED", "TIMEOUT", "COMPLETED"}:
            raise RuntimeError(f"job {job} ended before step {step}: see {run_dir / 'slurm'}")
        return (time.time(), row) if row is not None else None
    return check


def one_preemption(cluster: Cluster, config: str, run_dir: Path, model: Path, timeout: float) -> dict[str, float]:
    """Submit, preempt after SIGNAL_AFTER steps (+ half a step), time the way back to a completed step."""
    job = _submit(cluster, config, run_dir, model)
    try:
        t_run1 = _poll("the job to start", _running(cluster, job, 0), timeout, 0.25, cluster.poke)
        t_first1, row1 = _poll("step 1", _step_seen(run_dir, 1, cluster, job), timeout, 0.1, lambda: None)
        _, row = _poll(f"step {SIGNAL_AFTER}", _step_seen(run_dir, SIGNAL_AFTER, cluster, job), timeout, 0.1,
                       lambda: None)
        time.sleep(0.5 * row["timing_s/step"])  # land in the middle of the next step
        t_signal = time.time()
        cluster.run("sbatch", "-p", "high", "-N4", "--exclusive", "-o", "/dev/null", "-J", "bench-preemptor",
                    "--wrap", "sleep 1")
        t_requeued = _poll("the requeue", lambda: time.time() if int(cluster.job(job).get("Restarts", 0)) else None,
                           timeout, 0.25, lambda: None)
        last_done = max(_rows(run_dir))
        t_run2 = _poll("the restart", _running(cluster, job, 1), timeout, 0.25, cluster.poke)
        saved = _saved_step(run_dir)
        t_first2, row2 = _poll(f"step {saved + 1}", _step_seen(run_dir, saved + 1, cluster, job), timeout, 0.1,
                               lambda: None)
    finally:
        cluster.run("scancel", str(job), check=False)
    manifest = json.loads((run_dir / "checkpoints" / f"step_{saved:08d}" / "manifest.json").read_text())
    restore = _restore_record(run_dir, saved)
    if not restore:
        raise RuntimeError(f"no 'resumed from ... at step {saved}' record with restore_s in {run_dir / 'logs'}")
    restore_end, restore_s = restore["unix_time"], restore["restore_s"]
    cold = t_first1 - t_run1
    phases = {"save_s": manifest["time"] - t_signal, "write_s": manifest["save_seconds"],
              "requeue_call_s": t_requeued - manifest["time"], "requeue_wait_s": t_run2 - t_requeued,
              "startup_s": restore_end - restore_s - t_run2, "restore_s": restore_s,
              "first_step_s": t_first2 - restore_end, "step_s": row2["timing_s/step"]}
    total = t_first2 - t_signal
    return {**phases, "total_s": total, "total_excl_wait_s": total - phases["requeue_wait_s"],
            "cold_start_s": cold - row1["timing_s/step"], "restart_s": t_first2 - t_run2,
            "restart_over_cold": (t_first2 - t_run2) / cold, "steps_lost": float(last_done - saved),
            "saved_step": float(saved)}


def _saved_step(run_dir: Path) -> int:
    steps = [int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*")
             if (p / "manifest.json").exists()]
    if not steps:
        raise RuntimeError(f"the preempted job left no committed checkpoint in {run_dir / 'checkpoints'}")
    return max(steps)


def _wait_idle(cluster: Cluster, timeout: float = 120) -> None:
    """Every job gone or finished, so the next repetition starts on free nodes."""
    def idle() -> bool:
        states = cluster.run("squeue", "-h", "-o", "%T", check=False).split()
        return not [s for s in states if s not in {"COMPLETED", "CANCELLED", "FAILED"}]
    _poll("the cluster to drain", idle, timeout, 0.5, cluster.poke)


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run(quick: bool = False, scratch: str | None = None) -> dict[str, Any]:
    configs, reps = (CONFIGS[:1], 1) if quick else (CONFIGS, 3)
    work = Path(tempfile.mkdtemp(prefix="verl_hpc_bench_preemption_slurm_", dir=scratch))
    base: dict[str, Any] = {"configs": configs, "signal_after": SIGNAL_AFTER, "cpus": os.cpu_count()}
    samples: dict[str, list[dict[str, float]]] = {c: [] for c in configs}
    try:
        cluster = find_cluster(work)
        if isinstance(cluster, str):
            shutil.rmtree(work, ignore_errors=True)
            return {**base, "skipped": cluster, "cases": [], "ratios": {}}
        try:
            from verl_hpc.models.tiny import init_model  # torch: only once there is a cluster to use

            model = init_model(work / "tiny", preset="tiny", seed=0)
            for rep in range(reps):
                for config in configs[rep % len(configs):] + configs[:rep % len(configs)]:
                    _wait_idle(cluster)
                    run_dir = work / f"{Path(config).stem}-rep{rep}"
                    samples[config].append(one_preemption(cluster, config, run_dir, model, timeout=600))
        finally:
            stop_cluster(cluster)
    except BaseException:
        print(f"preemption (Slurm) benchmark failed; its run directories are kept in {work}", file=sys.stderr)
        raise
    shutil.rmtree(work, ignore_errors=True)
    cases, ratios = [], {}
    for config, done in samples.items():
        fields = {key: _summary([s[key] for s in done]) for key in done[0]}
        cases.append({"config": config, "reps": len(done), **fields})
        name = Path(config).stem
        ratios[f"restart_over_cold_start_{name}"] = fields["restart_over_cold"]
        ratios[f"recovery_excl_wait_over_{TARGET_S:.0f}s_target_{name}"] = {
            k: v / TARGET_S for k, v in fields["total_excl_wait_s"].items()}
    return {**base, "reps": reps, "cluster": "started for this run" if cluster.owned else str(cluster.conf),
            "cases": cases, "samples": samples, "ratios": ratios}


def table(result: dict[str, Any]) -> str:
    if result.get("skipped"):
        return f"preemption (Slurm) benchmark skipped: {result['skipped']}"
    heads = ["save", "rq call", "rq wait", "start-up", "restore", "1st step", "total*"]
    cols = [*PHASES, "total_excl_wait_s"]
    lines = [f"preemption (Slurm) benchmark: real preemption (high partition) after {result['signal_after']} steps "
             f"-> checkpoint -> requeue -> restart, {result['reps']} rep(s) per config, median (min-max) s on "
             f"{result['cpus']} CPUs", f"{'config':<34}" + "".join(f"{h:>18}" for h in heads) + f"{'lost':>6}"]
    for case in result["cases"]:
        cells = "".join(f"{_cell(case[c]):>18}" for c in cols)
        lines.append(f"{case['config']:<34}{cells}{case['steps_lost']['max']:>6.0f}")
    worst = max(c["total_excl_wait_s"]["max"] for c in result["cases"])
    lost = max(c["steps_lost"]["max"] for c in result["cases"])
    lines.append(f"* signal -> first step after the restart, excluding the scheduler's requeue wait; worst "
                 f"{worst:.1f} s (target <= {TARGET_S:.0f} s): {'met' if worst <= TARGET_S else 'MISSED'}")
    lines.append(f"steps lost, worst: {lost:.0f} (target <= {TARGET_LOST}): {'met' if lost <= TARGET_LOST else 'MISSED'}")
    for case in result["cases"]:
        lines.append(f"{case['config']}: checkpoint write {_cell(case['write_s'])} s, restart / cold start "
                     f"{_cell(case['restart_over_cold'])}")
    return "\n".join(lines)


def _cell(summary: dict[str, float]) -> str:
    return f"{summary['median']:.2f} ({summary['min']:.1f}-{summary['max']:.1f})"
