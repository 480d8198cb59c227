"""Training: SFT data from a teacher (`synth`), supervised fine-tuning (`sft`) and on-policy
RL of the GRPO family (`grpo`), configured by the dataclasses in `config`.

Entry points: `synth.run_synth`, `sft.run_sft`, `grpo.run_rl`, each taking its config and
an event sink. Importing this package does not import torch; the trainers do.
"""

from rlcore.train.config import ConfigError, RLConfig, SFTConfig, SynthConfig, load_config

__all__ = ["ConfigError", "RLConfig", "SFTConfig", "SynthConfig", "load_config"]
