"""The shipped tic-tac-toe player, `tiny-master`: every place that takes a model name finds
its directory, it loads as a Hugging Face checkpoint, and it plays like the trained player
its model card describes (the untrained tiny model loses every game)."""

import json
from pathlib import Path

import torch

from rlcore.evaluate import EvalConfig, run_eval
from rlcore.events import RecordingSink
from rlcore.policy import load_policy
from rlcore.policy.tiny import BUILTIN_MODELS, TINY_MASTER_DIR, builtin_model_path
from rlcore.train.common import load_model_and_tokenizer, model_path
from workers.engines import model_path as server_model_path


def test_the_name_stands_for_the_shipped_directory_everywhere():
    assert "tiny-master" in BUILTIN_MODELS
    shipped = str(TINY_MASTER_DIR)
    assert builtin_model_path("tiny-master") == model_path("tiny-master") == shipped
    assert server_model_path("tiny-master") == shipped
    for name in ("config.json", "model.safetensors", "tokenizer.json", "README.md"):
        assert (TINY_MASTER_DIR / name).is_file(), name
    assert builtin_model_path("runs/x/final") == "runs/x/final"  # other names unchanged


def test_the_model_card_names_the_command_and_the_figures():
    card = (TINY_MASTER_DIR / "README.md").read_text()
    assert "bench/tictactoe_mastery.py" in card and "python -m rlcore eval" in card
    results = Path("bench/results/tictactoe_mastery_gpu_r71.json")
    shipped = json.loads(results.read_text())["shipped"]
    assert shipped["path"] == "rlcore/data/tiny-master" and shipped["run"] in card


def test_it_loads_for_training_and_for_play():
    network, tokenizer = load_model_and_tokenizer("tiny-master", torch.device("cpu"))
    assert network.config.model_type == "qwen2" and tokenizer.chat_template
    engine = load_policy("tiny-master", device="cpu")
    assert engine.name == "tiny-master"


def test_it_plays_the_random_opponent_like_a_trained_player(tmp_path):
    config = EvalConfig(
        env="tictactoe",
        model="tiny-master",
        env_args={
            "min_random_move_prob": 1.0,
            "max_random_move_prob": 1.0,
            "max_turns": 6,
            "reasoning": "none",
        },
        num_examples=40,
        max_tokens=64,
        temperature=0.0,
        concurrency=40,
        seed=10_000,
        out_dir=str(tmp_path),
        device="cpu",
    )
    summary = run_eval(config, RecordingSink()).summary
    # Over 1,000 such games it won 95.2 % and replied well formed every time (its card).
    assert summary["functions"]["format"]["mean"] == 1.0
    assert summary["outcomes"]["win"]["rate"] >= 0.4, summary["outcomes"]
    assert summary["env_metrics"]["tictactoe/invalid_move_rate"] < 0.1
    # It was trained on replies with an empty think block, and writes them (round 53 on).
    assert summary["env_metrics"]["tictactoe/think_correct_rate"] == 1.0
