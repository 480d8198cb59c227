"""Policies: one interface (`Policy.generate`), several backends, and `load_policy` that
turns a CLI/web model string into the right one.

MODEL strings: `tiny` (the built-in tiny model, built on first use; `tiny-bpe` the same
with a tokenizer of merges learned on tic-tac-toe games, `tiny-bpe-3l` that one with 3
layers), `tiny-master` (the tic-tac-toe player the lab ships, rlcore/data/tiny-master), a
checkpoint directory or hub id (local transformers engine), an environment built-in
(`oracle`, `random`, `constant`), or any served model name when `base_url` is given (OpenAI
client).
"""

from __future__ import annotations

from rlcore.policy.base import ConstantPolicy, Policy, PolicyError

__all__ = ["ConstantPolicy", "Policy", "PolicyError", "load_policy"]


def load_policy(
    model: str,
    *,
    env=None,
    base_url: str | None = None,
    api_key_env: str = "OPENAI_API_KEY",
    device: str = "auto",
    concurrency: int = 32,
    timeout: float = 120.0,
    max_retries: int = 3,
) -> Policy:
    """The policy named by `model`; PolicyError says what was wrong and what is accepted."""
    if base_url:
        from rlcore.policy.openai_client import OpenAIPolicy

        return OpenAIPolicy(
            base_url=base_url,
            model=model,
            api_key_env=api_key_env,
            timeout=timeout,
            max_retries=max_retries,
            concurrency=concurrency,
        )
    if env is not None and model in env.builtin_policies():
        return env.builtin_policies()[model]()
    from rlcore.policy.local import LocalEngine
    from rlcore.policy.tiny import BUILTIN_MODELS, builtin_model_path

    if model in BUILTIN_MODELS:
        return LocalEngine(builtin_model_path(model), device=device, name=model)
    return LocalEngine(model, device=device)
