"""The image on a machine like CI's: it builds, holds no compiler, trains the quickstart, and runs a
Slurm job whose every task is a podman container, through a requeue, with exactly the metrics of
the same config run uninterrupted in the same image.

The image here is the lean flavour (`tools/build-image.sh --no-vllm`): the same Containerfile and
install script as the product image, without vLLM, which neither the quickstart nor this job uses
(their rollouts are Hugging Face `generate`). Building it is most of this module's time (see
docs/container.md for measured times of both flavours): 5-15 minutes of a fresh machine, more than
the 60 minutes of the whole suite can spare, so it runs when asked (`ASK`), not in `tools/test.sh`'s
default run: `VERL_HPC_IMAGE_TESTS=1 bash tools/test.sh tests/slurm/test_container_image.py`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import SlurmCluster

pytestmark = [pytest.mark.slow, pytest.mark.container]
REPO = Path(__file__).resolve().parents[2]
TAG = "localhost/verl-hpc:test-lean"
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
VOLATILE = ("timing_s/", "perf/", "memory/")
EXIT_UNAVAILABLE = 3  # tools/build-image.sh: no podman/buildah and none could be installed
ASK = "VERL_HPC_IMAGE_TESTS"


def _unavailable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"the image tests cannot run under CI: {reason}", pytrace=False)
    pytest.skip(f"cannot build images here: {reason}")


@pytest.fixture(scope="module")
def image() -> Iterator[str]:
    """The lean image, built by tools/build-image.sh (podman's layer cache makes a rebuild quick)."""
    if os.environ.get(ASK) != "1":
        pytest.skip(f"builds an image (5-15 min); run with {ASK}=1 "
                    "bash tools/test.sh tests/slurm/test_container_image.py")
    if os.geteuid() != 0 and shutil.which("podman") is None:
        _unavailable("podman is not installed and this is not root")
    done = subprocess.run(["bash", "tools/build-image.sh", "--no-vllm", "--tag", TAG], cwd=REPO, text=True,
                          capture_output=True, timeout=3600, check=False)
    if done.returncode == EXIT_UNAVAILABLE:
        _unavailable(done.stderr.strip().splitlines()[-1])
    assert done.returncode == 0, done.stderr[-4000:]
    conf = re.search(r"^CONTAINERS_CONF=(\S+)$", done.stdout, re.M)
    previous = os.environ.get("CONTAINERS_CONF")
    if conf:  # podman needs a config of its own here; the Slurm job inherits it through sbatch
        os.environ["CONTAINERS_CONF"] = conf[1]
    print(done.stderr[-1500:])  # the build's timings, for the CI log
    yield TAG
    if conf:
        if previous is None:
            os.environ.pop("CONTAINERS_CONF", None)
        else:
            os.environ["CONTAINERS_CONF"] = previous


def podman(*args: str, timeout: float = 1800) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["podman", *args], text=True, capture_output=True, timeout=timeout, check=False)


def in_image(image: str, mount: Path, *command: str, timeout: float = 3600) -> subprocess.CompletedProcess[str]:
    """`command` in a container of `image`, with `mount` at its own path (as the job script mounts).

    On a timeout the container is removed too: killing the podman client alone leaves it running.
    """
    label = f"verl-hpc.test={uuid.uuid4().hex}"
    try:
        return podman("run", "--rm", "--network=host", "--ipc=host", "--label", label, "-v", f"{mount}:{mount}",
                      image, *command, timeout=timeout)
    finally:
        left = podman("ps", "-aq", "--filter", f"label={label}", timeout=60).stdout.split()
        if left:
            podman("rm", "-f", "-t", "0", *left, timeout=120)


def test_the_image_holds_no_compiler_toolchain(image: str) -> None:
    done = subprocess.run([sys.executable, str(REPO / "tools" / "check-image"), "--podman", image], text=True,
                          capture_output=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no compiler toolchain" in done.stdout


def test_quickstart_in_the_image_reproduces_the_readme(image: str, tmp_path: Path) -> None:
    """`verl-hpc train configs/quickstart.yaml` inside the image: the README's final score, to the digit."""
    readme = (REPO / "README.md").read_text()
    expected = re.search(r"^steps: 500\s+final critic/score/mean: (\S+)$", readme, re.M)
    assert expected, "the README no longer shows the quickstart's final line"
    done = in_image(image, tmp_path, "verl-hpc", "train", "configs/quickstart.yaml", "--run-dir",
                    str(tmp_path / "quickstart"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"steps: 500   final critic/score/mean: {expected[1]}" in done.stdout, done.stdout[-2000:]
    assert (tmp_path / "quickstart" / "hf_model" / "config.json").is_file()  # left on the host


def rows(run_dir: Path) -> list[dict]:
    lines = (run_dir / "tensorboard" / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(VOLATILE)} for line in lines if line]


def job_logs(run_dir: Path) -> str:
    """The batch shell's and every rank's output, last lines each: what a failed wait shows."""
    files = sorted((run_dir / "slurm").glob("*.out")) + sorted((run_dir / "slurm" / "logs").glob("*.out"))
    return "\n".join(f"== {f.name}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-15:]) for f in files)


def steps_done(run_dir: Path) -> int:
    path = run_dir / "tensorboard" / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.slurm
def test_podman_job_is_requeued_and_resumes_exactly(image: str, slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """configs/slurm_local.yaml (3 hetjob components, 4 tasks) with `runtime: podman`."""
    from verl_hpc.models.tiny import init_model

    model = init_model(tmp_path / "tiny", preset="tiny", seed=0)
    common = [f"model.path={model}", "trainer.total_steps=40", "checkpoint.interval_steps=10", "logging.progress=off"]
    reference = tmp_path / "reference"  # the same image, uninterrupted, through the local launcher
    done = in_image(image, tmp_path, "verl-hpc", "train", "configs/slurm_local.yaml", "--run-dir", str(reference),
                    *common)
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = tmp_path / "requeued"
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    submitted = subprocess.run(
        [sys.executable, "-m", "verl_hpc", "submit", "configs/slurm_local.yaml", "--run-dir", str(run_dir), *common,
         "slurm.container.runtime=podman", f"slurm.container.image={image}"],
        cwd=REPO, env=env, text=True, capture_output=True, timeout=600, check=False)
    assert submitted.returncode == 0, submitted.stderr
    job = int(next(line.split()[-1] for line in submitted.stdout.splitlines() if line.startswith("submitted job")))
    containers: set[str] = set()

    def progressed() -> bool:
        listed = podman("ps", "--filter", f"label=verl-hpc.job={job}", "--format", "{{.Names}}", timeout=60)
        containers.update(listed.stdout.split())
        return steps_done(run_dir) >= 12

    assert slurm_cluster.wait_for(progressed, timeout=300), job_logs(run_dir)
    assert len(containers) >= 4  # every task of every component ran in a container of its own
    slurm_cluster.run("scontrol", "requeue", str(job))  # SIGTERM to every task (podman passes it in)
    assert slurm_cluster.wait_for(lambda: set(slurm_cluster.job_states(job)) <= DONE, timeout=400)
    records = slurm_cluster.job_records(job)
    assert {r["JobState"] for r in records} == {"COMPLETED"}, records
    assert int(records[0]["Restarts"]) >= 1
    assert rows(run_dir) == rows(reference)  # every step once, every number equal
    assert podman("ps", "-aq", "--filter", f"label=verl-hpc.job={job}", timeout=60).stdout.strip() == ""
