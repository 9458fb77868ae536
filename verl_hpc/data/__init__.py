"""Data: prompt datasets, built-in tasks, and the Arrow rollout batch every stage shares."""

from verl_hpc.data.prompts import PromptDataset, PromptSampler, read_table
from verl_hpc.data.rollout_batch import SCHEMA, RolloutBatch, SchemaError

__all__ = ["SCHEMA", "PromptDataset", "PromptSampler", "RolloutBatch", "SchemaError", "read_table"]
