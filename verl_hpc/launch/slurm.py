"""One heterogeneous Slurm job through submitit: `HetjobExecutor` and the submission's preparation.

Why a submitit subclass and not a fork: submitit already does the careful parts of
submission (a job folder per submitter, the script written then moved next to its job
id, sbatch's answer parsed, errors surfaced). It has no hetjob support (submitit#1741),
and its script runs a pickled function; ours runs the worker module over every hetjob
component. Its two hooks — the submission text and the task count — are all we replace,
and its submission path is the one private method we call: `SUBMITIT_PRIVATE_HOOKS` names
each, and tests/launch/test_submitit_hooks.py checks each still exists with the signature
we rely on, so a submitit upgrade that changes one fails a test that names it. We never use
submitit's job state: without accounting it stays UNKNOWN (slurm_job.py).

Submission order (`SlurmExecutor.submit` in executor.py): validate the config, check that
Slurm's tools (and the container image, with `slurm.container`) are here, then prepare the run directory (config.yaml, model, prompts,
secret; once, on this machine), then sbatch. Job files go to `<run_dir>/slurm/`: the
submission script as `<id>_submission.sh`, the batch shell's log as `<id>_batch.out`,
each rank's output in `logs/<group>_rank<N>.out`.
"""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

import submitit
from submitit.core.utils import FailedJobError

from verl_hpc.config import RunConfig
from verl_hpc.config.placement import plan_for_config
from verl_hpc.launch.sbatch import WORKER_MODULE, render_sbatch
from verl_hpc.launch.slurm_job import SlurmError
from verl_hpc.utils.fs import expand_path

JOB_FOLDER = "slurm"
SUBMIT_TOOLS = ("sbatch", "scontrol", "srun")
# The private members of submitit.SlurmExecutor this module relies on, with their parameters
# (after self): overridden (the first two) or called (the third).
SUBMITIT_PRIVATE_HOOKS = {"_make_submission_file_text": ("command", "uid"), "_num_tasks": (),
                          "_submit_command": ("command",)}


class HetjobExecutor(submitit.SlurmExecutor):
    """submitit's SlurmExecutor whose script is `render_sbatch(cfg, ...)`: one component per group.

    `update_parameters` has no effect here: every #SBATCH option comes from the config
    (resources.<role> per component, slurm.* job-wide), so a script never mixes sources.
    """

    def __init__(self, folder: str | Path, cfg: RunConfig, run_dir: Path, python: str = sys.executable):
        super().__init__(folder=folder, python=python)
        self.cfg, self.run_dir, self.worker_python = cfg, Path(run_dir), python
        self.plan = plan_for_config(cfg)

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        return render_sbatch(self.cfg, self.run_dir, Path(self.folder), self.worker_python)

    def _num_tasks(self) -> int:
        return self.plan.world_size

    def submit_run(self) -> submitit.SlurmJob:
        """sbatch the run's script through submitit's own submission path; one-line errors."""
        captured = io.StringIO()
        try:
            with contextlib.redirect_stderr(captured):  # submitit prints sbatch's stderr itself
                return self._submit_command(WORKER_MODULE)
        except FailedJobError as err:
            lines = (str(err) or captured.getvalue()).strip().splitlines()
            raise SlurmError(f"sbatch refused the job: {lines[-1] if lines else 'no reason given'}") from None


def resolve_run_dir(cfg: RunConfig, run_dir: str | Path | None) -> Path:
    """The absolute run directory: `run_dir`, else `cfg.run_dir`, else `runs/<slurm.job_name>`.

    Why a fixed default (not a timestamp, as `verl-hpc train` uses): `verl-hpc sbatch` must
    print the same script `submit` sends, and a resubmitted job must find its checkpoints.
    """
    chosen = run_dir or cfg.run_dir or Path("runs") / cfg.slurm.job_name
    return expand_path(str(chosen)).absolute()


def prepare_submission(cfg: RunConfig, run_dir: Path) -> Path:
    """Prepare the run directory and its job folder (with logs/); returns the job folder."""
    from verl_hpc.launch.train import prepare_run  # torch is imported only when really submitting

    path = prepare_run(cfg, run_dir)
    folder = path / JOB_FOLDER
    (folder / "logs").mkdir(parents=True, exist_ok=True)
    return folder
