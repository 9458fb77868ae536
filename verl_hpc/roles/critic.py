"""The critic (PPO): a value head on a causal-LM backbone, trained to predict returns.

Why a backbone + linear head built here rather than a sequence-classification class:
it works for any causal LM directory (the actor's own, by default), and its state dict
is just the backbone's plus two tensors, which DCP shards like any other module.
"""

from __future__ import annotations

import torch
from torch import nn

from verl_hpc.algo import counted_rows, value_loss
from verl_hpc.config import AlgorithmConfig
from verl_hpc.config.schema import OptimConfig
from verl_hpc.roles.actor import UpdatePlan, data_parallel_scale, micro_weight
from verl_hpc.roles.micro_batching import micro_batches_of, reassemble
from verl_hpc.roles.offload import ParamOffload
from verl_hpc.roles.optimizer import OptimizedModel
from verl_hpc.roles.packing import pack, packed_response_outputs


class ValueModel(nn.Module):
    def __init__(self, backbone: nn.Module, hidden_size: int, seed: int = 0):
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)
        # Fan-in init (values ~ unit scale at start), as a fresh regression head would be:
        # the first losses show how far the untrained critic is, and their fall shows it learning.
        # Its own generator: every placement must start from the same head, whatever ran before.
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            weight = torch.randn(self.value_head.weight.shape, generator=generator) * hidden_size ** -0.5
            self.value_head.weight.copy_(weight.to(self.value_head.weight.dtype))
        nn.init.zeros_(self.value_head.bias)

    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype = torch.float32, seed: int = 0,
                        skeleton: bool = False) -> ValueModel:
        """`skeleton`: parameters on meta, to be filled from another rank (roles/loading.py)."""
        from transformers import AutoModel

        if skeleton:
            from verl_hpc.roles.loading import backbone_skeleton, parameters_on_meta

            backbone = backbone_skeleton(path, dtype)
            with parameters_on_meta():
                return cls(backbone, backbone.config.hidden_size, seed)
        backbone = AutoModel.from_pretrained(path, dtype=dtype)
        return cls(backbone, backbone.config.hidden_size, seed)

    remove_padding = False  # model.remove_padding: the backbone over packed rows (packing.py)

    def forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Values of the states before each response token, [B, R]."""
        resp_len = inputs["response_mask"].shape[1]
        packed = pack(inputs) if self.remove_padding else None
        if packed is not None:
            hidden = packed_response_outputs(
                lambda ids, positions: self.backbone(input_ids=ids, position_ids=positions, attention_mask=None,
                                                     use_cache=False).last_hidden_state, inputs, packed)
            return self.value_head(hidden).squeeze(-1).float()
        hidden = self.backbone(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                               position_ids=inputs["position_ids"], use_cache=False).last_hidden_state
        return self.value_head(hidden[:, -resp_len - 1:-1, :]).squeeze(-1).float()


class Critic(OptimizedModel):
    def __init__(self, model: ValueModel, algo: AlgorithmConfig, optim: OptimConfig, total_steps: int,
                 dp_group=None, offload: ParamOffload | None = None):
        super().__init__(model, optim, total_steps)
        self.dp_group = dp_group
        self.offload = offload or ParamOffload.none()  # model.param_offload.critic
        self.algo = algo

    @torch.no_grad()
    def compute_values(self, inputs: dict[str, torch.Tensor], micro_batch_size: int,
                       token_budget: int | None = None) -> torch.Tensor:
        self.model.eval()
        with self.offload.resident():
            parts = [(rows, self.model(mb)) for rows, mb in micro_batches_of(inputs, micro_batch_size, token_budget,
                                                                               self.dp_group)]
        return reassemble(parts, inputs["input_ids"].shape[0], inputs["response_mask"].shape[1])

    def update(self, inputs: dict[str, torch.Tensor], plan: UpdatePlan) -> dict[str, float]:
        """Value regression over this rank's mini-batches (same slices every epoch, as the actor)."""
        batch_size = inputs["input_ids"].shape[0]
        self.model.train()
        sums: dict[str, float] = {}
        count = 0
        with self.offload.resident():
            for _ in range(plan.epochs):
                for rows in plan.mini_batches(batch_size):
                    mini = {k: v[rows] for k, v in inputs.items()}
                    for key, value in self._optimizer_step(mini, plan.micro_batch_size, plan.token_budget).items():
                        sums[key] = sums.get(key, 0.0) + value
                    count += 1
        self.scheduler.step()
        return {k: v / count for k, v in sums.items()}

    def _optimizer_step(self, mini: dict[str, torch.Tensor], micro_size: int,
                        token_budget: int | None = None) -> dict[str, float]:
        """Loss metrics are pre-scaled by the data-parallel share, as in `Actor._optimizer_step`."""
        self.optimizer.zero_grad(set_to_none=True)
        total_tokens = mini["response_mask"].sum().clamp(min=1)
        total_rows = counted_rows(mini["response_mask"]).sum()
        sums = {"vf_loss": 0.0, "vf_clipfrac": 0.0}
        mode = self.algo.loss_agg_mode
        dp_scale = data_parallel_scale(mini["response_mask"], mode, self.dp_group)
        # vf_clipfrac is a token mean whatever the loss's mode
        stat_scale = dp_scale if mode == "token-mean" else data_parallel_scale(mini["response_mask"], "token-mean",
                                                                               self.dp_group)
        for _, micro in micro_batches_of(mini, micro_size, token_budget, self.dp_group):
            mask = micro["response_mask"]
            weight = micro_weight(mask, total_tokens, total_rows, mode)
            values = self.model(micro)
            loss, stats = value_loss(values, micro["values"], micro["returns"], mask, self.algo.value_clip,
                                     self.algo.loss_agg_mode, self.algo.sampling.max_new_tokens)
            (loss * weight * dp_scale).backward()
            sums["vf_loss"] += float(loss.detach()) * weight * dp_scale
            sums["vf_clipfrac"] += float(stats["vf_clipfrac"]) * micro_weight(mask, total_tokens, total_rows,
                                                                              "token-mean") * stat_scale
        sums["grad_norm"] = self.clip_and_step()
        return sums
