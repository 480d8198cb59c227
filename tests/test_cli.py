"""`python -m rlcore`: eval end to end (built-in players, the tiny model, a served endpoint),
the env listing, delegation to serve and the trainers, and one-line errors with exit 2."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from rlcore.cli import default_out_dir, main, model_slug

REPO = Path(__file__).resolve().parents[1]
ALWAYS_RANDOM_OPPONENT = '{"min_random_move_prob": 1, "max_random_move_prob": 1}'


def run_cli(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "rlcore", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---------------------------------------------------------------------------------------
# Errors: exit 2, one line naming the bad value and what is accepted


def test_bad_json_in_env_args_is_one_line_naming_it(capsys):
    assert main(["eval", "tictactoe", "--model", "oracle", "-a", "{max_turns: 3"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "-a/--env-args is not valid JSON" in line and "{max_turns: 3" in line
    assert "accepted: a JSON object" in line


def test_env_args_that_are_not_an_object_are_refused(capsys):
    assert main(["eval", "tictactoe", "--model", "oracle", "-a", "[6]"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "must be a JSON object" in line and "[6]" in line


def test_an_unknown_env_lists_the_available_ones(capsys):
    assert main(["eval", "checkers", "--model", "oracle"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "unknown environment 'checkers'" in line and "tictactoe" in line


def test_a_bad_parameter_value_names_the_field_and_the_range(capsys, tmp_path):
    out = tmp_path / "never"
    code = main(
        ["eval", "tictactoe", "--model", "oracle", "-a", '{"max_turns": 99}', "--out", str(out)]
    )
    assert code == 2
    line = one_error_line(capsys.readouterr().err)
    assert "max_turns: must be at most 30, got 99" in line
    assert not out.exists()


def test_an_unknown_parameter_lists_the_accepted_ones(capsys):
    assert main(["eval", "tictactoe", "--model", "oracle", "-a", '{"board_size": 4}']) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "board_size: unknown parameter; accepted:" in line and "min_random_move_prob" in line


def test_min_above_max_is_caught_by_the_env(capsys):
    args = '{"min_random_move_prob": 0.9, "max_random_move_prob": 0.1}'
    assert main(["eval", "tictactoe", "--model", "oracle", "-a", args]) == 2
    assert "min_random_move_prob" in one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize(
    ("flag", "value", "expected"),
    [
        ("-n", "0", "expected a value >= 1, got '0'"),
        ("-T", "-1", "expected a value >= 0.0, got '-1'"),
        ("-c", "many", "expected an integer, got 'many'"),
        ("--top-p", "0", "expected a value > 0.0 and <= 1.0, got '0'"),
    ],
)
def test_out_of_range_numbers_are_usage_errors(capsys, flag, value, expected):
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "tictactoe", "--model", "oracle", flag, value])
    assert exit_info.value.code == 2
    assert expected in one_error_line(capsys.readouterr().err)


def test_a_missing_model_path_is_one_line(capsys, tmp_path):
    missing = tmp_path / "no-such-checkpoint"
    assert main(["eval", "tictactoe", "--model", str(missing), "-n", "1"]) == 2
    assert str(missing) in one_error_line(capsys.readouterr().err)


def test_an_unreachable_base_url_is_one_line(capsys, tmp_path):
    url = f"http://127.0.0.1:{free_port()}/v1"
    code = main(
        [
            "eval",
            "tictactoe",
            "--model",
            "tiny",
            "--base-url",
            url,
            "-n",
            "2",
            "--out",
            str(tmp_path / "x"),
        ]
    )
    assert code == 2
    line = one_error_line(capsys.readouterr().err)
    assert url in line and "'tiny'" in line and "Connection error" in line
    assert not (tmp_path / "x").exists()


def test_no_command_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    err = capsys.readouterr().err
    assert "eval" in err and "envs" in err and "serve" in err and "sft" in err


# ---------------------------------------------------------------------------------------
# Listing and delegation


def test_envs_lists_every_env_with_typed_params(capsys):
    assert main(["envs"]) == 0
    out = capsys.readouterr().out
    for name in ("tictactoe", "reverse_text", "double_check", "calculator", "math"):
        assert f"\n{name}: " in f"\n{out}"
    line = next(line for line in out.splitlines() if "min_random_move_prob" in line)
    assert "float" in line and "0.0" in line and "0..1" in line
    assert "X|O|random" in out


def test_serve_is_handed_its_own_arguments(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--served-name" in out and "--port" in out


def test_training_commands_are_handed_their_kind_and_arguments(capsys, tmp_path):
    missing = tmp_path / "missing.toml"
    assert main(["sft", "--config", str(missing)]) == 2
    err = capsys.readouterr().err
    assert "sft" in err and str(missing) in err
    with pytest.raises(SystemExit) as exit_info:
        main(["synth", "--help"])
    assert exit_info.value.code == 0
    assert "synth" in capsys.readouterr().out


def test_model_slugs_and_default_out_dirs_are_file_name_safe(tmp_path):
    assert model_slug("oracle") == "oracle"
    assert model_slug("/data/runs/sft/step 100/") == "data-runs-sft-step-100"
    assert model_slug("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen-Qwen2.5-0.5B-Instruct"
    first = default_out_dir("tictactoe", "a/b", root=tmp_path)
    assert first.parent == tmp_path and first.name.startswith("tictactoe--a-b--")
    first.mkdir()
    assert default_out_dir("tictactoe", "a/b", root=tmp_path) != first


# ---------------------------------------------------------------------------------------
# End to end


def test_eval_oracle_with_baselines_end_to_end(tmp_path):
    result = run_cli(
        "eval", "tictactoe", "--model", "oracle", "-n", "200", "-a", ALWAYS_RANDOM_OPPONENT,
        "--baselines", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "eval tictactoe | model oracle | 200 rollouts | 0 errors" in out
    assert "95% interval" in out and "reward histogram" in out and "#" in out
    assert "starter=model" in out and "starter=opponent" in out
    assert "tictactoe/invalid_move_rate" in out
    assert "baselines (same examples, same verifier)" in out
    assert "verifier may be exploitable" not in out
    assert "eval:" in result.stderr and "200/200" in result.stderr and "it/s" in result.stderr

    runs = list((tmp_path / "runs" / "eval").iterdir())
    assert len(runs) == 1 and runs[0].name.startswith("tictactoe--oracle--")
    assert f"results: runs/eval/{runs[0].name}/results.jsonl" in out
    metadata = json.loads((runs[0] / "metadata.json").read_text())
    outcomes = metadata["summary"]["outcomes"]
    assert outcomes["loss"]["count"] == 0
    assert 0.87 <= outcomes["win"]["rate"] <= 0.99
    assert metadata["env_args"]["min_random_move_prob"] == 1.0
    assert metadata["env_args"]["max_turns"] == 10  # defaults resolved
    assert set(metadata["baselines"]) == {"random", "oracle", "constant"}
    assert metadata["baselines"]["random"]["outcomes"]["loss"]["count"] > 0
    rows = (runs[0] / "results.jsonl").read_text().splitlines()
    assert len(rows) == 200
    assert json.loads(rows[0])["state"]["board"]


def test_eval_random_against_a_perfect_opponent_loses_often(tmp_path):
    perfect = '{"min_random_move_prob": 0, "max_random_move_prob": 0}'
    out = tmp_path / "random"
    result = run_cli(
        "eval", "tictactoe", "--model", "random", "-n", "50", "-a", perfect, "--out", str(out),
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "metadata.json").read_text())["summary"]
    assert summary["outcomes"]["loss"]["rate"] > 0.5
    assert summary["outcomes"]["win"]["count"] == 0


def test_eval_of_the_local_tiny_model(capsys, tmp_path):
    out = tmp_path / "tiny"
    code = main(
        ["eval", "tictactoe", "--model", "tiny", "-n", "3", "-t", "16", "-a", '{"max_turns": 2}',
         "--device", "cpu", "--out", str(out)]
    )  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "eval tictactoe | model tiny | 3 rollouts | 0 errors" in captured.out
    assert "eval: 100%" in captured.err and "3/3" in captured.err
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    for row in rows:
        assert 1 <= row["num_turns"] <= 2
        assert 0 < row["tokens"]["completion"] <= 16 * row["num_turns"]
        assert row["tokens"]["prompt"] > 0
        assert set(row["rewards"]) == {"outcome", "format", "invalid_move"}


def test_eval_through_a_served_tiny_model(tmp_path):
    port = free_port()
    env = os.environ | {"PYTHONPATH": str(REPO)}
    server = subprocess.Popen(
        [sys.executable, "-m", "rlcore.serve", "tiny", "--port", str(port)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while True:
            assert server.poll() is None, f"server exited: {server.stderr.read()}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2):
                    break
            except OSError:
                assert time.monotonic() < deadline, "server never answered /v1/models"
                time.sleep(0.5)
        out = tmp_path / "served"
        result = run_cli(
            "eval", "tictactoe", "--model", "tiny", "--base-url", f"http://127.0.0.1:{port}/v1",
            "-n", "4", "-t", "32", "--out", str(out), cwd=tmp_path,
        )  # fmt: skip
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert result.returncode == 0, result.stderr
    assert "eval tictactoe | model tiny | 4 rollouts" in result.stdout
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 4
    assert all(row["error"] is None for row in rows)
    assert all(row["tokens"]["completion"] > 0 for row in rows)
    assert all(row["messages"][row["prompt_len"]]["role"] == "assistant" for row in rows)
    metadata = json.loads((out / "metadata.json").read_text())
    assert metadata["config"]["base_url"] == f"http://127.0.0.1:{port}/v1"
    assert metadata["sampling"]["max_tokens"] == 32
