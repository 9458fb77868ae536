"""verl 0.9.1's own numbers for the cases tests/algo/test_verl_parity.py builds.

Run as a script with the verl reference folder first on PYTHONPATH (tools/verl_ref.sh):

    python tests/algo/verl_reference.py CASES.pt OUT.pt

Why a separate process: verl's import brings ray, tensordict and hydra's omegaconf, and
patches nothing we want in the test session; this file imports verl only, never the
project, so every number in OUT.pt is verl's. Each case names the verl function and its
inputs; the answer holds the outputs and, for losses, the gradient of the loss (or of a
weighted sum of a per-token output) with respect to the input the policy trains.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import torch


def _estimator(case: dict[str, Any]) -> dict[str, torch.Tensor]:
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo import core_algos

    fn = core_algos.get_adv_estimator_fn(case["name"])
    kwargs = dict(case["kwargs"])
    if "index" in kwargs:
        kwargs["index"] = np.array(kwargs["index"], dtype=object)
    if "gamma_config" in case:
        kwargs["config"] = AlgoConfig(gamma=case["gamma_config"])
    advantages, returns = fn(**kwargs)
    return {"advantages": advantages, "returns": returns}


def _actor_config(case: dict[str, Any]) -> Any:
    from verl.workers.config import ActorConfig

    return ActorConfig(strategy="fsdp", clip_ratio=case["clip_low"], clip_ratio_low=case["clip_low"],
                       clip_ratio_high=case["clip_high"], clip_ratio_c=case["clip_ratio_c"],
                       loss_agg_mode=case["mode"], ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1,
                       rollout_n=1)


def _policy_loss(case: dict[str, Any]) -> dict[str, torch.Tensor]:
    from verl.trainer.ppo import core_algos

    logp = case["log_prob"].clone().requires_grad_(True)
    loss, metrics = core_algos.get_policy_loss_fn(case["loss_mode"])(
        old_log_prob=case["old_log_prob"], log_prob=logp, advantages=case["advantages"],
        response_mask=case["mask"], loss_agg_mode=case["mode"], config=_actor_config(case))
    loss.backward()
    return {"loss": loss.detach(), "grad": logp.grad,
            **{k.split("/")[-1]: torch.tensor(float(v), dtype=torch.float64) for k, v in metrics.items()}}


def _agg(case: dict[str, Any]) -> dict[str, torch.Tensor]:
    from verl.trainer.ppo import core_algos

    return {"loss": core_algos.agg_loss(loss_mat=case["loss_mat"], loss_mask=case["mask"], loss_agg_mode=case["mode"])}


def _value_loss(case: dict[str, Any]) -> dict[str, torch.Tensor]:
    from verl.trainer.ppo import core_algos

    vpreds = case["vpreds"].clone().requires_grad_(True)
    loss, clipfrac = core_algos.compute_value_loss(vpreds=vpreds, returns=case["returns"], values=case["values"],
                                                   response_mask=case["mask"], cliprange_value=case["clip"],
                                                   loss_agg_mode=case["mode"])
    loss.backward()
    return {"loss": loss.detach(), "grad": vpreds.grad, "clipfrac": clipfrac.detach()}


def _entropy(case: dict[str, Any]) -> dict[str, torch.Tensor]:
    from verl.trainer.ppo import core_algos

    logits = case["logits"].clone().requires_grad_(True)
    loss = core_algos.compute_entropy_loss(logits, case["mask"], loss_agg_mode=case["mode"])
    loss.backward()
    return {"loss": loss.detach(), "grad": logits.grad}


def _kl(case: dict[str, Any]) -> dict[str, torch.Tensor]:
    from verl.trainer.ppo import core_algos

    logp = case["logprob"].clone().requires_grad_(True)
    kl = core_algos.kl_penalty(logp, case["ref_logprob"], case["kl_kind"])
    (kl * case["weights"]).sum().backward()
    return {"kl": kl.detach(), "grad": logp.grad}


KINDS = {"estimator": _estimator, "policy_loss": _policy_loss, "agg": _agg, "value_loss": _value_loss,
         "entropy": _entropy, "kl": _kl}


def main(argv: list[str]) -> int:
    cases: dict[str, dict[str, Any]] = torch.load(argv[1], weights_only=False)
    torch.save({name: KINDS[case["kind"]](case) for name, case in cases.items()}, argv[2])
    import verl

    print(f"verl {verl.__version__} from {verl.__file__}: {len(cases)} cases")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
