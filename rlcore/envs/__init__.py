"""Environments with verifiable rewards; see base.py for the classes and registry.py for names."""

from rlcore.envs.base import (
    Environment,
    Fact,
    MultiTurnEnv,
    Param,
    ParamError,
    SingleTurnEnv,
    ToolEnv,
)
from rlcore.envs.registry import get_env_class, list_environments, load_environment

__all__ = [
    "Environment",
    "Fact",
    "MultiTurnEnv",
    "Param",
    "ParamError",
    "SingleTurnEnv",
    "ToolEnv",
    "get_env_class",
    "list_environments",
    "load_environment",
]
