"""Typed, validated configuration: the first layer; nothing here imports the layers above."""

from verl_hpc.config.dataflow import Dataflow
from verl_hpc.config.errors import ConfigError, FieldError
from verl_hpc.config.loader import apply_overrides, dump_config, load_config, load_resource_config, read_yaml
from verl_hpc.config.resources import ROLE_NAMES, ResourceConfig, RoleResources, VllmArgs
from verl_hpc.config.schema import (
    AlgorithmConfig,
    CheckpointConfig,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    RewardConfig,
    RunConfig,
    SamplingConfig,
    SlurmConfig,
    TrainerConfig,
)

__all__ = [
    "ROLE_NAMES", "AlgorithmConfig", "CheckpointConfig", "ConfigError", "DataConfig", "Dataflow", "FieldError",
    "LoggingConfig", "ModelConfig", "ResourceConfig", "RewardConfig", "RoleResources", "RunConfig",
    "SamplingConfig", "SlurmConfig", "TrainerConfig", "VllmArgs", "apply_overrides", "dump_config",
    "load_config", "load_resource_config", "read_yaml",
]
