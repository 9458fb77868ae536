"""`slurm.container`: every task of a Slurm job runs inside one image (docs/container.md).

Why a config section and not a wrapper script in `slurm.setup`: the job script has to know
the image to start every hetjob component's tasks in it (pyxis takes srun options, Apptainer
and podman wrap the command), to mount the run directory at the same path (so checkpoints,
requeue and resume behave exactly as without a container) and to keep the signal handshake
(the per-task USR1 marker must be written from inside the container). Checked here, before
anything is submitted, so a typo in an image or mount costs one line, not a queued job.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from verl_hpc.config.base import StrictModel
from verl_hpc.config.errors import FieldError

IMAGE_PYTHON = "/opt/verl-hpc/venv/bin/python"  # where the Containerfile puts the venv
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_URI = re.compile(r"^[a-z][a-z0-9+.-]*://")
NO_SPACES = re.compile(r"^[^\s'\"\\,]+$")
RUNTIMES = ("pyxis", "apptainer", "podman")


class ContainerConfig(StrictModel):
    """The image every task runs in, how it is started, and what of the host it sees."""

    runtime: Literal["none", "pyxis", "apptainer", "podman"] = Field(
        "none", description="pyxis (srun --container-image, enroot), apptainer (apptainer exec), podman "
        "(podman run: one machine, e.g. tools/slurm-local), or none: the tasks run on the host")
    image: str | None = Field(None, description="pyxis: a registry image (`registry#name:tag`) or an absolute "
                              ".sqsh path; apptainer: an absolute .sif path (or a docker:// URI); podman: an "
                              "image in the node's local store (`localhost/verl-hpc:cpu`)")
    mounts: list[str] = Field(default_factory=list, description="more host paths to see inside, `SRC` (same "
                              "path) or `SRC:DST[:ro]`; the run directory and the paths the config reads "
                              "(model, data, reward file) are mounted at their own paths without asking")
    env: dict[str, str] = Field(default_factory=dict, description="variables set for every task (exported "
                                "by the batch shell; each runtime passes the job's environment in)")
    python: str = Field(IMAGE_PYTHON, description="the interpreter with verl_hpc installed, inside the image")

    @field_validator("env", mode="before")
    @classmethod
    def _env_as_text(cls, env: object) -> object:
        """YAML reads `OMP_NUM_THREADS: 8` as a number; the environment holds text."""
        if isinstance(env, dict):
            return {k: str(v) if isinstance(v, int | float | bool) else v for k, v in env.items()}
        return env

    @model_validator(mode="after")
    def _check(self) -> ContainerConfig:
        if self.runtime == "none":
            if self.image is not None:
                raise FieldError("runtime", f"image {self.image!r} is set but runtime is none",
                                 f"set runtime to one of {', '.join(RUNTIMES)}, or remove image")
            return self
        if not self.image:
            raise FieldError("image", f"runtime {self.runtime} needs an image",
                             "e.g. localhost/verl-hpc:cpu (podman), /shared/verl-hpc.sif (apptainer), "
                             "registry#verl-hpc:cuda or /shared/verl-hpc.sqsh (pyxis); tools/build-image.sh builds it")
        _check_image(self.runtime, self.image)
        for index, mount in enumerate(self.mounts):
            parse_mount(mount, f"mounts[{index}]")
        for name, value in self.env.items():
            if not _ENV_NAME.match(name):
                raise FieldError(f"env.{name}", "is not a shell variable name", "use letters, digits and _")
            if "\n" in str(value) or "\r" in str(value):
                raise FieldError(f"env.{name}", "a value cannot hold a line break", "put it on one line")
        if not self.python.startswith("/") or not NO_SPACES.match(self.python):
            raise FieldError("python", f"{self.python!r} is not an absolute path without spaces",
                             f"the interpreter inside the image, e.g. {IMAGE_PYTHON}")
        return self


def _check_image(runtime: str, image: str) -> None:
    if not NO_SPACES.match(image):
        raise FieldError("image", f"{image!r} cannot go into a job script", "use no spaces, quotes or commas")
    is_file = image.endswith((".sif", ".sqsh", ".squashfs"))
    if runtime == "apptainer" and not (_URI.match(image) or image.startswith("/")):
        raise FieldError("image", f"{image!r}: apptainer needs an absolute .sif path (or a docker:// URI)",
                         "convert the image: tools/build-image.sh --sif /shared/verl-hpc.sif")
    if runtime == "pyxis" and is_file and not image.startswith("/"):
        raise FieldError("image", f"{image!r}: pyxis takes a squashfs file only as an absolute path",
                         "give the full path on the shared file system, e.g. /shared/verl-hpc.sqsh")
    if runtime == "podman" and is_file:
        raise FieldError("image", f"{image!r}: podman runs images from its local store, not .sif/.sqsh files",
                         "build it there with tools/build-image.sh, then use its tag (localhost/verl-hpc:cpu)")


def parse_mount(mount: str, field: str) -> tuple[str, str, bool]:
    """`SRC`, `SRC:DST`, `SRC:DST:ro|rw` -> (source, destination, read_only); both absolute."""
    parts = mount.split(":")
    if not NO_SPACES.match(mount) or len(parts) > 3 or (len(parts) == 3 and parts[2] not in ("ro", "rw")):
        raise FieldError(field, f"{mount!r} is not SRC, SRC:DST or SRC:DST:ro",
                         "absolute paths without spaces, commas or colons, e.g. /scratch or /data:/data:ro")
    source, target = parts[0], parts[1] if len(parts) > 1 else parts[0]
    if not source.startswith("/") or not target.startswith("/"):
        raise FieldError(field, f"{mount!r}: both paths must be absolute",
                         "give absolute paths, e.g. /scratch/data:/data:ro")
    return source.rstrip("/") or "/", target.rstrip("/") or "/", len(parts) == 3 and parts[2] == "ro"
