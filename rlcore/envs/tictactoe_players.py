"""Tic-tac-toe's built-in players: the oracle (perfect play, `OraclePolicy`) and a random
legal mover (`RandomValidPolicy`), both replying in the exact format the environment asks
for, their think block reading the board (`think_reply`). They read the board and their
mark from the env `state` a rollout (or the Play page's game) hands them.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from rlcore.envs.tictactoe_game import (
    board_string,
    empty_cells,
    oracle_best_moves,
    stable_seed,
    think_text,
)
from rlcore.policy.base import Policy, PolicyError
from rlcore.types import Generation, SamplingParams


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
        board = board_string(state["board"])
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
