"""The sbatch script, without a cluster: golden files, hetjob layout, flags, signal forwarding.

Why golden files: the script is what users read, copy and debug on their cluster; any change
to it must show up in review as a diff of tests/golden/ or sbatch/. Regenerate them with
`VERL_HPC_UPDATE_GOLDEN=1 python -m pytest tests/launch/test_sbatch_render.py`.
The batch shell's trap-and-forward logic runs here for real, with stub `srun` and Python.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from verl_hpc.cli.main import main
from verl_hpc.config import ConfigError, RoleResources, load_config
from verl_hpc.config.placement import plan_for_config
from verl_hpc.launch.sbatch import render_sbatch, render_template

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "golden"
UPDATE = os.environ.get("VERL_HPC_UPDATE_GOLDEN") == "1"
GOLDEN_PYTHON = "/opt/verl-hpc/.venv/bin/python"
GOLDEN_CONFIGS = ("slurm_local", "slurm_ppo_split", "slurm_multinode", "slurm_env_box")
TEMPLATES = {"ppo_split_hetjob": "slurm_ppo_split", "grpo_colocated": "slurm_grpo_colocated",
             "multinode": "slurm_multinode"}


def cli(*argv: str) -> tuple[int, str, str]:
    """Run `verl-hpc ARGV` in this process; (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def check_golden(path: Path, text: str) -> None:
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"{path} is missing; run with VERL_HPC_UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"{path} differs; review, then VERL_HPC_UPDATE_GOLDEN=1"


def components(script: str) -> list[list[str]]:
    """The #SBATCH options of each hetjob component, in order."""
    blocks: list[list[str]] = [[]]
    for line in script.splitlines():
        if line.strip() == "#SBATCH hetjob":
            blocks.append([])
        elif line.startswith("#SBATCH "):
            blocks[-1].append(line.removeprefix("#SBATCH ").strip())
    return blocks


def options(block: list[str]) -> dict[str, str]:
    return dict(item.removeprefix("--").partition("=")[::2] for item in block)


def render(name: str, *overrides: str, run_dir: str = "/scratch/runs/x") -> str:
    cfg = load_config(REPO / "configs" / f"{name}.yaml", list(overrides))
    return render_sbatch(cfg, Path(run_dir), Path(run_dir) / "slurm", GOLDEN_PYTHON)


@pytest.mark.parametrize("name", GOLDEN_CONFIGS)
def test_sbatch_cli_output_matches_golden(name: str) -> None:
    code, out, err = cli("sbatch", f"configs/{name}.yaml", "--run-dir", f"/scratch/runs/{name}",
                         "--python", GOLDEN_PYTHON)
    assert code == 0, err
    check_golden(GOLDEN / f"{name}.sbatch", out)


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_templates_are_the_rendered_configs(template: str) -> None:
    code, out, err = cli("sbatch", f"configs/{TEMPLATES[template]}.yaml", "--template")
    assert code == 0, err
    check_golden(REPO / "sbatch" / f"{template}.sbatch", out)
    assert "/work/" not in out and "/root" not in out  # nothing of this machine leaks into a template


def test_one_component_per_group_in_plan_order_with_their_sizes() -> None:
    cfg = load_config(REPO / "configs" / "slurm_local.yaml")
    plan = plan_for_config(cfg)
    blocks = components(render("slurm_local"))
    assert [g.name for g in plan.groups] == ["trainer", "rollout", "reward"]
    assert len(blocks) == 3
    for group, block in zip(plan.groups, blocks, strict=True):
        opts = options(block)
        assert int(opts["nodes"]) * int(opts["ntasks-per-node"]) == group.size
        assert opts["partition"] == "low" and opts["cpus-per-task"] == "1"
        assert "gpus-per-node" not in opts  # CPU roles ask for no GPU
    assert [g.size for g in plan.groups] == [2, 1, 1]
    job_wide = {"job-name", "time", "requeue", "signal", "open-mode", "output"}
    assert job_wide <= set(options(blocks[0]))
    assert not any(job_wide & set(options(b)) for b in blocks[1:])


def test_job_wide_flags_and_the_step_over_all_components() -> None:
    script = render("slurm_local", "slurm.signal_grace_seconds=77", "slurm.time=01:30:00")
    opts = options(components(script)[0])
    assert opts["signal"] == "B:USR1@77" and opts["time"] == "01:30:00"
    assert opts["output"] == "/scratch/runs/x/slurm/%j_batch.out" and opts["open-mode"] == "append"
    assert "requeue" in opts and opts["job-name"] == "verl-hpc-local"
    step = ('srun --het-group=0-2 --kill-on-bad-exit=0 bash -c \'trap "" USR1 USR2; : >"$VERL_HPC_LOG_DIR/'
            '.usr1_ready_${SLURM_JOB_ID:-0}_${SLURM_RESTART_COUNT:-0}_${SLURM_PROCID:-0}"; exec "$@"\' worker '
            '"$VERL_HPC_PYTHON" -m verl_hpc.runtime.worker &')
    assert step in script
    assert 'export VERL_HPC_LOG_DIR="/scratch/runs/x/slurm/logs"' in script
    assert "export MASTER_ADDR=127.0.0.1" in script  # slurm.setup, verbatim
    assert "trap 'forward USR1' USR1" in script and "trap 'forward TERM' TERM" in script


def test_no_requeue_when_disabled() -> None:
    opts = options(components(render("slurm_local", "slurm.requeue=false"))[0])
    assert "no-requeue" in opts and "requeue" not in opts


def test_multinode_role_counts_nodes_times_tasks() -> None:
    blocks = components(render("slurm_multinode"))
    trainer = options(blocks[0])
    assert (trainer["nodes"], trainer["ntasks-per-node"]) == ("2", "1")
    assert plan_for_config(load_config(REPO / "configs" / "slurm_multinode.yaml")).world_size == 3
    assert RoleResources(nodes=2, tasks_per_node=4).world_size == 8
    assert RoleResources(device_ids=[0, 1, 2]).world_size == 3


def test_one_group_is_a_plain_job_without_het_group() -> None:
    script = render("slurm_grpo_colocated")
    assert len(components(script)) == 1
    assert "--het-group" not in script  # Slurm refuses it outside a hetjob
    assert 'srun --kill-on-bad-exit=0 bash -c' in script


def test_cuda_roles_ask_for_gpus_per_node() -> None:
    script = render("slurm_local", "resources.actor.device_type=cuda", "resources.actor.device_ids=[0,1,2,3]",
                    "resources.actor.mem=64G", "resources.actor.constraint=a100",
                    "resources.rollout.device_type=cuda", "resources.rollout.device_ids=[4]",
                    "resources.rollout.gpus_per_node=2")
    trainer, rollout, reward = (options(b) for b in components(script))
    assert (trainer["ntasks-per-node"], trainer["gpus-per-node"]) == ("4", "4")
    assert (trainer["mem"], trainer["constraint"]) == ("64G", "a100")
    assert (rollout["ntasks-per-node"], rollout["gpus-per-node"]) == ("1", "2")
    assert "gpus-per-node" not in reward and "account" not in trainer and "qos" not in trainer


def test_rendering_is_pure_and_quotes_paths() -> None:
    os.environ["VERL_HPC_RUN_DIR"] = "/elsewhere"
    try:
        first, second = render("slurm_local"), render("slurm_local")
    finally:
        del os.environ["VERL_HPC_RUN_DIR"]
    assert first == second and "/elsewhere" not in first
    odd = render("slurm_local", run_dir="/runs/$HOME`id`")
    assert "VERL_HPC_RUN_DIR:-/runs/\\$HOME\\`id\\`}" in odd  # no expansion in the batch shell
    with pytest.raises(ConfigError, match="run_dir"):  # sbatch splits #SBATCH lines on whitespace
        render("slurm_local", run_dir="/runs/a b")
    with pytest.raises(ValueError, match="absolute"):
        render_sbatch(load_config(REPO / "configs" / "slurm_local.yaml"), Path("runs/x"), Path("/a"))


def test_bad_sbatch_value_is_a_one_line_config_error() -> None:
    with pytest.raises(ConfigError, match="slurm.job_name"):
        render("slurm_local", "slurm.job_name=my job")
    code, out, err = cli("sbatch", "configs/slurm_local.yaml", "slurm.job_name=my job")
    assert code == 2 and out == "" and err.count("\n") == 1 and "slurm.job_name" in err


@pytest.mark.parametrize("name", sorted(p.stem for p in (REPO / "configs").glob("slurm_*.yaml")))
def test_scripts_are_valid_bash(name: str) -> None:
    """Every shipped Slurm config validates and renders a script bash accepts."""
    cfg = load_config(REPO / "configs" / f"{name}.yaml")
    for text in (render(name), render_template(cfg)):
        assert subprocess.run(["bash", "-n"], input=text, text=True, check=False).returncode == 0


def test_dry_run_creates_nothing_and_needs_no_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from verl_hpc import submit

    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no sbatch, no scontrol
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    run_dir = tmp_path / "run"
    text = submit(REPO / "configs" / "slurm_local.yaml", ["trainer.total_steps=5"], run_dir=run_dir, dry_run=True)
    assert isinstance(text, str) and text.startswith("#!/bin/bash")
    assert f"VERL_HPC_RUN_DIR:-{run_dir}}}" in text
    code, out, _ = cli("submit", "configs/slurm_local.yaml", "--run-dir", str(run_dir), "--dry-run")
    assert code == 0 and out == cli("sbatch", "configs/slurm_local.yaml", "--run-dir", str(run_dir))[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_missing_slurm_tools_is_one_clear_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from verl_hpc import submit
    from verl_hpc.launch.slurm_job import SlurmToolsMissing

    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with pytest.raises(SlurmToolsMissing, match="not on PATH.*docs/slurm.md"):
        submit(REPO / "configs" / "slurm_local.yaml", run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()
    for argv in (["submit", "configs/slurm_local.yaml", "--run-dir", str(tmp_path / "r")],
                 ["status", "12"], ["cancel", "12"], ["logs", "12"]):
        code, out, err = cli(*argv)
        assert code == 2 and err.count("\n") == 1 and "not on PATH" in err, (argv, err)


def test_bad_job_id_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    for command in ("status", "logs", "cancel"):
        code, _, err = cli(command, "12;rm")
        assert code == 2 and err.count("\n") == 1 and "not a Slurm job id" in err


def test_train_refuses_nodes_above_one(tmp_path: Path) -> None:
    code, _, err = cli("train", "configs/slurm_multinode.yaml", "--run-dir", str(tmp_path / "run"))
    assert code == 2 and "resources.actor.nodes" in err and "verl-hpc submit" in err
    assert not (tmp_path / "run").exists()


def test_worker_redirects_fds_to_its_rank_log(tmp_path: Path) -> None:
    code = (
        "import os, sys\n"
        "from verl_hpc.runtime.process.env import JobEnvironment\n"
        "from verl_hpc.runtime.worker import redirect_output\n"
        "env = JobEnvironment.from_env({'SLURM_PROCID': '2', 'SLURM_NTASKS': '4', 'SLURM_JOB_ID': '77',\n"
        "                               'MASTER_ADDR': '127.0.0.1'})\n"
        "redirect_output(sys.argv[1], 'rollout', env)\n"
        "print('from python'); os.write(2, b'from fd 2\\n'); os.system('echo from a child')\n")
    for _ in range(2):  # append mode: the second run adds to the first
        done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "logs")], capture_output=True,
                              text=True, timeout=60, check=False)
        assert done.returncode == 0 and done.stdout == "" and done.stderr == "", done
    text = (tmp_path / "logs" / "rollout_rank2.out").read_text()
    assert text.count("==== verl-hpc job 77 restart 0") == 2 and "rollout rank 2 of 4" in text
    assert text.count("from python") == text.count("from fd 2") == text.count("from a child") == 2


# Runs the task command as task 0; the other tasks (slurm_local has 4) count as started, with
# USR1 ignored, unless STUB_TASKS_LATE is set (then the test writes their markers itself).
STUB_SRUN = """#!/bin/bash
while [[ "$1" == --* ]]; do shift; done
if [ -z "${STUB_TASKS_LATE:-}" ]; then
  for rank in 1 2 3; do : >"$VERL_HPC_LOG_DIR/.usr1_ready_${SLURM_JOB_ID:-0}_${SLURM_RESTART_COUNT:-0}_$rank"; done
fi
exec "$@"
"""
# Stands in for the worker: records the signal it gets, then exits 7 (or 0 after 30 s). In Python,
# like the worker: the task starts with USR1 ignored, which a bash trap could not override.
STUB_PYTHON = f"""#!{sys.executable}
import os, signal, sys, time
logs = os.environ["VERL_HPC_LOG_DIR"]
def record(name):
    def handler(signum, frame):
        open(os.path.join(logs, name), "w").close()
        sys.exit(7)
    return handler
signal.signal(signal.SIGUSR1, record("got_usr1"))
signal.signal(signal.SIGTERM, record("got_term"))
with open(os.path.join(logs, "pid"), "w") as f:
    f.write(str(os.getpid()))
time.sleep(30)
"""
# Stands in for Slurm delivering `scancel --signal=TERM JOB` to the step's tasks.
STUB_SCANCEL = """#!/bin/bash
echo "$@" > "$VERL_HPC_LOG_DIR/scancel_args"
kill -s TERM "$(cat "$VERL_HPC_LOG_DIR/pid")"
"""


def start_batch_script(tmp_path: Path, **env_vars: str) -> tuple[subprocess.Popen, Path]:
    """The slurm_local script under bash with stub srun/python/scancel; returns it and its log folder."""
    bin_dir, run_dir = tmp_path / "bin", tmp_path / "run"
    bin_dir.mkdir()
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("{}\n")
    for name, text in (("srun", STUB_SRUN), ("python", STUB_PYTHON), ("scancel", STUB_SCANCEL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    cfg = load_config(REPO / "configs" / "slurm_local.yaml")
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch(cfg, run_dir, run_dir / "slurm", str(bin_dir / "python")))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VERL_HPC_", "SLURM_"))}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", SLURM_JOB_ID="77", **env_vars)
    proc = subprocess.Popen(["bash", str(script)], env=env, stderr=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    return proc, run_dir / "slurm" / "logs"


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM])
def test_batch_shell_passes_signals_to_the_step_and_exits_with_its_status(tmp_path: Path,
                                                                          sig: signal.Signals) -> None:
    """USR1 goes to srun (which relays it); TERM goes through scancel (srun would SIGKILL)."""
    proc, logs = start_batch_script(tmp_path)
    deadline = time.monotonic() + 20
    while not (logs / "pid").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)  # let the batch shell reach its `wait`
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 7, (out, err)
    assert (logs / ("got_usr1" if sig == signal.SIGUSR1 else "got_term")).exists()
    assert re.search(rf"got {sig.name} .*passing it to the job step", err), err
    scancel = logs / "scancel_args"
    assert scancel.read_text().split() == ["--signal=TERM", "77"] if sig == signal.SIGTERM else not scancel.exists()
    assert "job step exited with status 7" in out


def test_batch_shell_holds_usr1_until_every_task_ignores_it(tmp_path: Path) -> None:
    """A task killed by USR1 between its exec and its `trap` fails the job (a requeue-test flake):
    the shell passes USR1 on only once all 4 tasks left their marker, then within its 5 s repeat."""
    proc, logs = start_batch_script(tmp_path, STUB_TASKS_LATE="1", SLURM_RESTART_COUNT="2")
    deadline = time.monotonic() + 20
    while not (logs / "pid").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)  # let the batch shell reach its `wait`
    proc.send_signal(signal.SIGUSR1)
    time.sleep(1.5)
    assert not (logs / "got_usr1").exists()  # 1 of 4 tasks ready: held back
    for rank in (1, 2, 3):
        (logs / f".usr1_ready_77_2_{rank}").touch()
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 7 and (logs / "got_usr1").exists(), (out, err)
    assert (logs / ".usr1_ready_77_2_0").exists()  # the wrapper's own marker, named by job, restart, rank


def test_environment_workers_are_a_cpu_component_with_a_step_of_their_own() -> None:
    script = render("slurm_env_box")
    blocks = components(script)
    assert len(blocks) == 2
    env = options(blocks[1])
    assert (env["nodes"], env["ntasks-per-node"], env["cpus-per-task"]) == ("1", "2", "1")
    assert not any(key.startswith("gpus") for key in env)  # environments need CPUs, not GPUs
    env_srun = script.index("srun --het-group=1 ")
    train_srun = script.index("srun --het-group=0 ")  # the training step leaves the env component out
    assert env_srun < train_srun < script.index('kill "$env_pid"')
    assert "-m verl_hpc.roles.env.remote" in script and "env_worker${SLURM_PROCID:-0}.out" in script
    four = render("slurm_env_box", "resources.env.num_workers=4", "resources.env.nodes=2")
    assert options(components(four)[1])["ntasks-per-node"] == "2"
    with pytest.raises(ConfigError, match="resources.env.partition"):
        render("slurm_env_box", "resources.env.partition=a b")
