"""The tic-tac-toe environment end to end: parameters, seeded examples and stratified
opponent strength, full games through `run_rollouts`, invalid-move handling and its capped
penalty, the reward functions, and the Play page's `PlaySession`."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlcore.envs import ParamError, load_environment
from rlcore.envs.tictactoe import (
    TicTacToeEnv,
    format_reward,
    is_well_formatted,
    outcome_label,
)
from rlcore.envs.tictactoe_game import (
    empty_cells,
    game_value,
    minimax_best_moves,
    missed_tactic,
    parse_move,
    render_board,
    sound_moves,
    think_text,
    winner,
    winning_cells,
)
from rlcore.envs.tictactoe_play import PlaySession
from rlcore.envs.tictactoe_players import OraclePolicy, RandomValidPolicy
from rlcore.policy import load_policy
from rlcore.policy.base import ConstantPolicy, Policy, PolicyError
from rlcore.rollout import run_rollouts
from rlcore.types import Generation, SamplingParams

SAMPLING = SamplingParams()


class ScriptedPolicy(Policy):
    """Replies with the given texts in order, then hands over to `then` (a real player)."""

    name = "scripted"

    def __init__(self, replies: list[str], then: Policy | None = None):
        self.replies = list(replies)
        self.then = then or OraclePolicy()

    async def generate(self, messages, sampling, *, tools=None, state=None) -> Generation:
        if self.replies:
            return Generation(text=self.replies.pop(0))
        return await self.then.generate(messages, sampling, tools=tools, state=state)


def first_example(env: TicTacToeEnv, **info) -> object:
    """The first example (seed 0) whose info matches `info`."""
    for example in env.examples(64, seed=0):
        if all(example.info[key] == value for key, value in info.items()):
            return example
    raise AssertionError(f"no example with {info} among the first 64")


def comparable(rollout) -> dict:
    row = rollout.to_dict()
    row.pop("seconds")
    return row


async def play_all(env, policy, n, *, seed=0, rollouts_per_example=1):
    return await run_rollouts(
        env,
        policy,
        env.examples(n, seed=seed),
        sampling=SAMPLING,
        rollouts_per_example=rollouts_per_example,
    )


# ---------------------------------------------------------------------------------------
# Parameters


def test_registry_builds_the_env_with_defaults():
    env = load_environment("tictactoe")
    assert isinstance(env, TicTacToeEnv)
    assert env.config == {
        "min_random_move_prob": 0.0,
        "max_random_move_prob": 1.0,
        "num_groups": 4,
        "model_mark": "random",
        "max_turns": 10,
        "opening_moves": 0,
        "draw_reward": 0.5,
        "loss_reward": 0.0,
        "reasoning": "empty",
        "think_reward": 0.0,
        "self_play": 0.0,
        "win_chances": False,
        "invalid_move_penalty": 0.1,
        "invalid_penalty_cap": 0.5,
    }
    assert env.num_groups == 4
    assert env.rubric.weights == {"outcome": 1.0, "format": 0.2, "invalid_move": 1.0}
    schema = {row["name"]: row for row in TicTacToeEnv.schema()}
    assert schema["model_mark"]["choices"] == ["X", "O", "random"]
    assert (schema["num_groups"]["min"], schema["num_groups"]["max"]) == (1, 20)
    assert all(row["help"] for row in schema.values())


def test_min_above_max_is_an_error_naming_both():
    with pytest.raises(ParamError) as error:
        TicTacToeEnv(min_random_move_prob=0.8, max_random_move_prob=0.3)
    assert set(error.value.errors) == {"min_random_move_prob"}
    assert "0.3" in error.value.errors["min_random_move_prob"]
    assert "0.8" in error.value.errors["min_random_move_prob"]


def test_a_loss_may_not_pay_more_than_a_draw():
    with pytest.raises(ParamError) as error:
        TicTacToeEnv(draw_reward=0.0, loss_reward=0.25)
    assert set(error.value.errors) == {"loss_reward"}
    assert "draw_reward (0.0)" in error.value.errors["loss_reward"]


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("loss_reward", -1.5, "at least -1.0"),
        ("draw_reward", 2, "at most 1.0"),
        ("num_groups", 0, "at least 1"),
        ("num_groups", 21, "at most 20"),
        ("max_turns", 31, "at most 30"),
        ("min_random_move_prob", -0.1, "at least 0.0"),
        ("max_random_move_prob", 1.5, "at most 1.0"),
        ("model_mark", "Z", "one of ['X', 'O', 'random']"),
        ("num_groups", "many", "expected an integer"),
    ],
)
def test_out_of_range_params_are_errors(name, value, message):
    with pytest.raises(ParamError) as error:
        TicTacToeEnv(**{name: value})
    assert message in error.value.errors[name]


def test_unknown_param_is_an_error_listing_the_accepted_ones():
    with pytest.raises(ParamError) as error:
        TicTacToeEnv(board_size=4)
    assert "max_random_move_prob" in error.value.errors["board_size"]


# ---------------------------------------------------------------------------------------
# Examples


def test_examples_are_fixed_by_seed_and_index():
    env = TicTacToeEnv()
    assert [e.to_dict() for e in env.examples(20, seed=3)] == [
        e.to_dict() for e in env.examples(20, seed=3)
    ]
    assert [e.seed for e in env.examples(20, seed=3)] != [e.seed for e in env.examples(20, seed=4)]
    infos = [e.info for e in env.examples(200, seed=3)]
    assert Counter(i["model_starts"] for i in infos).keys() == {True, False}
    assert Counter(i["model_mark"] for i in infos).keys() == {"X", "O"}


def test_num_groups_puts_each_example_in_its_opponent_strength_bin():
    env = TicTacToeEnv(min_random_move_prob=0.2, max_random_move_prob=0.6, num_groups=4)
    examples = env.examples(400, seed=1)
    for index, example in enumerate(examples):
        group = index % 4
        assert example.group == group
        low, high = 0.2 + 0.1 * group, 0.2 + 0.1 * (group + 1)
        assert low - 1e-12 <= example.info["random_move_prob"] <= high + 1e-12
    # Inside a bin the strength is spread out, not pinned to one value.
    first_bin = [e.info["random_move_prob"] for e in examples if e.group == 0]
    assert max(first_bin) - min(first_bin) > 0.08


def test_fixed_mark_does_not_change_who_starts_or_the_strength():
    free, fixed = TicTacToeEnv(), TicTacToeEnv(model_mark="O")
    for a, b in zip(free.examples(30, seed=2), fixed.examples(30, seed=2), strict=True):
        assert b.info["model_mark"] == "O"
        assert a.info["model_starts"] == b.info["model_starts"]
        assert a.info["random_move_prob"] == b.info["random_move_prob"]


def test_prompts_are_short_and_show_the_opponents_opening():
    env = TicTacToeEnv(model_mark="X")
    starts = first_example(env, model_starts=True)
    assert starts.prompt == [
        {
            "role": "system",
            "content": "You play tic-tac-toe as X. Empty cells show their number 0-8. "
            "Reply with <think>brief reasoning</think> then <move>N</move>.",
        },
        {"role": "user", "content": "012\n345\n678\nYour move."},
    ]
    second = first_example(env, model_starts=False)
    cell = second.info["opponent_first_move"]
    board = ["."] * 9
    board[cell] = "O"
    assert (
        second.prompt[1]["content"] == f"Opponent played {cell}.\n{render_board(board)}\nYour move."
    )


def test_opening_moves_start_examples_mid_game_on_live_boards_the_state_replays():
    env = TicTacToeEnv(opening_moves=3)
    examples = list(env.examples(200, seed=4))
    lengths = Counter(len(example.info["opening"]) for example in examples)
    # 0 to 3 random rounds of (model move, opponent reply), each drawn in turn.
    assert set(lengths) <= {0, 2, 4, 6} and len(lengths) == 4
    for example in examples:
        state = env.setup_state(example)
        board = "".join(state["board"])
        opening = [move for move in state["moves"] if move.get("opening")]
        assert [move["cell"] for move in opening] == example.info["opening"]
        assert [move["player"] for move in opening] == ["model", "opponent"] * (len(opening) // 2)
        assert not env.is_completed([], state) and board.count(".") >= 2
        # The prompt shows the board the model moves on, after the opponent's last move.
        assert render_board(board) in example.prompt[-1]["content"]
        if opening:
            assert example.prompt[-1]["content"].startswith(
                f"Opponent played {opening[-1]['cell']}."
            )
    # Without openings the examples are exactly the full games they always were.
    plain = TicTacToeEnv()
    assert [e.prompt for e in plain.examples(20, seed=4)] == [
        e.prompt for e in TicTacToeEnv(opening_moves=0).examples(20, seed=4)
    ]
    assert all(e.info["opening"] == [] for e in plain.examples(20, seed=4))


async def test_the_decision_key_names_the_board_and_the_turns_used_not_the_history():
    env = TicTacToeEnv(model_mark="X", max_random_move_prob=0.0)
    example = first_example(env, model_starts=True)
    state = env.setup_state(example)
    assert env.decision_key(example.prompt, state) == "........./0"
    # Two different thoughts, the same move: the same position follows.
    keys = []
    for thought in ("corner", "take the corner, it is strong"):
        state = env.setup_state(example)
        messages = [
            *example.prompt,
            {"role": "assistant", "content": f"<think>{thought}</think><move>0</move>"},
        ]
        messages += env.env_response(messages, state)
        keys.append(env.decision_key(messages, state))
    assert keys[0] == keys[1] and keys[0].startswith("X") and keys[0].endswith("/1")
    # An invalid reply leaves the board but uses a turn: a different position.
    state = env.setup_state(example)
    messages = [*example.prompt, {"role": "assistant", "content": "<move>9</move>"}]
    env.env_response(messages, state)
    assert env.decision_key(messages, state) == "........./1"


async def test_games_from_an_opening_finish_and_count_only_the_models_own_turns():
    env = TicTacToeEnv(opening_moves=4, max_random_move_prob=0.0)
    examples = list(env.examples(40, seed=0))
    rollouts = await play_all(env, OraclePolicy(), 40)
    for example, rollout in zip(examples, rollouts, strict=True):
        start = env.setup_state(example)
        # Perfect play against perfect play ends in the start position's game value.
        value = game_value(start["board"], start["model_mark"])
        assert rollout.outcome == {1: "win", 0: "draw", -1: "loss"}[value]
        own = [m for m in rollout.state["moves"] if m["player"] == "model" and not m.get("opening")]
        assert rollout.state["model_turns"] == len(own) >= 1


# ---------------------------------------------------------------------------------------
# Games


async def test_same_example_seed_gives_the_same_games():
    env = TicTacToeEnv(min_random_move_prob=0.0, max_random_move_prob=1.0)
    first = await play_all(env, RandomValidPolicy(seed=7), 24, seed=5, rollouts_per_example=2)
    second = await play_all(env, RandomValidPolicy(seed=7), 24, seed=5, rollouts_per_example=2)
    assert [comparable(r) for r in first] == [comparable(r) for r in second]
    other_seed = await play_all(env, RandomValidPolicy(seed=8), 24, seed=5)
    assert [r.state["moves"] for r in other_seed] != [r.state["moves"] for r in first[::2]]


async def test_opponent_strength_is_fixed_across_an_examples_rollouts():
    env = TicTacToeEnv(min_random_move_prob=0.1, max_random_move_prob=0.9)
    examples = env.examples(10, seed=2)
    rollouts = await run_rollouts(
        env, RandomValidPolicy(), examples, sampling=SAMPLING, rollouts_per_example=3
    )
    for example, index in zip(examples, range(0, 30, 3), strict=True):
        group = rollouts[index : index + 3]
        assert {r.example_id for r in group} == {example.id}
        assert {r.state["random_move_prob"] for r in group} == {example.info["random_move_prob"]}


async def test_two_rollouts_reaching_the_same_board_meet_the_same_reply():
    env = TicTacToeEnv(min_random_move_prob=0.3, max_random_move_prob=0.7)
    replies: dict[tuple[int, str], int] = {}
    shared = 0
    for policy_seed in range(6):
        for rollout in await play_all(env, RandomValidPolicy(seed=policy_seed), 30, seed=9):
            board = ["."] * 9
            for move in rollout.state["moves"]:
                if move["player"] == "opponent":
                    key = (rollout.seed, "".join(board))
                    if key in replies:
                        shared += 1
                        assert replies[key] == move["cell"], key
                    replies[key] = move["cell"]
                board[move["cell"]] = move["mark"]
    assert shared > 30


async def test_oracle_draws_every_game_against_a_perfect_opponent():
    env = TicTacToeEnv(min_random_move_prob=0.0, max_random_move_prob=0.0)
    rollouts = await play_all(env, OraclePolicy(), 100)
    assert Counter(r.outcome for r in rollouts) == {"draw": 100}
    assert all(r.rewards == {"outcome": 0.5, "format": 1.0, "invalid_move": 0.0} for r in rollouts)
    assert all(r.reward == pytest.approx(0.7) for r in rollouts)


async def test_oracle_beats_a_random_opponent_and_never_loses():
    env = TicTacToeEnv(min_random_move_prob=1.0, max_random_move_prob=1.0)
    rollouts = await play_all(env, OraclePolicy(), 200)
    outcomes = Counter(r.outcome for r in rollouts)
    assert outcomes["loss"] == 0
    assert 0.87 <= outcomes["win"] / 200 <= 0.99
    assert all(r.error is None and not r.truncated for r in rollouts)


async def test_random_player_loses_most_games_against_a_perfect_opponent():
    env = TicTacToeEnv(min_random_move_prob=0.0, max_random_move_prob=0.0)
    rollouts = await play_all(env, RandomValidPolicy(), 100)
    outcomes = Counter(r.outcome for r in rollouts)
    assert outcomes["win"] == 0
    assert outcomes["loss"] >= 70


def test_sound_moves_are_those_that_keep_the_game_theoretic_value():
    # From the empty board every move draws.
    assert sound_moves("." * 9, "X") == list(range(9))
    # After a corner opening only the centre holds the draw.
    assert sound_moves("X........", "O") == [4]
    # O wins at once with 5, and also by 2 (a double threat X cannot stop): both are
    # sound, though minimax's best moves are only the fastest win.
    assert sound_moves("XX.OO...X", "O") == [2, 5]
    assert minimax_best_moves("XX.OO...X", "O") == [5]
    # O, to move, is lost whatever it does (X forks next), so no move gives anything away.
    assert game_value("XO..X....", "O") == -1
    assert sound_moves("XO..X....", "O") == empty_cells("XO..X....")
    with pytest.raises(ValueError, match="is over"):
        sound_moves("XXXOO....", "O")


async def test_every_reply_is_recorded_sound_unsound_or_invalid_and_rewarded_per_turn():
    env = TicTacToeEnv(model_mark="X", max_turns=30)
    example = first_example(env, model_starts=True)
    # An invalid reply, the centre (sound on an empty board), then the oracle: all sound.
    policy = ScriptedPolicy(["<move>9</move>", "<think>c</think><move>4</move>"])
    rollout = await env.rollout(policy, example, SAMPLING)
    record = rollout.state["move_sound"]
    assert len(record) == rollout.num_turns >= 3
    assert record[0] is None and all(record[1:])
    assert env.turn_rewards(rollout) == [0.0] + [1.0] * (len(record) - 1)
    metrics = env.rollout_metrics(rollout)
    assert metrics["sound_move_rate"] == pytest.approx((len(record) - 1) / len(record))


async def test_the_sound_move_record_matches_a_replay_of_random_games():
    env = TicTacToeEnv(min_random_move_prob=0.0, max_random_move_prob=0.0)
    rollouts = await play_all(env, RandomValidPolicy(), 60)
    seen = Counter()
    for rollout in rollouts:
        board = ["."] * 9
        replayed = []
        for move in rollout.state["moves"]:
            if move["player"] == "model":
                replayed.append(move["cell"] in sound_moves(board, move["mark"]))
            board[move["cell"]] = move["mark"]
        assert rollout.state["move_sound"] == replayed
        seen.update(replayed)
    # A random player against a perfect one makes both kinds of move.
    assert seen[True] > 0 and seen[False] > 0


def test_winning_cells_are_the_lines_one_move_from_done():
    assert winning_cells("." * 9, "X") == []
    # X on 0, 1 and 4 completes the top row at 2, the middle column at 7, a diagonal at 8.
    board = "XX..X...."
    assert winning_cells(board, "X") == [2, 7, 8]
    assert winning_cells(board, "O") == []
    # A line already blocked by the other mark threatens nothing.
    assert winning_cells("XXO......", "X") == []
    # O on 2, 3 and 5: the middle row at 4, the right column at 8.
    assert winning_cells("XXOO.O...", "O") == [4, 8]
    with pytest.raises(ValueError, match="mark"):
        winning_cells("." * 9, "Z")


def test_a_missed_tactic_is_a_win_left_on_the_spot_or_a_line_left_unblocked():
    # X on 0 and 1 (wins at 2), O on 3 and 4 (wins at 5), X to move.
    board = "XX.OO...."
    assert missed_tactic(board, 2, "X") is None  # took the win
    assert missed_tactic(board, 5, "X") == ("win", [2])  # blocked, but could have won
    assert missed_tactic(board, 8, "X") == ("win", [2])
    # O to move with no line of its own: it must block X at 2.
    assert missed_tactic("XX..O....", 2, "O") is None
    assert missed_tactic("XX..O....", 8, "O") == ("block", [2])
    # A fork (X completes 0-1-2 at 2 and 0-3-6 at 6): blocking one is a block, neither a miss.
    assert missed_tactic("XX.XO...O", 5, "O") == ("block", [2, 6])
    assert missed_tactic("XX.XO...O", 6, "O") is None
    assert missed_tactic("." * 9, 4, "X") is None  # nothing to do on an empty board


async def test_the_missed_tactic_record_matches_a_replay_and_counts_in_the_metrics():
    env = TicTacToeEnv(min_random_move_prob=0.0, max_random_move_prob=1.0)
    rollouts = await play_all(env, RandomValidPolicy(), 60)
    seen = Counter()
    for rollout in rollouts:
        board, replayed = ["."] * 9, []
        for move in rollout.state["moves"]:
            if move["player"] == "model":
                missed = missed_tactic(board, move["cell"], move["mark"])
                replayed.append(missed[0] if missed else None)
            board[move["cell"]] = move["mark"]
        assert rollout.state["move_missed"] == replayed
        metrics = env.rollout_metrics(rollout)
        assert metrics["missed_wins"] == replayed.count("win")
        assert metrics["missed_blocks"] == replayed.count("block")
        seen.update(replayed)
    # A random player misses both kinds, and most of its moves have neither to do.
    assert seen["win"] > 0 and seen["block"] > 0 and seen[None] > seen["win"] + seen["block"]


def test_think_text_states_the_board_in_the_reasoning_format():
    board = "XX.OO...."
    assert think_text(board, "X") == "Empty: 2 5 6 7 8."
    assert think_text(board, "X", "threats") == "Empty: 2 5 6 7 8. Win: 2. Block: 5."
    assert think_text(board, "O", "threats") == "Empty: 2 5 6 7 8. Win: 5. Block: 2."
    assert think_text("." * 9, "O", "threats").endswith("Win: none. Block: none.")
    with pytest.raises(ValueError, match="reasoning must be one of"):
        think_text(board, "X", "vibes")


@pytest.mark.parametrize("reasoning", ["empty", "threats"])
async def test_built_in_players_think_in_the_env_format_and_the_env_checks_it(reasoning):
    env = TicTacToeEnv(reasoning=reasoning, min_random_move_prob=0.5)
    rollouts = await play_all(env, RandomValidPolicy(), 20)
    for rollout in rollouts:
        assert rollout.state["think_correct"] == [True] * rollout.num_turns
        assert env.rollout_metrics(rollout)["think_correct_rate"] == 1.0
        boards = [m["content"] for m in rollout.completion if m["role"] == "assistant"]
        assert all(("Win: " in text) == (reasoning == "threats") for text in boards)
    # A reply that misreads the board is counted wrong, whatever its move.
    example = first_example(env, model_starts=True)
    wrong = "<think>Empty: 0 1 2 3 4 5 6 7 8. Win: 4. Block: none.</think><move>4</move>"
    rollout = await env.rollout(ScriptedPolicy([wrong]), example, SAMPLING)
    assert rollout.state["think_correct"][0] is False
    assert all(rollout.state["think_correct"][1:])


class RightThinkTakenCell(Policy):
    """Reads the board right in the threats format, then plays the taken centre."""

    name = "right-think-taken-cell"

    async def generate(self, messages, sampling, *, tools=None, state=None) -> Generation:
        think = think_text(state["board"], state["model_mark"], "threats")
        return Generation(text=f"<think>{think}</think><move>4</move>")


async def test_think_reward_adds_to_the_turn_reward_of_a_reply_that_reads_the_board_right():
    # A wrong think with a sound move (the centre of the empty board), a right think with
    # an invalid move (the centre again), then the oracle (right think, sound move).
    wrong = "<think>Empty: 0 1 2.</think><move>4</move>"
    rewards = {}
    for bonus in (0.0, 0.5):
        env = TicTacToeEnv(model_mark="X", max_turns=30, reasoning="threats", think_reward=bonus)
        example = first_example(env, model_starts=True)
        policy = ScriptedPolicy([wrong], then=_Switch(RightThinkTakenCell(), OraclePolicy()))
        rollout = await env.rollout(policy, example, SAMPLING)
        thinks, sound = rollout.state["think_correct"], rollout.state["move_sound"]
        assert thinks[:2] == [False, True] and all(thinks[2:])
        assert sound[0] is True and sound[1] is None and all(sound[2:])
        rewards[bonus] = env.turn_rewards(rollout)
    rest = len(rewards[0.0]) - 2
    assert rewards[0.0] == [1.0, 0.0] + [1.0] * rest
    assert rewards[0.5] == [1.0, 0.5] + [1.5] * rest


async def test_a_malformed_reply_earns_no_turn_reward_whatever_its_move():
    # The centre of the empty board is sound; the first reply plays it with a tail after the
    # move tag (the drift seen in RL: the move read, the reply never ending), the rest are
    # the oracle's well-formed replies.
    env = TicTacToeEnv(model_mark="X", max_turns=30, reasoning="none")
    example = first_example(env, model_starts=True)
    tail = "<think></think><move>4</move></move>4"
    rollout = await env.rollout(ScriptedPolicy([tail], then=OraclePolicy()), example, SAMPLING)
    assert rollout.state["move_sound"][0] is True and rollout.state["board"][4] == "X"
    assert rollout.state["well_formed"] == [False] + [True] * (rollout.num_turns - 1)
    assert env.turn_rewards(rollout) == [0.0] + [1.0] * (rollout.num_turns - 1)
    # A rollout stored before the format record is judged on its moves alone.
    del rollout.state["well_formed"]
    assert env.turn_rewards(rollout) == [1.0] * rollout.num_turns


class _Switch(Policy):
    """`first` for one reply, then `then`."""

    name = "switch"

    def __init__(self, first: Policy, then: Policy):
        self.first, self.then, self.used = first, then, False

    async def generate(self, messages, sampling, *, tools=None, state=None) -> Generation:
        policy = self.then if self.used else self.first
        self.used = True
        return await policy.generate(messages, sampling, tools=tools, state=state)


def test_an_unknown_reasoning_format_is_refused():
    with pytest.raises(ParamError, match="reasoning"):
        TicTacToeEnv(reasoning="vibes")


async def test_final_state_records_the_whole_game():
    env = TicTacToeEnv(model_mark="O")
    rollout = (await play_all(env, RandomValidPolicy(), 1))[0]
    state = rollout.state
    assert state["model_mark"] == "O" and len(state["board"]) == 9
    assert state["random_move_prob"] == rollout.info["random_move_prob"]
    assert state["model_starts"] == rollout.info["model_starts"]
    board = ["."] * 9
    for move in state["moves"]:
        assert board[move["cell"]] == "."
        assert move["mark"] == ("O" if move["player"] == "model" else "X")
        board[move["cell"]] = move["mark"]
    assert board == state["board"]
    assert state["moves"][0]["player"] == ("model" if state["model_starts"] else "opponent")
    players = [move["player"] for move in state["moves"]]
    assert all(a != b for a, b in zip(players, players[1:], strict=False))
    assert json.loads(json.dumps(rollout.to_dict()))["state"] == state
    assert env.breakdowns(rollout) == {
        "starter": "model" if state["model_starts"] else "opponent",
        "mark": "O",
    }


# ---------------------------------------------------------------------------------------
# Invalid moves


async def test_invalid_replies_are_explained_counted_and_the_game_goes_on():
    env = TicTacToeEnv(model_mark="X", max_turns=30)
    example = first_example(env, model_starts=True)
    policy = ScriptedPolicy(
        [
            "<move>9</move>",
            "I pick the middle",
            "<think>hmm</think><move>four</move>",
            "<think>centre</think><move>4</move>",
            "<think>again</think><move>4</move>",
        ]
    )
    rollout = await env.rollout(policy, example, SAMPLING)
    env_messages = [m["content"] for m in rollout.completion if m["role"] == "user"]
    empty = "012\n345\n678"
    assert env_messages[0] == f"Invalid move: cell 9 is not in 0-8.\n{empty}\nYour move."
    hint = "Invalid move: reply with <move>N</move>, N in 0-8."
    assert env_messages[1] == f"{hint}\n{empty}\nYour move."
    assert env_messages[2] == f"{hint}\n{empty}\nYour move."
    assert env_messages[3].startswith("Opponent played ")
    board_after_opponent = env_messages[3].split("\n", 1)[1]
    assert env_messages[4] == f"Invalid move: cell 4 is taken.\n{board_after_opponent}"
    assert rollout.state["invalid_moves"] == 4
    assert rollout.rewards["invalid_move"] == pytest.approx(-0.4)
    assert rollout.outcome in ("win", "draw")
    replies = sum(m["role"] == "assistant" for m in rollout.completion)
    assert rollout.num_turns == replies == rollout.state["model_turns"]
    # The taken-cell reply is well formatted; only the first three are not.
    assert rollout.rewards["format"] == pytest.approx((replies - 3) / replies)
    metrics = env.rollout_metrics(rollout)
    assert metrics["invalid_moves"] == 4
    assert metrics["invalid_move_rate"] == pytest.approx(4 / replies)
    assert metrics["format_rate"] == pytest.approx(rollout.rewards["format"])


async def test_turns_run_out_leaving_the_game_unfinished_and_the_penalty_capped():
    env = TicTacToeEnv(max_turns=10)
    rollouts = await play_all(env, ConstantPolicy("<think>mine</think><move>4</move>"), 8)
    for rollout in rollouts:
        assert rollout.outcome == "unfinished"
        assert rollout.truncated and rollout.state["hit_max_turns"]
        assert rollout.num_turns == 10
        assert rollout.state["invalid_moves"] >= 9
        assert rollout.rewards == {"outcome": 0.0, "format": 1.0, "invalid_move": -0.5}
        assert rollout.reward == pytest.approx(0.2 - 0.5)


async def test_penalty_and_cap_follow_the_params():
    env = TicTacToeEnv(max_turns=4, invalid_move_penalty=0.2, invalid_penalty_cap=1.0)
    rollout = (await play_all(env, ConstantPolicy("no move at all"), 1))[0]
    assert rollout.state["invalid_moves"] == 4
    assert rollout.rewards["invalid_move"] == pytest.approx(-0.8)
    assert rollout.rewards["format"] == 0.0


async def test_outcome_rewards_follow_the_params_and_unfinished_pays_as_a_loss():
    env = TicTacToeEnv(draw_reward=0.25, loss_reward=-1.0, max_turns=6)
    games = {
        "win": await play_all(env, OraclePolicy(), 16),
        "loss": await play_all(
            TicTacToeEnv(draw_reward=0.25, loss_reward=-1.0, max_random_move_prob=0.0),
            RandomValidPolicy(seed=3),
            16,
        ),
        "unfinished": await play_all(env, ConstantPolicy("no move"), 2),
    }
    paid = {}
    for rollouts in games.values():
        for rollout in rollouts:
            paid.setdefault(rollout.outcome, set()).add(rollout.rewards["outcome"])
    assert paid["win"] == {1.0}
    assert paid["draw"] == {0.25}
    assert paid["loss"] == {-1.0}
    assert paid["unfinished"] == {-1.0}


async def test_one_turn_is_not_enough_to_finish():
    env = TicTacToeEnv(max_turns=1)
    rollout = (await play_all(env, OraclePolicy(), 1))[0]
    assert rollout.outcome == "unfinished" and rollout.rewards["outcome"] == 0.0


async def test_a_builtin_player_without_state_fails_clearly():
    with pytest.raises(PolicyError, match="needs the env state"):
        await OraclePolicy().generate([], SAMPLING)


def test_builtin_players_are_loadable_by_name():
    env = TicTacToeEnv()
    assert set(env.builtin_policies()) == {"oracle", "random", "constant"}
    assert isinstance(load_policy("oracle", env=env), OraclePolicy)
    assert isinstance(load_policy("random", env=env), RandomValidPolicy)


# ---------------------------------------------------------------------------------------
# Replies and rewards


@pytest.mark.parametrize(
    ("text", "formatted"),
    [
        ("<think>corner</think><move>0</move>", True),
        ("  <think>two\nlines</think>\n <move> 4 </move>\n", True),
        ("<think></think><move>8</move>", True),
        ("<move>4</move>", False),
        ("<think>x</think><move>4</move> good luck", False),
        ("<think>x</think>", False),
        ("<move>4</move><think>x</think>", False),
        ("<think>x</think><move>four</move>", False),
        ("", False),
    ],
)
def test_format_is_think_then_move_and_nothing_else(text, formatted):
    assert is_well_formatted(text) is formatted
    completion = [{"role": "assistant", "content": text}]
    assert format_reward(completion=completion) == (1.0 if formatted else 0.0)


def test_format_reward_is_the_share_of_good_replies():
    good, bad = "<think>a</think><move>1</move>", "<move>1</move>"
    completion = [
        {"role": "assistant", "content": good},
        {"role": "user", "content": "Opponent played 3."},
        {"role": "assistant", "content": bad},
        {"role": "assistant", "content": good},
        {"role": "assistant", "content": good},
    ]
    assert format_reward(completion=completion) == 0.75
    assert format_reward(completion=[]) == 0.0


@pytest.mark.parametrize(
    ("text", "cell", "error"),
    [
        ("<think>t</think><move>2</move>", 2, None),
        ("<move>2</move>", 2, None),
        ("<think>maybe <move>0</move></think><move>2</move>", 2, None),
        ("<think>maybe <move>2</move></think>", None, "reply with <move>N</move>, N in 0-8"),
        ("<move>0</move>", None, "cell 0 is taken"),
        ("<move>-1</move>", None, "cell -1 is not in 0-8"),
        ("<move>2.5</move>", None, "reply with <move>N</move>, N in 0-8"),
        ("2", None, "reply with <move>N</move>, N in 0-8"),
        (None, None, "reply with <move>N</move>, N in 0-8"),
    ],
)
def test_parse_move(text, cell, error):
    assert parse_move(text, "X........") == (cell, error)


def test_remembered_answers_are_fresh_and_checked():
    """The rules' answers are remembered per board (a game asks them many times a turn):
    a caller that changes a returned list changes nothing after it, a board is still
    checked where it is not a remembered one, and a taken cell is read off each board."""
    board = "XO.X..O.."
    cells = empty_cells(board)
    cells.append(99)
    assert empty_cells(board) == [2, 4, 5, 7, 8]
    sound = sound_moves(board, "X")
    expected = list(sound)
    sound.clear()
    assert sound_moves(board, "X") == expected != []
    assert sound_moves(list(board), "X") == expected
    for bad in ("XO.X..O.", "XO.X..O.Z", ["X"] * 8):
        with pytest.raises(ValueError, match="a board is 9 cells"):
            winner(bad)
    assert parse_move("<move>2</move>", "XO.X..O..") == (2, None)
    assert parse_move("<move>2</move>", "XOXX..O..") == (None, "cell 2 is taken")
    long_reply = f"<think>{'x' * 5000}</think><move>4</move>"
    assert parse_move(long_reply, "XO.X..O..") == (4, None)
    assert parse_move(long_reply, "XO.XX.O..") == (None, "cell 4 is taken")


@given(st.text(), st.integers(min_value=0, max_value=8))
def test_any_text_parses_without_raising(junk, cell):
    parsed, error = parse_move(junk, "." * 9)
    assert (parsed is None) != (error is None)
    thought = junk.replace("<", "").replace(">", "")
    reply = f"<think>{thought}</think><move>{cell}</move>"
    assert parse_move(reply, "." * 9) == (cell, None)
    assert is_well_formatted(reply)


def test_outcome_labels():
    def state(board, mark="X"):
        return {"board": list(board), "model_mark": mark}

    assert outcome_label(state("XXXOO....")) == "win"
    assert outcome_label(state("XXXOO....", "O")) == "loss"
    assert outcome_label(state("XOXXOOOXX")) == "draw"
    assert outcome_label(state("XO.......")) == "unfinished"
    assert outcome_label({}) == "unfinished"
    env = TicTacToeEnv()
    assert env.outcome(state("XXXOO...."), {}) == "win"


# ---------------------------------------------------------------------------------------
# PlaySession


async def test_a_full_game_against_the_oracle_never_loses_and_survives_json():
    for game in range(12):
        rng = random.Random(game)
        session = PlaySession.new(rng.choice("XO"), model_starts=game % 2 == 0, seed=game)
        oracle = OraclePolicy()
        while not session.finished:
            session = PlaySession.from_dict(json.loads(json.dumps(session.to_dict())))
            if session.to_move == "human":
                empties = [i for i, mark in enumerate(session.board) if mark == "."]
                session.human_move(rng.choice(empties))
            else:
                turn = await session.model_turn(oracle, SAMPLING)
                assert turn["valid"] and turn["attempts"] == 1 and turn["error"] is None
                assert turn["think"].startswith("Empty: ")
                assert session.board[turn["move"]] == session.model_mark
        assert session.outcome in ("win", "draw")
        assert session.winner in (session.model_mark, None)
        assert session.to_move is None
        assert session.messages[-1]["content"].endswith(("You win.", "Draw."))
        assert len(session.moves) == 9 - session.board.count(".")


async def test_play_session_builds_the_same_conversation_as_the_env():
    env = TicTacToeEnv(min_random_move_prob=0.5, max_random_move_prob=0.5)
    for example in env.examples(6, seed=4):
        rollout = await env.rollout(OraclePolicy(), example, SAMPLING)
        info = example.info
        session = PlaySession.new(info["model_mark"], info["model_starts"], seed=example.seed)
        for move in rollout.state["moves"]:
            if move["player"] == "opponent":
                session.human_move(move["cell"])
            else:
                assert (await session.model_turn(OraclePolicy(), SAMPLING))["move"] == move["cell"]
        assert session.messages == rollout.messages
        assert session.outcome == rollout.outcome


async def test_play_session_retries_invalid_replies_then_forfeits():
    session = PlaySession.new("X", model_starts=False, seed=1)
    session.human_move(4)
    turn = await session.model_turn(ConstantPolicy("<think>mine</think><move>4</move>"), SAMPLING)
    assert turn == {
        "text": "<think>mine</think><move>4</move>",
        "think": "mine",
        "move": None,
        "valid": False,
        "error": "cell 4 is taken",
        "attempts": 3,
    }
    assert session.invalid_moves == 3
    assert session.finished and session.outcome == "unfinished" and session.winner == "O"
    errors = [m for m in session.messages if m["content"].startswith("Invalid move: cell 4")]
    assert len(errors) == 3
    with pytest.raises(ValueError, match="game is over"):
        session.human_move(0)
    restored = PlaySession.from_dict(session.to_dict())
    assert restored.finished and restored.winner == "O"


async def test_play_session_accepts_a_corrected_reply():
    session = PlaySession.new("O", model_starts=False, seed=2)
    session.human_move("4")
    policy = ScriptedPolicy(["<move>4</move>", "<think>corner</think><move>0</move>"])
    turn = await session.model_turn(policy, SAMPLING)
    assert (turn["valid"], turn["move"], turn["attempts"]) == (True, 0, 2)
    assert session.invalid_moves == 1 and session.board[0] == "O"
    assert session.to_move == "human"


async def test_play_session_rejects_moves_out_of_turn_or_off_the_board():
    session = PlaySession.new("X", model_starts=True, seed=3)
    with pytest.raises(ValueError, match="model's turn"):
        session.human_move(0)
    await session.model_turn(ConstantPolicy("<think>c</think><move>4</move>"), SAMPLING)
    with pytest.raises(ValueError, match="human's turn"):
        await session.model_turn(OraclePolicy(), SAMPLING)
    with pytest.raises(ValueError, match="cell 4 is taken"):
        session.human_move(4)
    for bad in (9, -1, "middle", 2.0, True):
        with pytest.raises(ValueError, match="integer from 0 to 8"):
            session.human_move(bad)
    with pytest.raises(ValueError, match="'X' or 'O', got 'Z'"):
        PlaySession.new("Z", True)
    with pytest.raises(ValueError, match="needs"):
        PlaySession.from_dict({"model_mark": "X"})


# Replies a model (or an attacker behind an endpoint) may send; none is a valid move.
HOSTILE_REPLIES = [
    "",
    "no move at all",
    "<move>9</move>",
    "<move>-1</move>",
    "<move>" + "0" * 5000 + "1</move>",
    "<think>I pick <move>1</move></think>",
    "\x00<move>",
    "<move>one</move>",
]


async def test_play_session_and_the_env_judge_hostile_replies_alike():
    env = TicTacToeEnv(max_turns=30)
    example = first_example(env, model_starts=False, model_mark="X")
    taken = example.info["opponent_first_move"]
    replies = [*HOSTILE_REPLIES, f"<move>{taken}</move>"]
    rollout = await env.rollout(ScriptedPolicy(list(replies)), example, SAMPLING)
    session = PlaySession.new("X", model_starts=False, seed=example.seed)
    session.human_move(taken)
    assert session.messages == example.prompt
    turn = await session.model_turn(ScriptedPolicy(list(replies)), SAMPLING, len(replies) + 1)
    # Then the oracle's first real move, which both accept the same way.
    assert turn["valid"] and turn["attempts"] == len(replies) + 1
    # Every reply got the same answer (the same error, the same board), and both counted
    # and recorded the same things.
    tries = len(replies) * 2
    assert session.messages[: 2 + tries] == rollout.messages[: 2 + tries]
    assert session.invalid_moves == len(replies)
    for record in ("move_sound", "think_correct"):
        assert session.state[record] == rollout.state[record][: len(replies) + 1], record
    assert session.state["model_turns"] == len(replies) + 1
    assert rollout.state["invalid_moves"] == len(replies)
    # Out of attempts, the Play page's model forfeits on the last error the env gave.
    forfeit = PlaySession.new("X", model_starts=False, seed=example.seed)
    forfeit.human_move(taken)
    last = await forfeit.model_turn(ScriptedPolicy(list(replies)), SAMPLING, len(replies))
    assert last["error"] == f"cell {taken} is taken" and forfeit.outcome == "unfinished"
    assert forfeit.messages[-1] == rollout.messages[1 + tries]


# ---------------------------------------------------------------------------------------
# Self-play


class RecordingPolicy(Policy):
    """`inner`'s replies, each prompt and state it was handed kept; replies in `bad_marks`'
    games are replaced by an invalid one."""

    name = "recording"

    def __init__(self, inner: Policy, bad_marks: tuple[str, ...] = ()):
        self.inner, self.bad_marks, self.calls = inner, bad_marks, []

    async def generate(self, messages, sampling, *, tools=None, state=None) -> Generation:
        generation = await self.inner.generate(messages, sampling, tools=tools, state=state)
        if state["model_mark"] in self.bad_marks:
            generation = Generation(text="<think></think><move>9</move>")
        self.calls.append((messages, dict(state), generation.text))
        return generation


def test_self_play_is_drawn_per_example_and_changes_nothing_else():
    plain = TicTacToeEnv().examples(200, seed=3)
    half = TicTacToeEnv(self_play=0.5).examples(200, seed=3)
    chosen = [example.info.pop("self_play", False) for example in half]
    assert 70 < sum(chosen) < 130
    assert [e.info for e in half] == [e.info for e in plain]
    assert [e.prompt for e in half] == [e.prompt for e in plain]
    assert not any("self_play" in e.info for e in TicTacToeEnv(self_play=0.0).examples(50, seed=3))


async def test_without_self_play_the_policy_never_plays_the_opponent():
    policy = RecordingPolicy(RandomValidPolicy(seed=1))
    env = TicTacToeEnv(model_mark="X")
    rollouts = await play_all(env, policy, 30)
    assert {call[1]["model_mark"] for call in policy.calls} == {"X"}
    assert sum(r.state["model_turns"] for r in rollouts) == len(policy.calls)
    assert all(env.rollout_metrics(r)["self_play"] == 0.0 for r in rollouts)


async def test_a_self_play_opponent_plays_the_policys_own_moves_from_its_side():
    env = TicTacToeEnv(self_play=1.0, min_random_move_prob=1.0, max_random_move_prob=1.0)
    policy = RecordingPolicy(RandomValidPolicy(seed=4))
    rollouts = await play_all(env, policy, 40)
    for rollout in rollouts:
        assert rollout.state["self_play"] and rollout.state["self_play_fallbacks"] == 0
        model, opponent = rollout.state["model_mark"], rollout.state["opponent_mark"]
        asked = [call for call in policy.calls if call[1]["seed"] == rollout.seed]
        theirs = [call for call in asked if call[1]["model_mark"] == opponent]
        # Each opponent move after the first (a game the opponent starts opens with the
        # minimax move) is the policy's reply, asked as the opponent with the board then.
        moves = [m for m in rollout.state["moves"] if m["player"] == "opponent"]
        moves = moves[1:] if not rollout.info["model_starts"] else moves
        assert [parse_move(call[2], call[1]["board"])[0] for call in theirs] == [
            m["cell"] for m in moves
        ]
        for messages, view, _ in theirs:
            assert f"as {opponent}" in messages[0]["content"] and len(messages) == 2
            assert render_board(view["board"]) + "\nYour move." in messages[1]["content"]
        # Only the model's side is the rollout's: the turns it counts are the model's.
        assert rollout.num_turns == rollout.state["model_turns"] == len(asked) - len(theirs)
        assert all(call[1]["model_mark"] == model for call in asked if call not in theirs)


async def test_an_oracle_in_self_play_draws_every_game():
    # Against a random opponent the oracle wins most games; against itself, none.
    env = TicTacToeEnv(min_random_move_prob=1.0, max_random_move_prob=1.0)
    alone = Counter(r.outcome for r in await play_all(env, OraclePolicy(), 60))
    assert alone["win"] > 40
    env = TicTacToeEnv(self_play=1.0, min_random_move_prob=1.0, max_random_move_prob=1.0)
    assert Counter(r.outcome for r in await play_all(env, OraclePolicy(), 60)) == {"draw": 60}


async def test_an_invalid_self_play_reply_falls_back_to_the_minimax_move():
    env = TicTacToeEnv(self_play=1.0, model_mark="X", min_random_move_prob=0.0,
                       max_random_move_prob=0.0)  # fmt: skip
    # The opponent (O) always replies off the board: every one of its moves is minimax's,
    # so the oracle draws every game, and each fallback is counted.
    rollouts = await play_all(env, RecordingPolicy(OraclePolicy(), bad_marks=("O",)), 30)
    assert Counter(r.outcome for r in rollouts) == {"draw": 30}
    for rollout in rollouts:
        opponent_moves = [m for m in rollout.state["moves"] if m["player"] == "opponent"]
        started = 0 if rollout.info["model_starts"] else 1
        assert rollout.state["self_play_fallbacks"] == len(opponent_moves) - started > 0
        metrics = env.rollout_metrics(rollout)
        assert metrics["self_play"] == 1.0
        assert metrics["self_play_fallbacks"] == rollout.state["self_play_fallbacks"]
        assert rollout.state["invalid_moves"] == 0  # the opponent's errors are not the model's
