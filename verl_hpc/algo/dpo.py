"""DPO and IPO: the preference losses, from sequence log-probs of a policy and its frozen reference.

Why a pure function of four vectors: the loss is the part a reader checks against the
papers (Rafailov et al. 2023, arXiv:2305.18290; Azar et al. 2023, arXiv:2310.12036), and
keeping the forward passes out of it lets a test work the numbers out by hand. The
runtime (runtime/step/dpo.py) sums token log-probs per sequence (`sequence_logps`) and calls
`preference_loss` on every micro-batch of pairs.

With h = (log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l)):
- sigmoid (DPO):  -(1 - eps) log sigma(beta h) - eps log sigma(-beta h)   (eps = label smoothing,
  the "conservative DPO" of noisy labels; eps = 0 is the paper's loss);
- ipo:            (h - 1 / (2 beta))^2, on log-probs averaged over each response's tokens
  (IPO's authors and TRL normalise by length; a sum would grow the target with the length).
The implicit rewards are beta x the policy-reference log-ratio of each response.

`sft_coef` adds that weight x the chosen reply's per-token negative log-likelihood (RPO, Pang et
al. 2024, arXiv:2404.19733; TRL's `rpo_alpha`). Why: DPO only ranks the chosen reply above
the rejected one; nothing in it keeps the chosen reply likely against every *other* reply,
and from a policy that was never fine-tuned (the quickstart's random model) the probability
mass it takes from rejected replies flows to junk, which greedy decoding then picks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

LOSS_TYPES = ("sigmoid", "ipo")


@dataclass
class PreferenceLoss:
    """Per-pair losses and the per-pair numbers the metrics average (all shape [P])."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor    # beta * (log pi - log pi_ref) of the chosen response
    rejected_rewards: torch.Tensor
    chosen_logps: torch.Tensor      # the policy's sequence log-probs, as the loss saw them
    rejected_logps: torch.Tensor

    def stats(self) -> dict[str, float]:
        """Means over the pairs: loss, reward margin, the share the policy ranks right, log-probs."""
        margin = self.chosen_rewards - self.rejected_rewards
        return {"loss": float(self.losses.mean()), "reward_margin": float(margin.mean()),
                "reward_accuracy": float((margin > 0).float().mean()),
                "chosen_rewards": float(self.chosen_rewards.mean()),
                "rejected_rewards": float(self.rejected_rewards.mean()),
                "chosen_logps": float(self.chosen_logps.mean()), "rejected_logps": float(self.rejected_logps.mean())}


def sequence_logps(token_logps: torch.Tensor, mask: torch.Tensor, average: bool = False) -> torch.Tensor:
    """[B, R] token log-probs -> [B]: the sum over each response's tokens, or their mean."""
    total = (token_logps * mask).sum(dim=-1)
    return total / mask.sum(dim=-1).clamp(min=1) if average else total


def preference_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
                    ref_rejected: torch.Tensor, beta: float = 0.1, loss_type: str = "sigmoid",
                    label_smoothing: float = 0.0, sft_coef: float = 0.0,
                    chosen_nll: torch.Tensor | None = None) -> PreferenceLoss:
    """The loss of each pair (chosen y_w, rejected y_l) from their sequence log-probs.

    `chosen_nll`: the chosen replies' per-token negative log-likelihood, needed when `sft_coef` > 0.
    """
    chosen_ratio = policy_chosen - ref_chosen
    rejected_ratio = policy_rejected - ref_rejected
    h = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        losses = -(1.0 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif loss_type == "ipo":
        losses = (h - 1.0 / (2.0 * beta)) ** 2
    else:
        raise ValueError(f"unknown DPO loss type {loss_type!r}; use one of {', '.join(LOSS_TYPES)}")
    if sft_coef:
        if chosen_nll is None:
            raise ValueError("sft_coef > 0 needs the chosen replies' negative log-likelihood (chosen_nll)")
        losses = losses + sft_coef * chosen_nll
    return PreferenceLoss(losses=losses, chosen_rewards=beta * chosen_ratio.detach(),
                          rejected_rewards=beta * rejected_ratio.detach(), chosen_logps=policy_chosen.detach(),
                          rejected_logps=policy_rejected.detach())
