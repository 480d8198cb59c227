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

Besides the environment this module holds the board helpers (`winner`, `empty_cells`,
`minimax_best_moves`, `oracle_best_moves`, `render_board`), the built-in players
(`OraclePolicy`, `RandomValidPolicy`) and `PlaySession`, the web Play page's game of a
human against a policy, which builds the very messages the environment would.
"""

from __future__ import annotations

import hashlib
import random
import re
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from functools import cache
from typing import Any

from rlcore.envs.base import MultiTurnEnv, Param, example_seed
from rlcore.parsers import ThinkParser, XMLParser
from rlcore.policy.base import ConstantPolicy, Policy, PolicyError
from rlcore.rubric import Rubric
from rlcore.types import Example, Generation, Message, Rollout, SamplingParams

EMPTY = "."
MARKS = ("X", "O")
LINES = (
    (0, 1, 2),
    (3, 4, 5),
    (6, 7, 8),
    (0, 3, 6),
    (1, 4, 7),
    (2, 5, 8),
    (0, 4, 8),
    (2, 4, 6),
)
# A win pays 1; the draw and loss rewards are env params (an unfinished game pays the loss
# reward), these their defaults.
OUTCOME_REWARD = {"win": 1.0, "draw": 0.5, "loss": 0.0}
# What a think block reads off the board (`think_text`).
REASONING_FORMATS = ("empty", "threats")
MOVE_FORMAT_HINT = "reply with <move>N</move>, N in 0-8"
# The longest move tag content read as a number ("+04" and "008" still are).
MAX_MOVE_CHARS = 4

# ---------------------------------------------------------------------------------------
# Board helpers


def _board_string(board: Sequence[str] | str) -> str:
    """The board as a 9-character string, or ValueError naming what was wrong."""
    text = board if isinstance(board, str) else "".join(board)
    if len(text) != 9 or any(cell not in ("X", "O", EMPTY) for cell in text):
        raise ValueError(f"a board is 9 cells, each 'X', 'O' or '{EMPTY}'; got {board!r}")
    return text


def _check_mark(mark: str) -> str:
    if mark not in MARKS:
        raise ValueError(f"a mark is 'X' or 'O', got {mark!r}")
    return mark


def other_mark(mark: str) -> str:
    return "O" if _check_mark(mark) == "X" else "X"


def winner(board: Sequence[str] | str) -> str | None:
    """'X' or 'O' if that mark has three in a row, else None."""
    text = _board_string(board)
    for a, b, c in LINES:
        if text[a] != EMPTY and text[a] == text[b] == text[c]:
            return text[a]
    return None


def empty_cells(board: Sequence[str] | str) -> list[int]:
    return [i for i, cell in enumerate(_board_string(board)) if cell == EMPTY]


def game_over(board: Sequence[str] | str) -> bool:
    return winner(board) is not None or not empty_cells(board)


def render_board(board: Sequence[str] | str) -> str:
    """Three rows of three characters, the form every prompt shows: 'X', 'O', or the
    cell's number where it is empty ("X1O" / "3X5" / "678"). Numbering the empty cells in
    place means a model reads the legal moves off the board instead of counting positions."""
    text = _board_string(board)
    cells = [str(i) if mark == EMPTY else mark for i, mark in enumerate(text)]
    return "\n".join("".join(cells[row : row + 3]) for row in (0, 3, 6))


@cache
def _position_score(board: str, player: str) -> int:
    """Minimax score of `board` for `player` to move: positive wins, 0 draws, negative
    losses; a win counts 1 + the cells still empty when it lands, so sooner is bigger."""
    if winner(board) is not None:
        # Only the player who just moved can have completed a line.
        return -(1 + board.count(EMPTY))
    scores = _move_scores(board, player)
    return max(score for _, score in scores) if scores else 0


@cache
def _move_scores(board: str, player: str) -> tuple[tuple[int, int], ...]:
    """(cell, score for `player`) for every empty cell, searched exhaustively."""
    opponent = "O" if player == "X" else "X"
    scores = []
    for cell, mark in enumerate(board):
        if mark == EMPTY:
            child = board[:cell] + player + board[cell + 1 :]
            scores.append((cell, -_position_score(child, opponent)))
    return tuple(scores)


def game_value(board: Sequence[str] | str, player: str) -> int:
    """The game-theoretic value for `player` to move under perfect play: 1, 0 or -1."""
    score = _position_score(_board_string(board), _check_mark(player))
    return (score > 0) - (score < 0)


def move_values(board: Sequence[str] | str, player: str) -> dict[int, int]:
    """For every empty cell, the game-theoretic value (1, 0 or -1) for `player` after
    playing there; the position's own `game_value` is the best of them."""
    text = _board_string(board)
    _check_mark(player)
    if game_over(text):
        raise ValueError(f"no moves: the game on board {text!r} is over")
    return {cell: (score > 0) - (score < 0) for cell, score in _move_scores(text, player)}


def sound_moves(board: Sequence[str] | str, player: str) -> list[int]:
    """Every cell whose move keeps the game-theoretic value for `player` (`game_value`):
    from a won position the moves that still win, from a drawn one those that still draw,
    from a lost one every move. A player who only ever makes sound moves never loses a
    game it could draw and never draws one it could win; unlike `minimax_best_moves`,
    slower wins and every drawing move count."""
    values = move_values(board, player)
    best = max(values.values())
    return [cell for cell, value in values.items() if value == best]


def minimax_best_moves(board: Sequence[str] | str, player: str) -> list[int]:
    """Every cell with the best minimax score for `player`, in board order.

    Scores favour sooner wins and later losses, so from a won position only the fastest
    wins are listed and from a lost one only the moves that hold out longest. Callers pick
    among the list at random; taking the first would make a predictable player.
    """
    text = _board_string(board)
    _check_mark(player)
    if game_over(text):
        raise ValueError(f"no moves: the game on board {text!r} is over")
    scores = _move_scores(text, player)
    best = max(score for _, score in scores)
    return [cell for cell, score in scores if score == best]


@cache
def _win_chance(board: str, player: str, to_move: str) -> Fraction:
    """Chance that `player`, always choosing among `oracle_best_moves`, beats an opponent
    who plays uniformly at random; exact fractions so symmetric moves tie exactly."""
    won_by = winner(board)
    if won_by is not None or EMPTY not in board:
        return Fraction(int(won_by == player))
    next_to_move = "O" if to_move == "X" else "X"
    if to_move == player:
        return max(_safe_move_chances(board, player).values())
    chances = [
        _win_chance(board[:cell] + to_move + board[cell + 1 :], player, next_to_move)
        for cell in empty_cells(board)
    ]
    return sum(chances, Fraction(0)) / len(chances)


@cache
def _safe_move_chances(board: str, player: str) -> dict[int, Fraction]:
    opponent = "O" if player == "X" else "X"
    return {
        cell: _win_chance(board[:cell] + player + board[cell + 1 :], player, opponent)
        for cell in minimax_best_moves(board, player)
    }


def oracle_best_moves(board: Sequence[str] | str, player: str) -> list[int]:
    """The oracle's candidates: among `minimax_best_moves` (so it never loses and wins as
    fast as it can), those that give an opponent playing at random the most chances to
    go wrong. Exact ties (symmetric cells, say) all stay in, to be picked at random."""
    text = _board_string(board)
    chances = _safe_move_chances(text, _check_mark(player))
    best = max(chances.values())
    return [cell for cell, chance in chances.items() if chance == best]


def stable_seed(*parts: Any) -> int:
    """A 63-bit seed from the parts' text (sha256, unlike hash(), is the same every run)."""
    digest = hashlib.sha256(":".join(str(part) for part in parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def turn_seed(seed: int, board: Sequence[str] | str) -> int:
    """The opponent's seed on `board` in the game of example seed `seed`."""
    return stable_seed(seed, _board_string(board))


def opponent_move(board: Sequence[str] | str, mark: str, random_move_prob: float, seed: int) -> int:
    """The opponent's reply: a random empty cell with probability `random_move_prob`, else
    a minimax best move chosen uniformly; fully determined by (seed, board)."""
    text = _board_string(board)
    rng = random.Random(turn_seed(seed, text))
    if rng.random() < random_move_prob:
        return rng.choice(empty_cells(text))
    return rng.choice(minimax_best_moves(text, mark))


# ---------------------------------------------------------------------------------------
# Replies and messages (shared by the environment and PlaySession)

_think_parser = ThinkParser()
_move_parser = XMLParser(["move"])
_STRICT_REPLY = re.compile(r"\s*<think>.*?</think>\s*<move>\s*[0-9]+\s*</move>\s*", re.DOTALL)


def is_well_formatted(text: str | None) -> bool:
    """Whether a reply is exactly a think block then a move tag holding a number
    (whitespace around them allowed, nothing else)."""
    return _STRICT_REPLY.fullmatch(text or "") is not None


def parse_move(text: str | None, board: Sequence[str] | str) -> tuple[int | None, str | None]:
    """(cell, None) for a valid move on `board`, else (None, what was wrong).

    The move is the last `<move>` tag after the optional think block, so a move merely
    mentioned while thinking does not count.
    """
    _, answer = _think_parser.parse(text)
    raw = _move_parser.parse_answer(answer, "move")
    if raw is None or not re.fullmatch(r"[+-]?[0-9]+", raw):
        return None, MOVE_FORMAT_HINT
    if len(raw) > MAX_MOVE_CHARS:
        # Never int(raw): int() refuses more than 4300 digits. A cell number is one digit;
        # a tag this long is not a move, however many of its digits are leading zeros.
        return None, f"the move {raw[:8]}... is {len(raw)} characters long; {MOVE_FORMAT_HINT}"
    cell = int(raw)
    if not 0 <= cell <= 8:
        return None, f"cell {cell} is not in 0-8"
    if _board_string(board)[cell] != EMPTY:
        return None, f"cell {cell} is taken"
    return cell, None


def system_prompt(model_mark: str) -> str:
    return (
        f"You play tic-tac-toe as {_check_mark(model_mark)}. Empty cells show their number 0-8. "
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


def result_for(board: Sequence[str] | str, model_mark: str) -> str | None:
    """'win', 'loss' or 'draw' from the model's view once the game is over, else None."""
    won_by = winner(board)
    if won_by is not None:
        return "win" if won_by == model_mark else "loss"
    return "draw" if not empty_cells(board) else None


def random_opening(board: list[str], model_mark: str, rounds: int, rng: random.Random) -> list[int]:
    """Play up to `rounds` random (model move, opponent reply) pairs on `board` in place and
    return their cells in order. Only pairs after which the game goes on are drawn, so the
    model always has a live position to move in; it stops early when none is left."""
    opponent_mark = other_mark(model_mark)
    cells: list[int] = []
    for _ in range(rounds):
        pairs = []
        for mine in empty_cells(board):
            after = board[:mine] + [model_mark] + board[mine + 1 :]
            if game_over(after):
                continue
            for theirs in empty_cells(after):
                final = after[:theirs] + [opponent_mark] + after[theirs + 1 :]
                if not game_over(final):
                    pairs.append((mine, theirs))
        if not pairs:
            break
        mine, theirs = rng.choice(pairs)
        board[mine], board[theirs] = model_mark, opponent_mark
        cells.extend((mine, theirs))
    return cells


def _play(board: list[str], moves: list[dict], cell: int, mark: str, player: str) -> None:
    board[cell] = mark
    moves.append({"player": player, "mark": mark, "cell": cell})


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
    return sum(is_well_formatted(text) for text in replies) / len(replies)


# ---------------------------------------------------------------------------------------
# The environment


class TicTacToeEnv(MultiTurnEnv):
    """Tic-tac-toe against a seeded minimax opponent that plays randomly with probability p."""

    name = "tictactoe"
    outcome_labels = ("win", "draw", "loss", "unfinished")
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
            },
        )

    def setup_state(self, example: Example) -> dict:
        model_mark = example.info["model_mark"]
        state = {
            "seed": example.seed,
            "board": [EMPTY] * 9,
            "winner": None,
            "model_mark": model_mark,
            "opponent_mark": other_mark(model_mark),
            "random_move_prob": example.info["random_move_prob"],
            "model_starts": example.info["model_starts"],
            "moves": [],
            # Per model reply: whether its move was sound (kept the game-theoretic value),
            # None for an invalid reply.
            "move_sound": [],
            # Per model reply: whether its think block read the board right (`think_text`).
            "think_correct": [],
            "reasoning": self.config["reasoning"],
            "invalid_moves": 0,
            "model_turns": 0,
        }
        first_move = example.info["opponent_first_move"]
        if first_move is not None:
            _play(state["board"], state["moves"], first_move, state["opponent_mark"], "opponent")
        opening = example.info.get("opening", [])
        for index, cell in enumerate(opening):
            mark, player = (
                (model_mark, "model") if index % 2 == 0 else (state["opponent_mark"], "opponent")
            )
            _play(state["board"], state["moves"], cell, mark, player)
            state["moves"][-1]["opening"] = True
        return state

    def is_completed(self, messages: list[Message], state: dict) -> bool:
        return game_over(state["board"])

    def decision_key(self, messages: list[Message], state: dict) -> str:
        """The board and the model turns used: with the opponent seeded by the board, the
        rest of the game depends on nothing else, whatever was thought on the way."""
        return f"{''.join(state['board'])}/{state['model_turns']}"

    def env_response(self, messages: list[Message], state: dict) -> list[Message]:
        state["model_turns"] += 1
        board = state["board"]
        reply = messages[-1].get("content")
        expected = think_text(board, state["model_mark"], state["reasoning"])
        state["think_correct"].append(_think_parser.think(reply) == expected)
        cell, error = parse_move(reply, board)
        if error is not None:
            state["invalid_moves"] += 1
            state["move_sound"].append(None)
            return [{"role": "user", "content": board_message(board, error=error)}]
        state["move_sound"].append(cell in sound_moves(board, state["model_mark"]))
        _play(board, state["moves"], cell, state["model_mark"], "model")
        opponent_cell = None
        if not game_over(board):
            opponent_cell = opponent_move(
                board, state["opponent_mark"], state["random_move_prob"], state["seed"]
            )
            _play(board, state["moves"], opponent_cell, state["opponent_mark"], "opponent")
        state["winner"] = winner(board)
        content = board_message(
            board,
            opponent_cell=opponent_cell,
            result=result_for(board, state["model_mark"]),
        )
        return [{"role": "user", "content": content}]

    def outcome(self, state: dict, rewards: dict[str, float]) -> str:
        return outcome_label(state)

    def rollout_metrics(self, rollout: Rollout) -> dict[str, float]:
        invalid = rollout.state.get("invalid_moves", 0)
        turns = rollout.state.get("model_turns", 0)
        sound = rollout.state.get("move_sound", [])
        thinks = rollout.state.get("think_correct", [])
        return {
            "invalid_moves": float(invalid),
            "invalid_move_rate": invalid / turns if turns else 0.0,
            "format_rate": format_reward(completion=rollout.completion),
            # Share of the model's replies that were sound moves (an invalid one is not).
            "sound_move_rate": sum(s is True for s in sound) / len(sound) if sound else 0.0,
            # Share of the model's replies whose think block stated the board's facts
            # exactly as the env's `reasoning` format does.
            "think_correct_rate": sum(thinks) / len(thinks) if thinks else 0.0,
        }

    def turn_rewards(self, rollout: Rollout) -> list[float] | None:
        """For each reply: 1 if its move kept the game-theoretic value (`sound_moves`), 0
        if it gave some away or was invalid, plus `think_reward` if its think block read
        the board right. A per-move reward the env verifies with its own solver, for
        trainers that credit moves one by one (RL's `turn_reward_weight`). None when the
        rollout has no such record."""
        sound = rollout.state.get("move_sound")
        if sound is None:
            return None
        bonus = self.config["think_reward"]
        thinks = rollout.state.get("think_correct")
        if not isinstance(thinks, list) or len(thinks) != len(sound):
            thinks = [False] * len(sound)  # a rollout stored before the think record
        return [
            (1.0 if s is True else 0.0) + (bonus if t else 0.0)
            for s, t in zip(sound, thinks, strict=True)
        ]

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


# ---------------------------------------------------------------------------------------
# Built-in players


def winning_cells(board: Sequence[str] | str, mark: str) -> list[int]:
    """The empty cells that would complete a line of `mark` (a win for it on the spot)."""
    text = _board_string(board)
    _check_mark(mark)
    cells = set()
    for line in LINES:
        marks = [text[i] for i in line]
        if marks.count(mark) == 2 and marks.count(EMPTY) == 1:
            cells.add(line[marks.index(EMPTY)])
    return sorted(cells)


def think_text(board: Sequence[str] | str, mark: str, reasoning: str = "empty") -> str:
    """What the built-in players think before moving as `mark`, in `reasoning` format:
    'Empty: 0 4 8.' and, for 'threats', 'Win: 2. Block: none.' (the cells where `mark`
    completes a line, then those where the opponent would). Facts about the board only,
    never the choice: the env counts a model's think block right when it equals this."""
    if reasoning not in REASONING_FORMATS:
        raise ValueError(f"reasoning must be one of {REASONING_FORMATS}, got {reasoning!r}")
    text = f"Empty: {_cell_list(empty_cells(board))}."
    if reasoning == "threats":
        wins = _cell_list(winning_cells(board, mark))
        blocks = _cell_list(winning_cells(board, other_mark(mark)))
        text += f" Win: {wins}. Block: {blocks}."
    return text


def _cell_list(cells: list[int]) -> str:
    return " ".join(map(str, cells)) or "none"


def think_reply(
    board: Sequence[str] | str, move: int, mark: str = "X", reasoning: str = "empty"
) -> str:
    """The built-in players' reply: the board read in the think block (`think_text`),
    then the move.

    The think block states facts (empty cells, and for 'threats' the lines one move from
    done); the choice itself is left to the move tag alone (a "I pick N." in the think
    block, decided there and copied into the tag, made SFT'd models play more invalid
    moves and learn slower under RL: docs/mastery.md)."""
    return f"<think>{think_text(board, mark, reasoning)}</think><move>{move}</move>"


class _BoardPolicy(Policy):
    """A player that reads the board and its mark from the tic-tac-toe `state` it is handed.

    Its randomness is seeded per call from (policy seed, sampling seed, state seed, board),
    so a rerun replays the same games while different boards get independent draws.
    """

    def __init__(self, seed: int = 0):
        self.seed = seed

    def _board_and_rng(self, sampling: SamplingParams, state: dict | None):
        if not state or "board" not in state or "model_mark" not in state:
            raise PolicyError(
                f"{type(self).__name__} plays tic-tac-toe only: it needs the env state with "
                f"'board' and 'model_mark', got {sorted(state or {})}"
            )
        board = _board_string(state["board"])
        rng = random.Random(
            stable_seed(self.name, self.seed, sampling.seed, state.get("seed", 0), board)
        )
        return board, state["model_mark"], rng

    def _think_reply(self, board: str, move: int, state: dict) -> Generation:
        """The reply in the reasoning format of the env whose `state` this is."""
        reasoning = state.get("reasoning", "empty")
        return self._reply(think_reply(board, move, state["model_mark"], reasoning))

    @staticmethod
    def _reply(text: str) -> Generation:
        return Generation(text=text, completion_tokens=len(text.split()))


class OraclePolicy(_BoardPolicy):
    """Perfect play: never loses, wins as fast as it can, and in drawn positions prefers the
    moves that leave a fallible opponent the most ways to lose (`oracle_best_moves`);
    uniform among equally good moves."""

    name = "oracle"

    async def generate(self, messages, sampling, *, tools=None, state=None) -> Generation:
        board, mark, rng = self._board_and_rng(sampling, state)
        move = rng.choice(oracle_best_moves(board, mark))
        return self._think_reply(board, move, state)


class RandomValidPolicy(_BoardPolicy):
    """A uniformly random empty cell, in the exact reply format."""

    name = "random"

    async def generate(self, messages, sampling, *, tools=None, state=None) -> Generation:
        board, _, rng = self._board_and_rng(sampling, state)
        move = rng.choice(empty_cells(board))
        return self._think_reply(board, move, state)


# ---------------------------------------------------------------------------------------
# Play page


@dataclass
class PlaySession:
    """One game of a human against a policy, for the web Play page; JSON via to_dict().

    The model (the policy) sees exactly the conversation the environment would build: the
    same system prompt, boards and messages, with the human as "Opponent". Flow: create
    with `PlaySession.new(model_mark, model_starts)`; while not `finished`, call
    `human_move(cell)` or `await model_turn(policy, sampling)` according to `to_move`.
    An invalid model reply gets the env's error message and another try, each counted in
    `invalid_moves`; if all `max_attempts` tries of one turn are invalid the model
    forfeits: the game ends, `winner` is the human's mark and `outcome` is "unfinished".
    `outcome` is from the model's view: "win", "draw", "loss", "unfinished" (forfeit), or
    None while the game is on. `moves` are {"player", "mark", "cell"} in order, with the
    human as player "opponent", as in the environment's final state. A PolicyError from
    the policy propagates; the session stays consistent and it is still the model's turn.
    """

    model_mark: str
    model_starts: bool
    seed: int
    board: list[str] = field(default_factory=lambda: [EMPTY] * 9)
    moves: list[dict] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    invalid_moves: int = 0
    forfeited: bool = False

    @classmethod
    def new(cls, model_mark: str, model_starts: bool, seed: int | None = None) -> PlaySession:
        """A fresh game; `seed` feeds the built-in players' tie-breaks (random if None)."""
        _check_mark(model_mark)
        if not isinstance(model_starts, bool):
            raise ValueError(f"model_starts must be true or false, got {model_starts!r}")
        session = cls(
            model_mark=model_mark,
            model_starts=model_starts,
            seed=secrets.randbits(31) if seed is None else seed,
        )
        session.messages.append({"role": "system", "content": system_prompt(model_mark)})
        if model_starts:
            session.messages.append({"role": "user", "content": board_message(session.board)})
        return session

    def to_dict(self) -> dict:
        return {
            "model_mark": self.model_mark,
            "model_starts": self.model_starts,
            "seed": self.seed,
            "board": list(self.board),
            "moves": [dict(move) for move in self.moves],
            "messages": [dict(message) for message in self.messages],
            "invalid_moves": self.invalid_moves,
            "forfeited": self.forfeited,
        }

    @classmethod
    def from_dict(cls, data: dict) -> PlaySession:
        missing = {"model_mark", "model_starts", "seed", "board", "moves", "messages"} - set(data)
        if missing:
            raise ValueError(f"a PlaySession dict needs {sorted(missing)}; got keys {sorted(data)}")
        session = cls(
            model_mark=_check_mark(data["model_mark"]),
            model_starts=bool(data["model_starts"]),
            seed=int(data["seed"]),
            board=list(_board_string(data["board"])),
            moves=[dict(move) for move in data["moves"]],
            messages=[dict(message) for message in data["messages"]],
            invalid_moves=int(data.get("invalid_moves", 0)),
            forfeited=bool(data.get("forfeited", False)),
        )
        return session

    @property
    def human_mark(self) -> str:
        return other_mark(self.model_mark)

    @property
    def finished(self) -> bool:
        return self.forfeited or game_over(self.board)

    @property
    def winner(self) -> str | None:
        return self.human_mark if self.forfeited else winner(self.board)

    @property
    def outcome(self) -> str | None:
        return "unfinished" if self.forfeited else result_for(self.board, self.model_mark)

    @property
    def to_move(self) -> str | None:
        """'model' or 'human', or None once the game is over."""
        if self.finished:
            return None
        if not self.moves:
            return "model" if self.model_starts else "human"
        return "human" if self.moves[-1]["player"] == "model" else "model"

    def policy_state(self) -> dict:
        """The state a built-in player reads, shaped like the environment's."""
        return {
            "seed": self.seed,
            "board": list(self.board),
            "model_mark": self.model_mark,
            "opponent_mark": self.human_mark,
            "model_starts": self.model_starts,
            "moves": [dict(move) for move in self.moves],
            "invalid_moves": self.invalid_moves,
        }

    def human_move(self, cell: int | str) -> None:
        """Play the human's mark on `cell` (0-8); ValueError if it is not allowed now."""
        if self.finished:
            raise ValueError(f"the game is over (outcome for the model: {self.outcome})")
        if self.to_move != "human":
            raise ValueError("it is the model's turn, not the human's")
        if isinstance(cell, str) and re.fullmatch(r"\s*\d+\s*", cell):
            cell = int(cell)
        if isinstance(cell, bool) or not isinstance(cell, int) or not 0 <= cell <= 8:
            raise ValueError(f"cell must be an integer from 0 to 8, got {cell!r}")
        if self.board[cell] != EMPTY:
            raise ValueError(
                f"cell {cell} is taken by {self.board[cell]}; empty: {empty_cells(self.board)}"
            )
        _play(self.board, self.moves, cell, self.human_mark, "opponent")
        content = board_message(
            self.board, opponent_cell=cell, result=result_for(self.board, self.model_mark)
        )
        self.messages.append({"role": "user", "content": content})

    async def model_turn(
        self, policy: Policy, sampling: SamplingParams | None = None, max_attempts: int = 3
    ) -> dict:
        """Ask `policy` for its move, retrying invalid replies as the environment does.

        Returns {text, think, move, valid, error, attempts} for the last reply; `error` is
        what was wrong with it (None when valid). Forfeits after `max_attempts` bad tries.
        """
        if self.finished:
            raise ValueError(f"the game is over (outcome for the model: {self.outcome})")
        if self.to_move != "model":
            raise ValueError("it is the human's turn, not the model's")
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {max_attempts!r}")
        sampling = sampling or SamplingParams()
        for attempt in range(1, max_attempts + 1):
            generation = await policy.generate(self.messages, sampling, state=self.policy_state())
            text = generation.text
            self.messages.append({"role": "assistant", "content": text})
            cell, error = parse_move(text, self.board)
            think = _think_parser.think(text)
            if error is None:
                _play(self.board, self.moves, cell, self.model_mark, "model")
                if self.finished:
                    result = result_for(self.board, self.model_mark)
                    self.messages.append(
                        {"role": "user", "content": board_message(self.board, result=result)}
                    )
                return {
                    "text": text,
                    "think": think,
                    "move": cell,
                    "valid": True,
                    "error": None,
                    "attempts": attempt,
                }
            self.invalid_moves += 1
            self.messages.append(
                {"role": "user", "content": board_message(self.board, error=error)}
            )
        self.forfeited = True
        return {
            "text": text,
            "think": think,
            "move": None,
            "valid": False,
            "error": error,
            "attempts": max_attempts,
        }
