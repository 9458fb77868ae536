"""Typed, validated configuration: what every layer above reads; it imports only algo, data,
models (registries and schemas its checks consult), metrics (its sinks' settings) and utils."""

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
from verl_hpc.config.validate import cross_check  # registers the cross-section checks on RunConfig

__all__ = [
    "ROLE_NAMES", "AlgorithmConfig", "CheckpointConfig", "ConfigError", "DataConfig", "Dataflow", "FieldError",
    "LoggingConfig", "ModelConfig", "ResourceConfig", "RewardConfig", "RoleResources", "RunConfig",
    "SamplingConfig", "SlurmConfig", "TrainerConfig", "VllmArgs", "apply_overrides", "dump_config",
    "cross_check", "load_config", "load_resource_config", "read_yaml",
]
