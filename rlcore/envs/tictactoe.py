"""Tic-tac-toe against a minimax opponent that blunders on purpose: the flagship environment.

The model plays X or O over several turns, replying `<think>...</think><move>N</move>` with
cells numbered 0-8. The opponent plays a minimax move, except that with probability
`random_move_prob` it plays a uniformly random empty cell; each example draws that
probability from its stratum of [min_random_move_prob, max_random_move_prob] and keeps it
for all its rollouts. Everything random comes from stable hashes: the example seed fixes
the model's mark, who starts and the opponent's strength, and the opponent's reply is drawn
from a seed made of (example seed, board), so two rollouts that reach the same board meet
the same reply. Among equally good minimax moves the choice is random, never the first in
board order, because a biased opponent gets memorized instead of beaten. "Equally good"
means the same minimax score, where a win scores higher the sooner it comes and a loss the
later; in drawn positions that is exactly the set of drawing moves, and in decided ones it
makes the winner finish and the loser block. An invalid reply (no move tag, not a number,
off the board, taken cell) does not end the game: the env says what was wrong, shows the
same board and the model tries again, each try counting toward `max_turns`.

Self-play (`self_play` > 0): that share of the examples, drawn per example, meet the policy
itself instead of the minimax opponent. Each opponent move is the policy's own reply,
sampled as the model's are, to a one-turn prompt of the board from the opponent's side
(its mark in the system prompt, the model's last move announced); an invalid reply there
falls back to the minimax opponent's move, so the game goes on. Only the model's side is a
rollout's turns; the opening move of a game the opponent starts stays the minimax one.

This module holds the prompts, the rubric and `TicTacToeEnv`; how one model reply is
judged (`game_state`, `model_reply`) is shared with the Play page's game
(tictactoe_play.py). The rules and the solver are in tictactoe_game.py, the built-in
players in tictactoe_players.py.
"""

from __future__ import annotations

import contextvars
import random
import re
from collections.abc import Callable, Sequence
from functools import cache, lru_cache
from typing import Any

from rlcore.envs.base import (
    Fact,
    MoveOptions,
    MultiTurnEnv,
    Param,
    Validation,
    example_seed,
)
from rlcore.envs.tictactoe_game import (
    EMPTY,
    REASONING_FORMATS,
    REMEMBERED_REPLY_CHARS,
    check_mark,
    empty_cells,
    game_over,
    missed_tactic,
    move_values,
    opponent_move,
    oracle_best_moves,
    other_mark,
    parse_move,
    play_move,
    random_opening,
    render_board,
    result_for,
    sound_moves,
    stable_seed,
    think_parser,
    think_text,
    winner,
)
from rlcore.envs.tictactoe_players import OraclePolicy, RandomValidPolicy
from rlcore.parsers import XMLParser
from rlcore.policy.base import ConstantPolicy, Policy
from rlcore.rubric import Rubric
from rlcore.types import Example, Message, Rollout, SamplingParams

# The policy and sampling of the rollout in progress (per asyncio task), for self-play.
_PLAYER: contextvars.ContextVar[tuple[Policy, SamplingParams] | None] = contextvars.ContextVar(
    "tictactoe_player", default=None
)

# A win pays 1; the draw and loss rewards are env params (an unfinished game pays the loss
# reward), these their defaults.
OUTCOME_REWARD = {"win": 1.0, "draw": 0.5, "loss": 0.0}

# ---------------------------------------------------------------------------------------
# Replies and messages (shared by the environment and PlaySession)

_STRICT_REPLY = re.compile(r"\s*<think>.*?</think>\s*<move>\s*[0-9]+\s*</move>\s*", re.DOTALL)


def is_well_formatted(text: str | None) -> bool:
    """Whether a reply is exactly a think block then a move tag holding a number
    (whitespace around them allowed, nothing else)."""
    return _STRICT_REPLY.fullmatch(text or "") is not None


def _reply_form(text: str | None) -> tuple[str | None, bool]:
    """A reply's think block (None without one) and whether it `is_well_formatted`."""
    return think_parser.think(text), is_well_formatted(text)


# A policy's replies repeat, so short ones are remembered (as parse_move remembers them).
_remembered_form = lru_cache(maxsize=4096)(_reply_form)


def reply_form(text: str | None) -> tuple[str | None, bool]:
    short = text is None or len(text) <= REMEMBERED_REPLY_CHARS
    return (_remembered_form if short else _reply_form)(text)


def system_prompt(model_mark: str) -> str:
    return (
        f"You play tic-tac-toe as {check_mark(model_mark)}. Empty cells show their number 0-8. "
        "Reply with <think>brief reasoning</think> then <move>N</move>."
    )


RESULT_TEXT = {"win": "You win.", "loss": "You lose.", "draw": "Draw."}


def board_message(
    board: Sequence[str] | str,
    *,
    opponent_cell: int | None = None,
    error: str | None = None,
    result: str | None = None,
) -> str:
    """One env message: what happened (opponent's move or the error), the board, and
    either the result ('win', 'loss', 'draw') or 'Your move.'."""
    lines = []
    if opponent_cell is not None:
        lines.append(f"Opponent played {opponent_cell}.")
    if error is not None:
        lines.append(f"Invalid move: {error}.")
    lines.append(render_board(board))
    lines.append(RESULT_TEXT[result] if result is not None else "Your move.")
    return "\n".join(lines)


def game_state(
    *,
    seed: int,
    model_mark: str,
    model_starts: bool,
    random_move_prob: float | None,
    reasoning: str = "empty",
) -> dict:
    """A fresh game's state, the shape a rollout's final state has: the board and its
    moves, and per model reply whether it was sound and whether its think block read the
    board right. `random_move_prob` is None where a person, not the env, plays the
    opponent (the Play page)."""
    return {
        "seed": seed,
        "board": [EMPTY] * 9,
        "winner": None,
        "model_mark": check_mark(model_mark),
        "opponent_mark": other_mark(model_mark),
        "random_move_prob": random_move_prob,
        "model_starts": model_starts,
        "moves": [],
        # Per model reply: whether its move was sound (kept the game-theoretic value),
        # None for an invalid reply.
        "move_sound": [],
        # Per model reply: "win" when it could have won on the spot and did not, "block"
        # when it had to block the opponent's line and did not (`missed_tactic`), else None.
        "move_missed": [],
        # Per model reply: whether its think block read the board right (`think_text`).
        "think_correct": [],
        # Per model reply: whether it was exactly a think block and a move (`is_well_formatted`).
        "well_formed": [],
        "reasoning": reasoning,
        "invalid_moves": 0,
        "model_turns": 0,
    }


def model_reply(state: dict, reply: str | None) -> tuple[int | None, str | None]:
    """Judge one model reply in the game `state` and apply it: the turn is counted, its
    think block and move recorded, and a valid move played. Returns (cell, None), or
    (None, what was wrong) for an invalid reply, which leaves the board as it was and
    counts in `invalid_moves`; the model is then shown `retry_message`."""
    state["model_turns"] += 1
    board = state["board"]
    expected = think_text(board, state["model_mark"], state["reasoning"])
    think, well_formed = reply_form(reply)
    state["think_correct"].append(think == expected)
    state.setdefault("well_formed", []).append(well_formed)
    cell, error = parse_move(reply, board)
    if error is not None:
        state["invalid_moves"] += 1
        state["move_sound"].append(None)
        state.setdefault("move_missed", []).append(None)
        return None, error
    state["move_sound"].append(cell in sound_moves(board, state["model_mark"]))
    missed = missed_tactic(board, cell, state["model_mark"])
    state.setdefault("move_missed", []).append(missed[0] if missed else None)
    play_move(board, state["moves"], cell, state["model_mark"], "model")
    state["winner"] = winner(board)
    return cell, None


@cache
def _option_grades(board: str, mark: str, win_chances: bool) -> dict[str, float]:
    """`move_options`' verdict of each empty cell of `board` for `mark`, in cell order: 1.0
    if the move keeps the position's game-theoretic value (`sound_moves`), else 0.0; with
    `win_chances` a sound move that is not one of `oracle_best_moves` is 0.5. A position's
    verdicts never change, so a run works each out once."""
    sound = set(sound_moves(board, mark))
    best = set(oracle_best_moves(board, mark) if win_chances else ())
    return {
        str(cell): (1.0 if not best or cell in best else 0.5) if cell in sound else 0.0
        for cell in empty_cells(board)
    }


def retry_message(state: dict, error: str) -> Message:
    """What the model is told after an invalid reply: the error and the same board."""
    return {"role": "user", "content": board_message(state["board"], error=error)}


# ---------------------------------------------------------------------------------------
# Reward functions


def outcome_label(state: dict) -> str:
    """'win', 'draw', 'loss' or 'unfinished' (turns ran out, or the policy failed)."""
    board = state.get("board")
    model_mark = state.get("model_mark")
    if board is None or model_mark is None:
        return "unfinished"
    return result_for(board, model_mark) or "unfinished"


def format_reward(*, completion: list[Message], **_) -> float:
    """The share of the model's replies that are exactly `<think>...</think><move>N</move>`."""
    replies = [m.get("content") or "" for m in completion if m.get("role") == "assistant"]
    if not replies:
        return 0.0
    return sum(reply_form(text)[1] for text in replies) / len(replies)


# ---------------------------------------------------------------------------------------
# The environment


class TicTacToeEnv(MultiTurnEnv):
    """Tic-tac-toe against a seeded minimax opponent that plays randomly with probability p."""

    name = "tictactoe"
    outcome_labels = ("win", "draw", "loss", "unfinished")
    facts = [
        Fact(
            "invalid_moves",
            "invalid moves",
            "int",
            "Invalid replies in the game (no move, off the board, a taken cell).",
        ),
        Fact(
            "random_move_prob",
            "opponent random p",
            "float",
            "The chance the opponent played a random cell instead of its minimax move.",
            min=0.0,
            max=1.0,
        ),
    ]
    state_views_title = "Board, move by move"
    description = (
        "Tic-tac-toe against minimax with random blunders; rewards for winning, the "
        "<think>/<move> format, and a capped penalty for invalid moves."
    )
    params = [
        Param(
            "min_random_move_prob",
            float,
            0.0,
            "Lowest chance the opponent plays a random cell instead of its minimax move.",
            min=0.0,
            max=1.0,
        ),
        Param(
            "max_random_move_prob",
            float,
            1.0,
            "Highest chance the opponent plays a random cell; 0 and 0 make it perfect.",
            min=0.0,
            max=1.0,
        ),
        Param(
            "num_groups",
            int,
            4,
            "Opponent-strength bins: example i takes bin i % num_groups, so batches mix "
            "strengths evenly.",
            min=1,
            max=20,
        ),
        Param(
            "model_mark",
            str,
            "random",
            "The model's mark; 'random' draws it from each example's seed.",
            choices=("X", "O", "random"),
        ),
        Param(
            "max_turns",
            int,
            10,
            "Most model replies per game, invalid ones included; then it is unfinished.",
            min=1,
            max=30,
        ),
        Param(
            "opening_moves",
            int,
            0,
            "Exploring starts for RL: each example first plays up to this many random moves "
            "of each side (0 to the most, drawn per example), so training sees every phase "
            "of the game from its first turn. Keep 0 to evaluate full games.",
            min=0,
            max=4,
        ),
        Param(
            "draw_reward",
            float,
            OUTCOME_REWARD["draw"],
            "Outcome reward for a draw; a win is worth 1.",
            min=-1.0,
            max=1.0,
        ),
        Param(
            "loss_reward",
            float,
            OUTCOME_REWARD["loss"],
            "Outcome reward for a loss, and for a game left unfinished (so stalling never "
            "beats losing). Below 0 makes a loss cost more than a draw gains.",
            min=-1.0,
            max=1.0,
        ),
        Param(
            "reasoning",
            str,
            "empty",
            "What the built-in players write in their think block, so what SFT on their "
            "games teaches a model to think: 'empty' lists the empty cells; 'threats' adds "
            "the cells that complete a line for the mover ('Win:') and for the opponent "
            "('Block:'). Either way the moves are the players' own; the think block only "
            "reads the board.",
            choices=REASONING_FORMATS,
        ),
        Param(
            "think_reward",
            float,
            0.0,
            "Per-turn reward (`turn_rewards`) added for a think block that states the "
            "board's facts exactly as the `reasoning` format does, so RL that credits moves "
            "one by one also keeps the reasoning true.",
            min=0.0,
            max=10.0,
        ),
        Param(
            "self_play",
            float,
            0.0,
            "Share of the games (drawn per example) whose opponent is the policy itself: "
            "each opponent move is its own sampled reply from the opponent's side, an "
            "invalid one replaced by the minimax opponent's move. 0: minimax in every game.",
            min=0.0,
            max=1.0,
        ),
        Param(
            "win_chances",
            bool,
            False,
            "Grade the moves for RL's sound mass three ways: the oracle's moves (among the "
            "sound ones, the fastest win and the most chances for a random opponent to go "
            "wrong) 1, the other sound moves 0.5, the unsound ones 0; the loss then raises "
            "the mass of both the sound moves and the oracle's. Turn rewards are unchanged.",
        ),
        Param(
            "invalid_move_penalty",
            float,
            0.1,
            "Reward subtracted for each invalid reply.",
            min=0.0,
            max=10.0,
        ),
        Param(
            "invalid_penalty_cap",
            float,
            0.5,
            "Largest total invalid-move penalty per game.",
            min=0.0,
            max=10.0,
        ),
    ]

    def check_params(self, config: dict) -> dict[str, str]:
        errors = {}
        low, high = config["min_random_move_prob"], config["max_random_move_prob"]
        if low > high:
            errors["min_random_move_prob"] = (
                f"must be at most max_random_move_prob ({high}), got {low}"
            )
        draw, loss = config["draw_reward"], config["loss_reward"]
        if loss > draw:
            errors["loss_reward"] = f"must be at most draw_reward ({draw}), got {loss}"
        return errors

    def build_parser(self) -> XMLParser:
        return XMLParser(["think", "move"])

    def build_rubric(self) -> Rubric:
        rubric = Rubric()
        outcome_values = (
            OUTCOME_REWARD["win"],
            self.config["draw_reward"],
            self.config["loss_reward"],
        )
        rubric.add(
            self.outcome_reward,
            1.0,
            name="outcome",
            bounds=(min(outcome_values), max(outcome_values)),
        )
        rubric.add(format_reward, 0.2, name="format", bounds=(0.0, 1.0))
        rubric.add(
            self.invalid_move_reward,
            1.0,
            name="invalid_move",
            bounds=(-self.config["invalid_penalty_cap"], 0.0),
        )
        return rubric

    def outcome_reward(self, *, state: dict, **_) -> float:
        """1 for a win, `draw_reward` for a draw, `loss_reward` for a loss or an
        unfinished game."""
        label = outcome_label(state)
        if label == "win":
            return OUTCOME_REWARD["win"]
        return self.config["draw_reward" if label == "draw" else "loss_reward"]

    def invalid_move_reward(self, *, state: dict, **_) -> float:
        """-invalid_move_penalty per invalid reply, capped: never below -invalid_penalty_cap."""
        count = state.get("invalid_moves", 0)
        # 0.0 - x rather than -x so a clean game scores 0.0, not -0.0, in stored rewards.
        return 0.0 - min(
            self.config["invalid_penalty_cap"], self.config["invalid_move_penalty"] * count
        )

    @property
    def num_groups(self) -> int:
        return self.config["num_groups"]

    def make_example(self, index: int, seed: int) -> Example:
        ex_seed = example_seed(seed, index)
        rng = random.Random(ex_seed)
        # Draw every value in a fixed order whatever the config, so fixing the mark does
        # not change who starts or how strong the opponent is.
        strength_draw, mark_draw, start_draw = rng.random(), rng.random(), rng.random()
        opening_rng = random.Random(stable_seed("opening", ex_seed))
        group = index % self.num_groups
        low, high = self.config["min_random_move_prob"], self.config["max_random_move_prob"]
        bin_width = (high - low) / self.num_groups
        random_move_prob = min(high, low + (group + strength_draw) * bin_width)
        model_mark = self.config["model_mark"]
        if model_mark == "random":
            model_mark = "X" if mark_draw < 0.5 else "O"
        model_starts = start_draw < 0.5

        board = [EMPTY] * 9
        first_move = None
        if not model_starts:
            first_move = opponent_move(board, other_mark(model_mark), random_move_prob, ex_seed)
            board[first_move] = other_mark(model_mark)
        opening = random_opening(
            board, model_mark, opening_rng.randint(0, self.config["opening_moves"]), opening_rng
        )
        last_opponent_cell = opening[-1] if opening else first_move
        # Its own stream: adding self-play changes no other draw of the example.
        self_play = random.Random(stable_seed("self-play", ex_seed)).random()
        prompt = [
            {"role": "system", "content": system_prompt(model_mark)},
            {"role": "user", "content": board_message(board, opponent_cell=last_opponent_cell)},
        ]
        return Example(
            id=index,
            seed=ex_seed,
            prompt=prompt,
            group=group,
            info={
                "random_move_prob": random_move_prob,
                "model_mark": model_mark,
                "model_starts": model_starts,
                "opponent_first_move": first_move,
                "opening": opening,
                **({"self_play": True} if self_play < self.config["self_play"] else {}),
            },
        )

    def setup_state(self, example: Example) -> dict:
        model_mark = example.info["model_mark"]
        state = game_state(
            seed=example.seed,
            model_mark=model_mark,
            model_starts=example.info["model_starts"],
            random_move_prob=example.info["random_move_prob"],
            reasoning=self.config["reasoning"],
        )
        first_move = example.info["opponent_first_move"]
        if first_move is not None:
            play_move(
                state["board"], state["moves"], first_move, state["opponent_mark"], "opponent"
            )
        opening = example.info.get("opening", [])
        for index, cell in enumerate(opening):
            mark, player = (
                (model_mark, "model") if index % 2 == 0 else (state["opponent_mark"], "opponent")
            )
            play_move(state["board"], state["moves"], cell, mark, player)
            state["moves"][-1]["opening"] = True
        if example.info.get("self_play"):
            state["self_play"] = True
            state["self_play_fallbacks"] = 0  # opponent replies that were not a valid move
        return state

    async def rollout(self, policy: Policy, example: Example, sampling: SamplingParams) -> Rollout:
        """A game, with the policy and sampling at hand for a self-play opponent's moves."""
        token = _PLAYER.set((policy, sampling))
        try:
            return await super().rollout(policy, example, sampling)
        finally:
            _PLAYER.reset(token)

    def is_completed(self, messages: list[Message], state: dict) -> bool:
        return game_over(state["board"])

    def decision_key(self, messages: list[Message], state: dict) -> str:
        """The board and the model turns used: with the opponent seeded by the board, the
        rest of the game depends on nothing else, whatever was thought on the way."""
        return f"{''.join(state['board'])}/{state['model_turns']}"

    def env_response(self, messages: list[Message], state: dict):
        """The model's reply judged and played, then the opponent's move and the board: a
        list of messages, or for a self-play game an awaitable of it (the opponent's move
        is the policy's)."""
        cell, error = model_reply(state, messages[-1].get("content"))
        if error is not None:
            return [retry_message(state, error)]
        if game_over(state["board"]):
            return self._answer(state, None)
        player = _PLAYER.get()
        if state.get("self_play") and player is not None:
            return self._self_play_answer(state, cell, *player)
        return self._answer(state, self._minimax_move(state))

    @staticmethod
    def _minimax_move(state: dict) -> int:
        return opponent_move(
            state["board"], state["opponent_mark"], state["random_move_prob"], state["seed"]
        )

    @staticmethod
    def _answer(state: dict, opponent_cell: int | None) -> list[Message]:
        """`opponent_cell` played (None: the game is over), and the message saying so."""
        board = state["board"]
        if opponent_cell is not None:
            play_move(board, state["moves"], opponent_cell, state["opponent_mark"], "opponent")
        state["winner"] = winner(board)
        content = board_message(
            board, opponent_cell=opponent_cell, result=result_for(board, state["model_mark"])
        )
        return [{"role": "user", "content": content}]

    async def _self_play_answer(
        self, state: dict, model_cell: int, policy: Policy, sampling: SamplingParams
    ) -> list[Message]:
        """The policy's own move from the opponent's side of the board (a one-turn prompt,
        as an example starting mid-game has), or the minimax move where its reply is not a
        valid move; a policy error ends the rollout as the model's own would."""
        board, mark = state["board"], state["opponent_mark"]
        prompt = [
            {"role": "system", "content": system_prompt(mark)},
            {"role": "user", "content": board_message(board, opponent_cell=model_cell)},
        ]
        view = {
            "seed": state["seed"], "board": list(board), "model_mark": mark,
            "reasoning": state["reasoning"],
        }  # fmt: skip
        generation = await policy.generate(prompt, sampling, state=view)
        cell, error = parse_move(generation.text, board)
        if error is not None:
            state["self_play_fallbacks"] += 1
            cell = self._minimax_move(state)
        return self._answer(state, cell)

    def outcome(self, state: dict, rewards: dict[str, float]) -> str:
        return outcome_label(state)

    def rollout_metrics(self, rollout: Rollout) -> dict[str, float]:
        invalid = rollout.state.get("invalid_moves", 0)
        turns = rollout.state.get("model_turns", 0)
        sound = rollout.state.get("move_sound", [])
        missed = rollout.state.get("move_missed", [])
        thinks = rollout.state.get("think_correct", [])
        return {
            "invalid_moves": float(invalid),
            "invalid_move_rate": invalid / turns if turns else 0.0,
            "format_rate": format_reward(completion=rollout.completion),
            # Share of the model's replies that were sound moves (an invalid one is not).
            "sound_move_rate": sum(s is True for s in sound) / len(sound) if sound else 0.0,
            # Replies a game that left a win on the spot untaken, and that left the
            # opponent's completed line unblocked (`missed_tactic`).
            "missed_wins": float(missed.count("win")),
            "missed_blocks": float(missed.count("block")),
            # Share of the model's replies whose think block stated the board's facts
            # exactly as the env's `reasoning` format does.
            "think_correct_rate": sum(thinks) / len(thinks) if thinks else 0.0,
            # Games against the policy itself, and their opponent replies that were no move.
            "self_play": float(bool(rollout.state.get("self_play"))),
            "self_play_fallbacks": float(rollout.state.get("self_play_fallbacks", 0)),
        }

    def turn_rewards(self, rollout: Rollout) -> list[float] | None:
        """For each reply: 1 if its move kept the game-theoretic value (`sound_moves`), 0
        if it gave some away or was invalid, plus `think_reward` if its think block read
        the board right; a reply that is not exactly a think block and a move earns 0
        whatever its move (so a drift into malformed replies meets the same per-move
        credit as a bad move, not just the format's small share of the game's reward).
        A per-move reward the env verifies with its own solver, for trainers that credit
        moves one by one (RL's `turn_reward_weight`). None when the rollout has no such
        record."""
        sound = rollout.state.get("move_sound")
        if sound is None:
            return None
        bonus = self.config["think_reward"]
        thinks = rollout.state.get("think_correct")
        if not isinstance(thinks, list) or len(thinks) != len(sound):
            thinks = [False] * len(sound)  # a rollout stored before the think record
        formed = rollout.state.get("well_formed")
        if not isinstance(formed, list) or len(formed) != len(sound):
            formed = [True] * len(sound)  # a rollout stored before the format record
        return [
            ((1.0 if s is True else 0.0) + (bonus if t else 0.0)) if f else 0.0
            for s, t, f in zip(sound, thinks, formed, strict=True)
        ]

    def validation(self) -> list[Validation]:
        """Full games (no opening moves, no self-play) against the random opponent and
        against the perfect one, scored by the choice rule: draws against optimal + wins
        against random - 2 x losses against random - 2 x the invalid-move rate (the mean
        of both sets'). `tiny-master` was chosen by it."""
        full_games = {"opening_moves": 0, "self_play": 0.0}
        invalid = {"tictactoe/invalid_move_rate": -1.0}
        return [
            Validation(
                "random",
                {**full_games, "min_random_move_prob": 1.0, "max_random_move_prob": 1.0},
                {"outcome/win": 1.0, "outcome/loss": -2.0, **invalid},
            ),
            Validation(
                "optimal",
                {**full_games, "min_random_move_prob": 0.0, "max_random_move_prob": 0.0},
                {"outcome/draw": 1.0, **invalid},
            ),
        ]

    async def exact_validation(self, policy, max_tokens: int) -> dict[str, dict]:
        """`validation`'s two sets exactly (rlcore/envs/tictactoe_exact.py): the player asked
        at every history a full game can reach, in this env's turns, and the random
        opponent's and the perfect one's trees walked; no games sampled."""
        from rlcore.envs.tictactoe_exact import OUTCOMES, exact_rates

        rates = await exact_rates(policy, self.config["max_turns"], max_tokens)
        return {
            name: {
                **{f"outcome/{outcome}": rates[name][outcome] for outcome in OUTCOMES},
                "tictactoe/invalid_move_rate": rates[name]["invalid_move_rate"],
            }
            for name in ("random", "optimal")
        }

    def move_options(self, rollout: Rollout, turn: int, reply: str) -> MoveOptions | None:
        """For a legal move the solver judged: the reply up to its last `<move>` tag, the
        cell played, and the board's other empty cells, each judged 1.0 if it keeps the
        position's game-theoretic value (`sound_moves`) and 0.0 if not: the move part of
        `turn_rewards` (the think bonus is the reply's either way). With `win_chances` a
        sound move that is not one of `oracle_best_moves` is judged 0.5."""
        sound = rollout.state.get("move_sound") or []
        key = rollout.turns[turn].state_key if turn < len(rollout.turns) else None
        if turn >= len(sound) or sound[turn] is None or not key:
            return None
        board = key.split("/")[0]
        cell, _ = parse_move(reply, board)
        start = reply.rfind("<move>") + len("<move>")
        if cell is None or reply[start : start + 1] != str(cell):
            return None  # e.g. a padded tag ("<move> 4</move>"): no one-character move to swap
        grades = _option_grades(board, rollout.state["model_mark"], self.config["win_chances"])
        played = str(cell)
        return MoveOptions(
            prefix=reply[:start],
            played=played,
            others=[option for option in grades if option != played],
            judge=lambda option: grades.get(str(int(option)), 0.0),
        )

    def breakdowns(self, rollout: Rollout) -> dict[str, str]:
        source = rollout.info if "model_mark" in rollout.info else rollout.state
        if "model_mark" not in source:
            return {}
        return {
            "starter": "model" if source["model_starts"] else "opponent",
            "mark": source["model_mark"],
        }

    def builtin_policies(self) -> dict[str, Callable[[], Policy]]:
        return {"oracle": OraclePolicy, "random": RandomValidPolicy, "constant": ConstantPolicy}

    def rollout_values(self, rollout: Rollout) -> dict[str, Any]:
        return {
            "invalid_moves": rollout.state.get("invalid_moves"),
            "random_move_prob": rollout.info.get(
                "random_move_prob", rollout.state.get("random_move_prob")
            ),
        }

    @classmethod
    def state_views(cls, state: dict) -> list[dict]:
        """The board after each move in `state["moves"]`, captioned with whose move it was;
        moves of a random opening (`opening_moves`, played before the model took over) are
        muted so they do not pass for the model's choices, and each of the model's own
        moves notes the solver's verdict (`move_verdict`) and, where the env recorded it,
        whether the reply's think block read the board right."""
        moves = state.get("moves") if isinstance(state, dict) else None
        if not isinstance(moves, list):
            return []
        thinks = _think_verdicts(state)
        model_moves = 0
        board = [EMPTY] * 9
        views = []
        for number, move in enumerate(moves, start=1):
            if not isinstance(move, dict) or not isinstance(move.get("cell"), int):
                continue
            cell, mark, player = move["cell"], str(move.get("mark", "?")), move.get("player", "")
            opening = bool(move.get("opening"))
            notes = []
            if player == "model" and not opening and 0 <= cell < 9:
                verdict = move_verdict(list(board), cell, mark)
                if verdict is not None:
                    notes.append(
                        {"name": "verdict", "ok": verdict["sound"], "text": verdict["text"]}
                    )
                if thinks is not None and model_moves < len(thinks):
                    right = thinks[model_moves]
                    text = "think: reads the board right" if right else "think: misreads the board"
                    notes.append({"name": "think-verdict", "ok": right, "text": text})
                model_moves += 1
            if 0 <= cell < 9:
                board[cell] = mark
            views.append(
                {
                    "kind": "grid",
                    "title": f"{number}. {'opening, random for ' if opening else ''}"
                    f"{player} {mark} → {cell}",
                    "rows": [
                        ["" if m == EMPTY else m for m in board[r : r + 3]] for r in (0, 3, 6)
                    ],
                    "highlight": [[cell // 3, cell % 3]] if 0 <= cell < 9 else [],
                    "tones": {"X": 1, "O": 2},
                    "muted": opening,
                    "notes": notes,
                }
            )
        return views


VALUE_NAMES = {1: "a win", 0: "the draw", -1: "a loss"}


def move_verdict(board: Sequence[str], cell: int, mark: str) -> dict | None:
    """Whether playing `mark` on `cell` keeps the game-theoretic value of `board` (the
    solver's `move_values`), as {"sound", "text"}, the text naming a win on the spot or a
    block the move missed (`missed_tactic`); None where the position is not a legal one to
    judge (a stored state from elsewhere, say)."""
    try:
        values = move_values(board, mark)
        before, after = max(values.values()), values[cell]
    except (ValueError, KeyError):
        return None
    missed = missed_tactic(board, cell, mark)
    why = f" (missed the {missed[0]} at {' or '.join(map(str, missed[1]))})" if missed else ""
    if after == before:
        if before < 0:
            return {"sound": True, "text": f"sound: already lost, no move saves it{why}"}
        return {"sound": True, "text": f"sound: keeps {VALUE_NAMES[before]}{why}"}
    return {
        "sound": False,
        "text": f"unsound: {VALUE_NAMES[before]} became {VALUE_NAMES[after]}{why}",
    }


def _think_verdicts(state: dict) -> list[bool] | None:
    """Whether the think block of each of the model's played moves read the board right,
    in move order: the env records one entry per reply in `think_correct` and
    `move_sound` (None there for an invalid reply, which played nothing). None when the
    state holds no such record or the two records disagree in length."""
    thinks, sound = state.get("think_correct"), state.get("move_sound")
    if not isinstance(thinks, list) or not isinstance(sound, list) or len(thinks) != len(sound):
        return None
    return [bool(think) for think, played in zip(thinks, sound, strict=True) if played is not None]
