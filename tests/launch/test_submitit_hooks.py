"""The private parts of submitit the Slurm executor relies on, each named, each checked.

Why: `HetjobExecutor` overrides two private hooks of `submitit.SlurmExecutor` and calls its
private submission path (launch/slurm.py says why). A submitit release may rename or
re-sign any of them without notice; this test fails first, naming the member, instead of
a submission that silently renders submitit's own script. That the submission path still
writes exactly our text is checked on a real cluster (tests/slurm/test_submit.py compares
`<id>_submission.sh` with `verl-hpc sbatch`).
"""

from __future__ import annotations

import inspect

import pytest
import submitit

from verl_hpc.launch.slurm import SUBMITIT_PRIVATE_HOOKS, HetjobExecutor


@pytest.mark.parametrize("name", sorted(SUBMITIT_PRIVATE_HOOKS))
def test_each_private_submitit_member_still_exists_with_our_signature(name: str) -> None:
    member = getattr(submitit.SlurmExecutor, name, None)
    assert callable(member), f"submitit.SlurmExecutor.{name} is gone (submitit {submitit.__version__})"
    params = [p for p in inspect.signature(member).parameters.values() if p.name != "self"]
    required = tuple(p.name for p in params if p.default is inspect.Parameter.empty
                     and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
    assert required == SUBMITIT_PRIVATE_HOOKS[name], \
        f"submitit.SlurmExecutor.{name}{inspect.signature(member)} is not what HetjobExecutor relies on"


def test_the_overrides_are_exactly_the_declared_hooks() -> None:
    """Every private method HetjobExecutor defines is declared (and so checked above)."""
    own = {name for name, value in vars(HetjobExecutor).items()
           if name.startswith("_") and not name.startswith("__") and callable(value)}
    assert own <= set(SUBMITIT_PRIVATE_HOOKS), own - set(SUBMITIT_PRIVATE_HOOKS)
    for name in own:
        ours = [p.name for p in inspect.signature(getattr(HetjobExecutor, name)).parameters.values()]
        assert tuple(ours[1:]) == SUBMITIT_PRIVATE_HOOKS[name], name


def test_the_public_names_used_are_there() -> None:
    """The constructor's folder/python keywords and the error sbatch's refusal raises."""
    from submitit.core.utils import FailedJobError

    params = inspect.signature(submitit.SlurmExecutor.__init__).parameters
    assert {"folder", "python"} <= set(params)
    assert issubclass(FailedJobError, Exception)
