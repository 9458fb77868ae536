"""Preemption storm: interrupt small training runs at random moments, restart them until done,
and check that every step's metrics equal those of the same run left alone.

    .venv/bin/python tools/storm.py --runs 20 --out /tmp/storm            # the figure in docs/reliability.md
    .venv/bin/python tools/storm.py --runs 2 --layouts embedded --hits 2  # a quick look

Why a separate driver and not a pytest loop: the figure needs many runs and the same code must
run both as a CI-sized test (tests/reliability/test_storm.py) and as the full storm.

How a run is hit: each interruption draws a signal (SIGUSR1, SIGTERM, SIGKILL) and a moment:
`startup` (a random delay after the command starts; called `restore` when a checkpoint exists,
so the restart is loading it), `training` (a random delay after a new step is logged, so it lands
in rollout, update or weight sync in proportion to how long each takes) or `checkpoint` (as soon
as a `.partial-step_*` directory appears: a checkpoint write is in progress). SIGTERM goes to the
`verl-hpc train` process (Ctrl-C, scancel); SIGUSR1 to every worker, as Slurm signals a step's
tasks (and to the launcher too, which forwards it); SIGKILL to the launcher or, in a multi-process
run, to one random worker (a crashed rank). The same command then restarts the run, as a requeued
job would, until it finishes.

What it reports: runs, interruptions delivered, runs finished, mismatched steps (goal 0), steps
lost (trained and logged by an attempt, but after the checkpoint the next start resumed from:
computed again, never missing from the result), hangs (a signalled run that did not exit within --exit-timeout) and orphan processes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
LAYOUTS = {"embedded": "configs/quickstart.yaml", "split": "configs/quickstart_split.yaml"}
VOLATILE = ("timing_s/", "perf/", "memory/", "resource/")  # clock and machine readings, not training state
SIGNALS = ("SIGUSR1", "SIGTERM", "SIGKILL")
MOMENTS = ("startup", "training", "checkpoint")
MOMENT_WEIGHTS = (0.3, 0.4, 0.3)  # "training" spans rollout, update and weight sync


@dataclass
class Hit:
    signal: str
    moment: str
    target: str = ""
    delivered: bool = False
    exit_code: int | None = None
    last_logged: int = 0
    resumed_from: int = 0
    redone: int = 0  # steps this attempt logged past the checkpoint the next start resumes from
    hung: bool = False
    orphans: int = 0


@dataclass
class RunReport:
    layout: str
    seed: int
    hits: list[Hit] = field(default_factory=list)
    finished: bool = False
    mismatches: list[str] = field(default_factory=list)

    @property
    def steps_lost(self) -> int:
        return sum(h.redone for h in self.hits)


def train_command(layout: str, run_dir: Path, model: Path, steps: int, interval: int) -> list[str]:
    return [sys.executable, "-m", "verl_hpc", "train", LAYOUTS[layout], "--run-dir", str(run_dir),
            f"model.path={model}", f"trainer.total_steps={steps}", f"checkpoint.interval_steps={interval}",
            "logging.progress=off", "trainer.save_hf_model=false", "resources.timeout_seconds=30"]


def start(command: list[str], log: Path) -> subprocess.Popen:
    """Its own session, so signals aimed at it never reach this driver (and vice versa)."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "ab") as out:
        return subprocess.Popen(command, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "tensorboard" / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written right now
            break
    return rows


def committed_step(run_dir: Path) -> int:
    steps = [int(p.name[5:]) for p in (run_dir / "checkpoints").glob("step_*") if (p / "manifest.json").is_file()]
    return max(steps, default=0)


def workers(proc: subprocess.Popen) -> dict[str, psutil.Process]:
    """Global rank -> worker process under a `verl-hpc train` process (none when it runs embedded)."""
    found = {}
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        return {}
    for child in children:
        try:
            rank = child.environ().get("VERL_HPC_RANK")
        except psutil.Error:
            continue
        if rank is not None:
            found[rank] = child
    return found


def wait_for_moment(proc: subprocess.Popen, run_dir: Path, moment: str, rng: random.Random,
                    startup_s: float, step_s: float) -> bool:
    """Sleep until `moment` comes; False when the run exited first."""
    if moment == "startup":
        deadline = time.monotonic() + rng.uniform(0.2, startup_s)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return False
            time.sleep(0.01)
        return True
    if moment == "training":
        logged = len(metrics(run_dir))
        while len(metrics(run_dir)) <= logged:
            if proc.poll() is not None:
                return False
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, step_s))
        return proc.poll() is None
    ckpt = run_dir / "checkpoints"
    while not any(ckpt.glob(".partial-step_*")):
        if proc.poll() is not None:
            return False
        time.sleep(0.001)
    return True


def deliver(proc: subprocess.Popen, sig_name: str, rng: random.Random) -> str:
    sig = signal.Signals[sig_name]
    ranks = workers(proc)
    if sig == signal.SIGUSR1 and ranks:
        for p in ranks.values():
            _send(p.pid, sig)
        _send(proc.pid, sig)
        return "every worker + launcher"
    if sig == signal.SIGKILL and ranks and rng.random() < 0.5:
        rank = rng.choice(sorted(ranks))
        _send(ranks[rank].pid, sig)
        return f"worker rank {rank}"
    _send(proc.pid, sig)
    return "launcher" if ranks else "trainer"


def _send(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def leftovers(run_dir: Path) -> list[psutil.Process]:
    """Processes of this run still alive: workers carry the run dir in their environment."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("VERL_HPC_RUN_DIR") == str(run_dir) and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:
            continue
    return found


def reap(proc: subprocess.Popen, run_dir: Path, timeout: float) -> tuple[int | None, bool, int]:
    """Wait for the run to exit: (exit code, hung?, orphans left). Kills whatever hangs."""
    try:
        code = proc.wait(timeout=timeout)
        hung = False
    except subprocess.TimeoutExpired:
        hung = True
        os.killpg(proc.pid, signal.SIGKILL)
        code = proc.wait()
    time.sleep(0.5)  # the kernel's parent-death signals are asynchronous
    orphans = leftovers(run_dir)
    for p in orphans:
        p.kill()
    return code, hung, len(orphans)


def _identity(row: dict) -> tuple:
    """A logged step, told apart from the same step redone later by its wall-clock reading."""
    return row["step"], row.get("timing_s/step")


def compare(whole: list[dict], got: list[dict]) -> list[str]:
    """Every step's non-volatile metrics must be equal, bit for bit."""
    problems = []
    if [r["step"] for r in got] != [r["step"] for r in whole]:
        return [f"steps {[r['step'] for r in got]} != {[r['step'] for r in whole]}"]
    for a, b in zip(whole, got, strict=True):
        keys = {k for k in a if not k.startswith(VOLATILE)} | {k for k in b if not k.startswith(VOLATILE)}
        problems += [f"step {a['step']} {k}: {b.get(k)} != {a.get(k)}" for k in sorted(keys) if a.get(k) != b.get(k)]
    return problems


def storm_run(layout: str, seed: int, out: Path, model: Path, args: argparse.Namespace,
              baseline: dict) -> RunReport:
    rng = random.Random(seed)
    run_dir = out / f"{layout}-{seed:03d}"
    command = train_command(layout, run_dir, model, args.steps, args.interval)
    report = RunReport(layout, seed)
    planned = [Hit(rng.choice(SIGNALS), rng.choices(MOMENTS, weights=MOMENT_WEIGHTS)[0])
               for _ in range(rng.randint(1, args.hits))]
    for hit in [*planned, None]:
        proc = start(command, out / f"{run_dir.name}.log")
        if hit is None:  # the last start runs to the end
            code, hung, orphans = reap(proc, run_dir, args.finish_timeout)
            report.finished = code == 0 and not hung and bool(metrics(run_dir)) \
                and metrics(run_dir)[-1]["step"] == args.steps
            break
        if hit.moment == "startup" and committed_step(run_dir):
            hit.moment = "restore"
        before = {_identity(r) for r in metrics(run_dir)}
        hit.delivered = wait_for_moment(proc, run_dir, hit.moment, rng, baseline["startup_s"], baseline["step_s"])
        if hit.delivered:
            hit.target = deliver(proc, hit.signal, rng)
        hit.exit_code, hit.hung, hit.orphans = reap(proc, run_dir, args.exit_timeout)
        rows = metrics(run_dir)
        hit.last_logged, hit.resumed_from = (rows[-1]["step"] if rows else 0), committed_step(run_dir)
        hit.redone = sum(1 for r in rows if _identity(r) not in before and r["step"] > hit.resumed_from)
        report.hits.append(hit)
    report.mismatches = compare(baseline["metrics"], metrics(run_dir)) if report.finished else []
    return report


def measure_baseline(layout: str, out: Path, model: Path, args: argparse.Namespace) -> dict:
    """The uninterrupted run: its metrics, and how long start-up and a step take (for moments)."""
    run_dir = out / f"{layout}-whole"
    started = time.monotonic()
    proc = start(train_command(layout, run_dir, model, args.steps, args.interval), out / f"{run_dir.name}.log")
    first_step = None
    while proc.poll() is None:
        if first_step is None and metrics(run_dir):
            first_step = time.monotonic() - started
        time.sleep(0.01)
    total = time.monotonic() - started
    if proc.returncode != 0:
        raise SystemExit(f"storm: the uninterrupted {layout} run failed (exit {proc.returncode}); "
                         f"see {out / (run_dir.name + '.log')}")
    first_step = first_step or total
    rows = metrics(run_dir)
    step_s = sum(r.get("timing_s/step", 0.0) for r in rows) / max(1, len(rows))
    return {"metrics": rows, "startup_s": first_step, "step_s": max(step_s, 0.01)}


def summarise(reports: list[RunReport]) -> dict:
    hits = [h for r in reports for h in r.hits if h.delivered]
    by = {}
    for h in hits:
        key = f"{h.signal}@{h.moment}"
        by[key] = by.get(key, 0) + 1
    return {"runs": len(reports), "interruptions": len(hits), "finished": sum(r.finished for r in reports),
            "mismatches": sum(len(r.mismatches) for r in reports), "steps_lost": sum(r.steps_lost for r in reports),
            "hung": sum(h.hung for r in reports for h in r.hits), "orphans": sum(h.orphans for r in reports for h in r.hits),
            "by_signal_and_moment": dict(sorted(by.items()))}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="runs in all, spread over the layouts")
    parser.add_argument("--layouts", default="embedded,split", help="comma list of: " + ", ".join(LAYOUTS))
    parser.add_argument("--hits", type=int, default=3, help="at most this many interruptions per run (at least 1)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--interval", type=int, default=3, help="checkpoint.interval_steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", type=Path, help="a tiny model directory (built when absent)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/verl-hpc-storm"))
    parser.add_argument("--exit-timeout", type=float, default=90.0, help="a signalled run must exit by then")
    parser.add_argument("--finish-timeout", type=float, default=600.0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.model or args.out / "tiny"
    if not (model / "config.json").is_file():
        sys.path.insert(0, str(REPO))
        from verl_hpc.models.tiny import init_model

        init_model(model, preset="tiny", seed=0)
    layouts = [name.strip() for name in args.layouts.split(",") if name.strip()]
    baselines = {layout: measure_baseline(layout, args.out, model, args) for layout in layouts}
    reports = []
    for i in range(args.runs):
        layout = layouts[i % len(layouts)]
        report = storm_run(layout, args.seed + i, args.out, model, args, baselines[layout])
        reports.append(report)
        hits = ", ".join(f"{h.signal}@{h.moment}->{h.target or 'missed'}" for h in report.hits)
        print(f"run {i + 1}/{args.runs} {layout}: finished={report.finished} mismatches={len(report.mismatches)} "
              f"steps_lost={report.steps_lost} [{hits}]", flush=True)
    summary = summarise(reports)
    (args.out / "storm.json").write_text(json.dumps(
        {"summary": summary, "args": {k: str(v) for k, v in vars(args).items()},
         "runs": [{**asdict(r), "steps_lost": r.steps_lost} for r in reports]}, indent=1))
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    result = main()
    sys.exit(0 if result["finished"] == result["runs"] and result["mismatches"] == 0 else 1)
