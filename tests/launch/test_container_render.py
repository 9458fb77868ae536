"""`slurm.container`: the job script runs every task inside an image, for each runtime, without a cluster.

Golden scripts per runtime (pyxis, apptainer, podman) pass `bash -n`; then each script runs for
real under bash with stub `srun`/`podman`/`apptainer`/`scontrol` that record the command lines
they get and start the task command, so the mounts, working directory and the per-task USR1
wrapper are checked where they act: inside the runtime's command, not just in the text.
Regenerate goldens with `VERL_HPC_UPDATE_GOLDEN=1 python -m pytest tests/launch/test_container_render.py`.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from verl_hpc.cli.main import main
from verl_hpc.config import ConfigError, load_config
from verl_hpc.launch.sbatch import render_sbatch, render_template

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "golden"
UPDATE = os.environ.get("VERL_HPC_UPDATE_GOLDEN") == "1"
MODEL = "/models/tiny-seed0"
IMAGES = {"pyxis": "registry.cluster#verl-hpc:cuda", "apptainer": "/shared/images/verl-hpc-cpu.sif",
          "podman": "localhost/verl-hpc:cpu"}


def container(runtime: str, *more: str) -> list[str]:
    return [f"slurm.container.runtime={runtime}", f"slurm.container.image={IMAGES[runtime]}",
            f"model.path={MODEL}", *more]


def cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("runtime", sorted(IMAGES))
def test_golden_script_per_runtime_is_valid_bash(runtime: str) -> None:
    code, out, err = cli("sbatch", "configs/slurm_local.yaml", "--run-dir", "/scratch/runs/slurm_local",
                         "--python", "/opt/verl-hpc/.venv/bin/python", *container(runtime))
    assert code == 0, err
    golden = GOLDEN / f"slurm_local_{runtime}.sbatch"
    if UPDATE:
        golden.write_text(out)
    assert out == golden.read_text(), f"{golden} differs; review, then VERL_HPC_UPDATE_GOLDEN=1"
    assert subprocess.run(["bash", "-n"], input=out, text=True, check=False).returncode == 0
    assert f'VERL_HPC_CONTAINER_RUNTIME="${{VERL_HPC_CONTAINER_RUNTIME:-{runtime}}}"' in out
    assert f"{MODEL}:{MODEL}:ro" in out  # the model is mounted read-only at its own path
    assert 'srun --het-group=0-2 --kill-on-bad-exit=0 "${in_image[@]}" bash -c' in out


def test_cuda_roles_get_the_gpu_flags_of_each_runtime() -> None:
    cuda = ["resources.actor.device_type=cuda", "resources.actor.device_ids=[0,1]"]
    cpu = render_sbatch(load_config(REPO / "configs" / "slurm_local.yaml", container("podman")), Path("/r"),
                        Path("/r/slurm"), "/py")
    gpu = render_sbatch(load_config(REPO / "configs" / "slurm_local.yaml", [*container("podman"), *cuda]),
                        Path("/r"), Path("/r/slurm"), "/py")
    assert "--nv" not in cpu and "nvidia.com/gpu" not in cpu
    assert "apptainer exec --nv --bind" in gpu and '-w "$VERL_HPC_RUN_DIR" --device nvidia.com/gpu=all)' in gpu


def test_without_a_container_the_script_is_unchanged() -> None:
    cfg = load_config(REPO / "configs" / "slurm_local.yaml")
    script = render_sbatch(cfg, Path("/r"), Path("/r/slurm"), "/py")
    assert "in_image" not in script and "VERL_HPC_REQUEUE_REQUEST" not in script


def test_templates_can_switch_a_container_on_when_submitting() -> None:
    template = render_template(load_config(REPO / "configs" / "slurm_ppo_split.yaml"))
    assert 'VERL_HPC_CONTAINER_RUNTIME="${VERL_HPC_CONTAINER_RUNTIME:-none}"' in template
    assert "$HOME/.cache/verl-hpc/models/tiny-seed0:$HOME/.cache/verl-hpc/models/tiny-seed0:ro" in template
    assert "/root" not in template


@pytest.mark.parametrize(("overrides", "field", "hint"), [
    (["slurm.container.runtime=podman"], "slurm.container.image", "tools/build-image.sh"),
    (["slurm.container.image=localhost/verl-hpc:cpu"], "slurm.container.runtime", "pyxis, apptainer, podman"),
    (container("apptainer", "slurm.container.image=verl.sif"), "slurm.container.image", "--sif"),
    (container("pyxis", "slurm.container.image=verl.sqsh"), "slurm.container.image", "full path"),
    (container("podman", "slurm.container.image=/x/verl.sif"), "slurm.container.image", "use its tag"),
    (container("podman", "slurm.container.mounts=[/data:data]"), "slurm.container.mounts[0]", "absolute"),
    (container("podman", "slurm.container.mounts=[/a:/b:rx]"), "slurm.container.mounts[0]", "/data:/data:ro"),
    (container("podman", "slurm.container.env={BAD-NAME: 1}"), "slurm.container.env.BAD-NAME", "letters"),
    (container("podman", "slurm.container.python=python3"), "slurm.container.python", "/opt/verl-hpc"),
    (container("podman", "model.path=models/tiny"), "model.path", "absolute path"),
    (container("podman", "model.path=/models/a:b"), "model.path", "without spaces"),
])
def test_bad_container_config_is_one_line_naming_the_field(overrides: list[str], field: str, hint: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(REPO / "configs" / "slurm_local.yaml", overrides)
    assert caught.value.path == field and hint in (caught.value.hint or ""), caught.value.one_line()
    code, out, err = cli("sbatch", "configs/slurm_local.yaml", *overrides)
    assert code == 2 and out == "" and err.count("\n") == 1 and field in err


# The stubs: each records its arguments (one per line) under $VERL_HPC_LOG_DIR, then starts the task
# command the way the real tool would: srun after its options, podman/apptainer after the image.
STUB_SRUN = """#!/bin/bash
printf '%s\\n' "$@" > "$VERL_HPC_LOG_DIR/srun_args"
while [[ "$1" == --* ]]; do shift; done
for rank in 1 2 3; do : >"$VERL_HPC_LOG_DIR/.usr1_ready_${SLURM_JOB_ID:-0}_${SLURM_RESTART_COUNT:-0}_$rank"; done
exec "$@"
"""
STUB_PODMAN = """#!/bin/bash
printf '%s\\n' "$@" >> "$VERL_HPC_LOG_DIR/podman_args"
[ "$1" = run ] || exit 0
shift
while [[ "$1" == -* ]]; do case "$1" in --label|-w|-v|--device) shift 2 ;; *) shift ;; esac; done
shift  # the image
exec "$@"
"""
STUB_APPTAINER = """#!/bin/bash
printf '%s\\n' "$@" > "$VERL_HPC_LOG_DIR/apptainer_args"
shift  # exec
while [[ "$1" == -* ]]; do case "$1" in --bind|--pwd) shift 2 ;; *) shift ;; esac; done
shift  # the image
exec "$@"
"""
STUB_SCONTROL = """#!/bin/bash
if [ "$1" = show ]; then  # two hetjob components that end 30 s apart
  printf 'JobId=77 HetJobOffset=0 EndTime=2026-12-05T10:00:30 Foo=1\\n\\nJobId=78 EndTime=2026-12-05T10:00:00\\n'
  exit 0
fi
echo "$@" > "$VERL_HPC_LOG_DIR/scontrol_args"
"""
# The worker: notes its working directory and, with STUB_ASK_REQUEUE, asks for a requeue as a worker
# in an image without scontrol does (runtime/process/signals.py).
STUB_PYTHON = f"""#!{sys.executable}
import os, pathlib
logs = pathlib.Path(os.environ["VERL_HPC_LOG_DIR"])
(logs / "worker_ran").write_text(os.getcwd())
(logs / "worker_end_time").write_text(os.environ.get("VERL_HPC_END_TIME", "unset"))
if os.environ.get("STUB_ASK_REQUEUE"):
    pathlib.Path(os.environ["VERL_HPC_REQUEUE_REQUEST"]).write_text("77")
"""


def run_script(tmp_path: Path, script: str, **env_vars: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    """`script` under bash with the stubs first on PATH; (the finished process, its log folder)."""
    bin_dir, run_dir = tmp_path / "bin", tmp_path / "run"
    bin_dir.mkdir(exist_ok=True)
    run_dir.mkdir(exist_ok=True)
    (run_dir / "config.yaml").write_text("{}\n")
    stubs = {"srun": STUB_SRUN, "podman": STUB_PODMAN, "apptainer": STUB_APPTAINER, "scontrol": STUB_SCONTROL,
             "python": STUB_PYTHON}
    for name, text in stubs.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VERL_HPC_", "SLURM_"))}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", SLURM_JOB_ID="77", VERL_HPC_RUN_DIR=str(run_dir),
               VERL_HPC_PYTHON=str(bin_dir / "python"), VERL_HPC_IMAGE_PYTHON=str(bin_dir / "python"), **env_vars)
    done = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60, check=False)
    return done, run_dir / "slurm" / "logs"


def rendered(tmp_path: Path, runtime: str) -> str:
    cfg = load_config(REPO / "configs" / "slurm_local.yaml", container(runtime))
    run_dir = tmp_path / "run"
    return render_sbatch(cfg, run_dir, run_dir / "slurm", str(tmp_path / "bin" / "python"))


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def test_pyxis_options_go_to_srun_and_the_task_starts_inside(tmp_path: Path) -> None:
    done, logs = run_script(tmp_path, rendered(tmp_path, "pyxis"))
    run = tmp_path / "run"
    assert done.returncode == 0, done.stderr
    srun = lines(logs / "srun_args")
    assert srun[:6] == ["--het-group=0-2", "--kill-on-bad-exit=0", f"--container-image={IMAGES['pyxis']}",
                        f"--container-mounts={run}:{run},{MODEL}:{MODEL}:ro", f"--container-workdir={run}", "bash"]
    assert (logs / ".usr1_ready_77_0_0").exists()  # written by the wrapper, i.e. inside the image


def test_apptainer_wraps_the_task_and_binds_the_run_directory(tmp_path: Path) -> None:
    done, logs = run_script(tmp_path, rendered(tmp_path, "apptainer"))
    run = tmp_path / "run"
    assert done.returncode == 0, done.stderr
    assert lines(logs / "apptainer_args")[:7] == ["exec", "--bind", f"{run}:{run},{MODEL}:{MODEL}:ro", "--pwd",
                                                  str(run), IMAGES["apptainer"], "bash"]
    assert (logs / "worker_ran").exists()


def test_podman_removes_old_containers_then_runs_each_task_in_one(tmp_path: Path) -> None:
    done, logs = run_script(tmp_path, rendered(tmp_path, "podman"))
    run = tmp_path / "run"
    assert done.returncode == 0, done.stderr
    calls = (logs / "podman_args").read_text()
    assert calls.startswith("ps\n-aq\n--filter\nlabel=verl-hpc.job=77\n")  # an earlier attempt's, first
    run_args = calls.split("run\n", 1)[1].splitlines()
    for flag in ("--rm", "--network=host", "--ipc=host", "--pid=host", "--env-host"):
        assert flag in run_args
    pairs = list(zip(run_args, run_args[1:], strict=False))
    assert ("-v", f"{run}:{run}") in pairs and ("-v", f"{MODEL}:{MODEL}:ro") in pairs
    assert ("-w", str(run)) in pairs and ("--label", "verl-hpc.job=77") in pairs
    assert run_args[run_args.index(IMAGES["podman"]) + 1] == "bash"
    assert (logs / ".usr1_ready_77_0_0").exists()


def test_a_worker_in_the_image_asks_and_the_batch_shell_requeues(tmp_path: Path) -> None:
    done, logs = run_script(tmp_path, rendered(tmp_path, "podman"), STUB_ASK_REQUEUE="1")
    assert done.returncode == 0, done.stderr
    assert (logs / "scontrol_args").read_text().split() == ["requeue", "77"]
    assert "requeueing job 77 for the workers in the image" in done.stdout
    again, logs = run_script(tmp_path, rendered(tmp_path, "podman"))  # the next attempt starts clean
    assert again.returncode == 0 and not list(logs.glob(".requeue_*"))


def test_template_takes_the_runtime_from_the_environment(tmp_path: Path) -> None:
    template = render_template(load_config(REPO / "configs" / "slurm_local.yaml", [f"model.path={MODEL}"]))
    done, logs = run_script(tmp_path, template, VERL_HPC_CONTAINER_RUNTIME="podman",
                            VERL_HPC_CONTAINER_IMAGE="localhost/other:tag")
    assert done.returncode == 0, done.stderr
    assert "localhost/other:tag" in lines(logs / "podman_args")
    (logs / "podman_args").unlink()
    plain, logs = run_script(tmp_path, template)  # default: none, the task runs on the host
    assert plain.returncode == 0 and not (logs / "podman_args").exists() and (logs / "worker_ran").exists()
    bad, _ = run_script(tmp_path, template, VERL_HPC_CONTAINER_RUNTIME="docker")
    assert bad.returncode == 2 and "use none, pyxis, apptainer or podman" in bad.stderr


def test_requeue_without_scontrol_leaves_the_request_for_the_batch_shell(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import signal

    from verl_hpc.runtime.process.env import JobEnvironment
    from verl_hpc.runtime.process.signals import requeue

    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # an image without Slurm's tools
    env = JobEnvironment(rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr="127.0.0.1",
                         master_port=29500, job_id="42", restart_count=1, scheduler="slurm", hostname="node1")
    monkeypatch.delenv("VERL_HPC_REQUEUE_REQUEST", raising=False)
    requeued, message = requeue(env, max_requeues=3, signum=signal.SIGUSR1)
    assert not requeued and "scontrol is not on PATH" in message  # no container script: resubmit by hand
    request = tmp_path / ".requeue_42_1"
    monkeypatch.setenv("VERL_HPC_REQUEUE_REQUEST", str(request))
    requeued, message = requeue(env, max_requeues=3, signum=signal.SIGUSR1)
    assert requeued and "asked the batch shell to requeue job 42" in message and "restart 2 of at most 3" in message
    assert request.read_text() == "42\n"


def test_image_problem_names_what_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from verl_hpc.launch.container import image_problem

    def check(runtime: str, image: str) -> str | None:
        cfg = load_config(REPO / "configs" / "slurm_local.yaml", container(runtime, f"slurm.container.image={image}"))
        return image_problem(cfg.slurm.container)

    monkeypatch.setenv("PATH", str(tmp_path))
    assert "podman is not installed" in (check("podman", "localhost/verl-hpc:cpu") or "")
    podman = tmp_path / "podman"
    podman.write_text('#!/bin/sh\n[ "$3" = localhost/here:cpu ]\n')  # `podman image exists IMAGE`
    podman.chmod(0o755)
    assert check("podman", "localhost/here:cpu") is None
    assert "not in podman's local store" in (check("podman", "localhost/gone:cpu") or "")
    sif = tmp_path / "verl.sif"
    assert "does not exist" in (check("apptainer", str(sif)) or "")
    sif.touch()
    assert check("apptainer", str(sif)) is None
    assert check("pyxis", "registry#verl-hpc:cuda") is None  # pulled on the nodes: not checked here


def test_submit_says_in_one_line_that_the_image_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool, text in (("sbatch", "exit 1"), ("scontrol", "exit 1"), ("srun", "exit 1"), ("podman", "exit 1")):
        (bin_dir / tool).write_text(f"#!/bin/sh\n{text}\n")
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    run_dir = tmp_path / "run"
    code, out, err = cli("submit", "configs/slurm_local.yaml", "--run-dir", str(run_dir), *container("podman"))
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert "slurm.container.image: localhost/verl-hpc:cpu is not in podman's local store" in err
    assert not run_dir.exists()  # nothing was prepared


def test_workers_in_the_image_get_the_earliest_end_time_from_the_batch_shell(tmp_path: Path) -> None:
    """No scontrol in the image: the deadline's end time comes in as VERL_HPC_END_TIME (unix seconds)."""
    from datetime import datetime

    from verl_hpc.runtime.process.endtime import job_end_time

    done, logs = run_script(tmp_path, rendered(tmp_path, "podman"))
    assert done.returncode == 0, done.stderr
    earliest = datetime(2026, 12, 5, 10, 0, 0).timestamp()  # scontrol's local time, as endtime.py reads it
    seen = (logs / "worker_end_time").read_text()
    assert float(seen) == earliest
    assert job_end_time({"VERL_HPC_END_TIME": seen, "SLURM_JOB_ID": "77"}).at == earliest
    given, logs = run_script(tmp_path, rendered(tmp_path, "podman"), SLURM_JOB_END_TIME="1800000000")
    assert given.returncode == 0 and (logs / "worker_end_time").read_text() == "unset"  # Slurm's own is read
    template = render_template(load_config(REPO / "configs" / "slurm_local.yaml", [f"model.path={MODEL}"]))
    plain, logs = run_script(tmp_path, template)  # on the host the workers ask scontrol themselves
    assert plain.returncode == 0 and (logs / "worker_end_time").read_text() == "unset"


@pytest.mark.parametrize("runtime", sorted(IMAGES))
def test_environment_workers_run_in_the_image_too(runtime: str) -> None:
    code, out, err = cli("sbatch", "configs/slurm_env_box.yaml", "--run-dir", "/scratch/runs/env",
                         "--python", "/opt/verl-hpc/.venv/bin/python", *container(runtime))
    assert code == 0, err
    assert subprocess.run(["bash", "-n"], input=out, text=True, check=False).returncode == 0
    assert 'srun --het-group=1 --kill-on-bad-exit=0 "${in_image[@]}" bash -c' in out  # the env step
    assert 'srun --het-group=0 --kill-on-bad-exit=0 "${in_image[@]}" bash -c' in out  # the training step
