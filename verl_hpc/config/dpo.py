"""DPO's knobs (`algorithm.dpo`); the checks a DPO run needs are in dpo_checks.py.

Why apart from checks.py: DPO is offline — preference pairs in, no rollouts, no reward, no
critic — so most of the RL loop's cross-checks (group sizes, estimators, reward functions)
do not apply, and the ones that do are different (pairs per rank, the pair columns). A
config that asks DPO for a role it cannot use is refused in one line naming the field,
rather than silently ignored.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from verl_hpc.config.base import StrictModel
from verl_hpc.config.errors import FieldError

PREFERENCE_TASKS = ("arithmetic_preference",)   # built-in tasks that write prompt/chosen/rejected
PAIR_COLUMNS = ("chosen", "rejected")


class DPOConfig(StrictModel):
    """Direct preference optimisation (Rafailov et al. 2023) and IPO (Azar et al. 2023)."""

    beta: float = Field(0.1, gt=0.0, description="strength of the pull towards the reference policy")
    loss_type: Literal["sigmoid", "ipo"] = Field("sigmoid", description="sigmoid = DPO's loss; ipo = the "
                                                 "squared loss on length-averaged log-ratios")
    label_smoothing: float = Field(0.0, ge=0.0, lt=0.5, description="sigmoid only: the assumed share of "
                                   "flipped labels (conservative DPO); 0 = the paper's loss")
    sft_coef: float = Field(0.0, ge=0.0, description="weight of the chosen reply's per-token NLL added "
                            "to the loss (RPO; TRL's rpo_alpha); 0 = the paper's loss")
    max_response_length: int = Field(64, ge=1, description="tokens of a chosen/rejected response (EOS "
                                     "included); a longer one stops the run naming the row")

    @model_validator(mode="after")
    def _smoothing_for_sigmoid(self) -> DPOConfig:
        if self.label_smoothing and self.loss_type != "sigmoid":
            raise FieldError("label_smoothing", f"only the sigmoid loss is smoothed (loss_type is {self.loss_type})",
                             "set label_smoothing: 0, or loss_type: sigmoid")
        return self
