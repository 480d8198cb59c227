"""Training configs: TOML files, key=value overrides, clear errors, the recipes, the CLI."""

import json
from dataclasses import fields
from pathlib import Path

import pytest

from rlcore.evaluate import EvalConfig
from rlcore.train import cli
from rlcore.train.config import (
    ConfigError,
    RLConfig,
    SFTConfig,
    SynthConfig,
    build_config,
    config_schema,
    field_docs,
    load_config,
)

RECIPES = Path(__file__).resolve().parent.parent / "recipes" / "tictactoe_tiny"


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_a_toml_file_with_an_env_args_table_loads_into_the_dataclass(tmp_path):
    path = write(
        tmp_path,
        'env = "tictactoe"\nlr = 0.001\nmax_steps = 7\nresume_from = "ckpt"\n'
        "[env_args]\nmax_turns = 6\nnum_groups = 2\n",
    )
    cfg = load_config(RLConfig, path)
    assert (cfg.env, cfg.optimizer.lr, cfg.max_steps, cfg.resume_from) == (
        "tictactoe",
        0.001,
        7,
        "ckpt",
    )
    # A section's other settings keep the class's own defaults for it.
    assert cfg.optimizer.lr_schedule == RLConfig().optimizer.lr_schedule == "constant"
    assert cfg.env_args == {"max_turns": 6, "num_groups": 2}
    assert cfg.batch_size == RLConfig().batch_size  # untouched fields keep their defaults


def test_overrides_parse_as_json_when_they_can_and_reach_into_tables(tmp_path):
    path = write(tmp_path, "[optimizer]\nlr = 0.001\n[env_args]\nmax_turns = 6\n")
    cfg = load_config(
        RLConfig,
        path,
        [
            "optimizer.lr=3e-4",
            "temperature=0.5",
            "loss_type=cispo",
            "max_steps=12",
            "model=runs/sft/final",
            "scale_rewards=true",
            "resume_from=null",
            "env_args.num_groups=3",
        ],
    )
    assert cfg.optimizer.lr == 3e-4 and cfg.max_steps == 12 and cfg.scale_rewards is True
    # A section's setting named alone, and a renamed one, land where they live now.
    assert cfg.sampling.temperature == 0.5 and cfg.loss.type == "cispo"
    assert cfg.model == "runs/sft/final" and cfg.resume_from is None
    assert cfg.env_args == {"max_turns": 6, "num_groups": 3}
    synth = load_config(
        SynthConfig, None, ['exclude_outcomes=["loss", "unfinished"]', "max_kept=5"]
    )
    assert synth.exclude_outcomes == ["loss", "unfinished"] and synth.max_kept == 5
    assert load_config(SynthConfig, None, ["exclude_outcomes=loss,draw"]).exclude_outcomes == [
        "loss",
        "draw",
    ]


def test_an_unknown_key_is_named_with_its_source_and_the_valid_keys(tmp_path):
    path = write(tmp_path, "learning_rate = 0.1\n")
    with pytest.raises(ConfigError) as caught:
        load_config(SFTConfig, path)
    message = str(caught.value)
    assert "'learning_rate'" in message and str(path) in message
    assert "valid keys: model, dataset, output_dir" in message
    with pytest.raises(ConfigError, match=r"'optimizer.learning_rate'.*valid keys: optimizer.lr"):
        load_config(SFTConfig, None, ["optimizer.learning_rate=2"])
    with pytest.raises(ConfigError, match=r"'epoch'.*override 'epoch=2'"):
        load_config(SFTConfig, None, ["epoch=2"])


@pytest.mark.parametrize(
    ("override", "problem"),
    [
        ("lr=fast", r"optimizer.lr: expected a number, got 'fast' \(from override 'lr=fast'\)"),
        ("max_steps=2.5", "max_steps: expected an integer, got 2.5"),
        ("scale_rewards=yes", "scale_rewards: expected true or false, got 'yes'"),
        ("env_args=3", "env_args: expected a table"),
        ("loss_type=ppo", r"loss.type must be one of \['grpo', 'cispo', 'dr_grpo'\], got 'ppo'"),
        ("device=tpu", r"device must be one of \['auto', 'cpu', 'cuda'\], got 'tpu'"),
        ("batch_size=30", r"batch_size must be a multiple of rollouts_per_example \(8\), got 30"),
        ("lr=0", "optimizer.lr must be above 0.0, got 0.0"),
        ("adam_eps=0", "optimizer.adam_eps must be above 0.0, got 0.0"),
        ("entropy_coef=0.1", "entropy_coef: was removed after it lost its comparisons"),
        ("no_equals_sign", "'no_equals_sign' is not of the form key=value"),
    ],
)
def test_bad_values_are_refused_with_what_would_be_accepted(override, problem):
    with pytest.raises(ConfigError, match=problem):
        load_config(RLConfig, None, [override])


def test_adam_eps_reaches_the_optimizer():
    import torch

    from rlcore.train.common import build_optimizer

    model = torch.nn.Linear(2, 2)
    for cls in (RLConfig, SFTConfig):
        cfg = load_config(cls, None, ["adam_eps=0.0001"])
        optimizer, _ = build_optimizer(model, cfg.optimizer, 10)
        assert optimizer.param_groups[0]["eps"] == 0.0001
    optimizer, _ = build_optimizer(model, RLConfig().optimizer, 10)
    assert optimizer.param_groups[0]["eps"] == 1e-8


def test_contradicting_settings_are_refused():
    with pytest.raises(ConfigError, match="scale_rewards contradicts loss type dr_grpo"):
        load_config(RLConfig, None, ["loss_type=dr_grpo", "scale_rewards=true"])
    with pytest.raises(ConfigError, match=r"micro_batch_size must not exceed batch_size \(16\)"):
        load_config(SFTConfig, None, ["batch_size=16", "micro_batch_size=32"])


def test_a_missing_or_broken_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="nope.toml' does not exist"):
        load_config(RLConfig, tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_config(RLConfig, write(tmp_path, "lr = = 1\n"))


@pytest.mark.parametrize("cls", [SynthConfig, SFTConfig, RLConfig])
def test_every_field_is_documented_and_to_dict_round_trips(cls):
    docs = field_docs(cls)
    assert set(docs) == {f.name for f in fields(cls)}
    assert all(len(text) > 10 for text in docs.values())
    cfg = cls()
    assert build_config(cls, [("saved", json.loads(json.dumps(cfg.to_dict())))]) == cfg
    schema = {row["name"]: row for row in config_schema(cls)}
    assert all(row["help"] for row in schema.values())
    assert schema["seed"]["type"] == "int" and schema["seed"]["default"] == 0
    assert schema["output_dir"]["help"] == docs["output_dir"]


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("synth", SynthConfig),
        ("sft", SFTConfig),
        ("sft_cpu", SFTConfig),
        ("rl", RLConfig),
        ("rl_sound", RLConfig),
        ("rl_gpu", RLConfig),
        ("eval", EvalConfig),
    ],
)
def test_the_tictactoe_tiny_recipes_load(name, cls):
    cfg = load_config(cls, RECIPES / f"{name}.toml")
    # SFT starts from the tiny model with merges (round 63), which every RL recipe inherits;
    # the CPU variant's with 3 layers (docs/mastery.md, forty-ninth and fiftieth sessions).
    sft_model = {"sft": "tiny-bpe", "sft_cpu": "tiny-bpe-3l"}
    assert cfg.env == "tictactoe" if name not in sft_model else cfg.model == sft_model[name]
    if name in ("rl_sound", "rl_gpu"):
        assert cfg.turn_reward_weight > 0 and not cfg.loss.train_think
        # The result chosen among saves that all exist, on games of their own seed.
        assert cfg.select.keep > 1 and cfg.select.keep * cfg.save_every <= cfg.max_steps
        assert cfg.select.seed not in (cfg.seed, 10_000)  # nor the held-out games'
    if name == "rl_gpu":  # the large-batch regime, every game of a step in one engine batch
        assert cfg.sound_mass_weight > 0 and cfg.batch_size >= 256
        assert 0 < cfg.env_args["self_play"] < 1  # round 41: half the games against itself
        assert cfg.sampling.concurrency >= cfg.batch_size
    if name.startswith("rl"):  # rl_sound, the CPU variant, starts from sft_cpu's result
        sft = "sft_cpu" if name == "rl_sound" else "sft"
        assert cfg.model == load_config(SFTConfig, RECIPES / f"{sft}.toml").output_dir + "/final"
        assert cfg.env_args["num_groups"] > 1
        assert cfg.env_args["min_random_move_prob"] < cfg.env_args["max_random_move_prob"]
    if name in sft_model:
        assert cfg.dataset.startswith(load_config(SynthConfig, RECIPES / "synth.toml").output_dir)
    if name not in sft_model:  # the games SFT learns from and every later stage: one reply form
        synth = load_config(SynthConfig, RECIPES / "synth.toml")
        assert cfg.env_args["reasoning"] == synth.env_args["reasoning"] == "none"  # round 53


def test_the_cli_runs_synth_from_a_recipe_and_reports_bad_overrides(tmp_path, capsys):
    out = tmp_path / "synth"
    code = cli.main(
        "synth",
        ["--config", str(RECIPES / "synth.toml"), f"output_dir={out}", "max_kept=3"],
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert f"dataset: {out / 'dataset.jsonl'} (3 kept)" in printed
    assert json.loads((out / "config.json").read_text())["max_kept"] == 3
    assert sum(1 for _ in (out / "dataset.jsonl").open()) == 3

    assert cli.main("rl", ["loss_type=ppo"]) == cli.USAGE_ERROR
    assert "loss.type must be one of" in capsys.readouterr().err
    assert cli.main("sft", [f"dataset={tmp_path / 'none.jsonl'}", f"output_dir={tmp_path}"]) == 2
    assert "none.jsonl' does not exist" in capsys.readouterr().err


def test_every_number_a_config_takes_has_bounds():
    """BOUNDS is the one place a setting's range lives (form, API and CLI read it)."""
    import typing
    from dataclasses import fields

    from rlcore.evaluate import EvalConfig
    from rlcore.train.config import (
        BOUNDS,
        LossConfig,
        OptimizerConfig,
        RLConfig,
        SamplingConfig,
        SFTConfig,
        SynthConfig,
    )

    for cls in (
        EvalConfig,
        SynthConfig,
        SFTConfig,
        RLConfig,
        OptimizerConfig,
        SamplingConfig,
        LossConfig,
    ):
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            if hints[f.name] in (int, float, int | None, float | None):
                assert f.name in BOUNDS, f"{cls.__name__}.{f.name} has no bounds"


def test_out_of_range_and_non_finite_values_name_their_key():
    from rlcore.train.config import ConfigError, RLConfig, load_config

    for override, key in (("max_steps=1e308", "max_steps"), ("seed=-1", "seed"),
                          ("lr=1e999", "lr"), ("beta=1000", "beta")):  # fmt: skip
        with pytest.raises(ConfigError) as caught:
            load_config(RLConfig, overrides=[override])
        assert [k.rsplit(".", 1)[-1] for k in caught.value.errors] == [key]
    assert load_config(RLConfig, overrides=["max_steps=7"]).max_steps == 7


def test_an_env_number_without_bounds_is_refused_at_definition():
    from rlcore.envs.base import Param

    with pytest.raises(TypeError, match="needs both min and max"):
        Param("turns", int, 3, "turns", min=1)
    assert Param("turns", int, 3, "turns", min=1, max=9).max == 9


def test_a_config_stored_before_the_sections_still_loads():
    """Job rows and checkpoints written before settings moved into sections carry flat
    keys and the removed options at their "off" values: they load as they ran."""
    old = {"lr": 3e-4, "temperature": 0.7, "loss_type": "cispo", "beta": 0.1,
           "entropy_coef": 0.0, "decision_samples": 0, "kl_scope": "all",
           "turn_reward_agreed_credit": True,
           "curriculum_order": [], "max_steps": 5}  # fmt: skip
    cfg = build_config(RLConfig, [("old job", old)])
    assert (cfg.optimizer.lr, cfg.sampling.temperature, cfg.loss.type, cfg.loss.beta) == (
        3e-4,
        0.7,
        "cispo",
        0.1,
    )
    with pytest.raises(ConfigError) as caught:
        build_config(RLConfig, [("old job", old | {"decision_samples": 16})])
    assert list(caught.value.errors) == ["decision_samples"]
    # A section's removed setting too (select.exact, thirty-eighth session).
    cfg = build_config(RLConfig, [("old job", old | {"select": {"keep": 0, "exact": False}})])
    assert cfg.select.keep == 0
    with pytest.raises(ConfigError) as caught:
        build_config(RLConfig, [("old job", old | {"select": {"exact": True}})])
    assert list(caught.value.errors) == ["select.exact"]


def test_layers_merge_sections_key_by_key_and_leave_the_callers_dicts_alone():
    recipe = {"optimizer": {"lr": 1e-4, "warmup_steps": 5}, "env_args": {"max_turns": 6}}
    cfg = build_config(RLConfig, [("recipe", recipe), ("form", {"optimizer.lr": 3e-4}),
                                  ("env", {"env_args": {"num_groups": 2}})])  # fmt: skip
    assert (cfg.optimizer.lr, cfg.optimizer.warmup_steps) == (3e-4, 5)
    assert cfg.env_args == {"max_turns": 6, "num_groups": 2}
    assert recipe == {"optimizer": {"lr": 1e-4, "warmup_steps": 5}, "env_args": {"max_turns": 6}}
