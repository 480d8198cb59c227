"""Environment registry: name -> class. A new environment is one file plus one line here."""

from __future__ import annotations

import importlib

from rlcore.envs.base import EnvInfo, Environment

ENVIRONMENTS: dict[str, str] = {
    "tictactoe": "rlcore.envs.tictactoe:TicTacToeEnv",
    "reverse_text": "rlcore.envs.reverse_text:ReverseTextEnv",
    "double_check": "rlcore.envs.double_check:DoubleCheckEnv",
    "calculator": "rlcore.envs.calculator:CalculatorEnv",
    "math": "rlcore.envs.math_env:MathEnv",
    "code": "rlcore.envs.code_env:CodeEnv",
    "writing": "rlcore.envs.writing:WritingEnv",
    "browser": "rlcore.envs.browser:BrowserEnv",
}


def get_env_class(name: str) -> type[Environment]:
    if name not in ENVIRONMENTS:
        raise KeyError(f"unknown environment {name!r}; available: {', '.join(ENVIRONMENTS)}")
    module_name, class_name = ENVIRONMENTS[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def load_environment(name: str, **params) -> Environment:
    """The environment `name` configured with `params` (validated; ParamError if bad)."""
    return get_env_class(name)(**params)


def list_environments() -> list[EnvInfo]:
    infos = []
    for name in ENVIRONMENTS:
        cls = get_env_class(name)
        infos.append(EnvInfo(name=name, cls=cls, description=cls.description, params=cls.schema()))
    return infos
