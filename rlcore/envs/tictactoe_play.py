"""The web Play page's game: a person against a policy, judged by the environment's own code.

The policy sees exactly the conversation `TicTacToeEnv` would build (the same system
prompt, boards and messages, with the person as "Opponent"), and each of its replies goes
through the env's `model_reply` on a state of the env's own shape (`game_state`), so an
invalid reply is judged, counted and answered (`retry_message`) as in a rollout. The one
rule of the Play page's own: a person is waiting, so a model that gives `max_attempts`
invalid replies in one turn forfeits (the env instead counts every reply toward
`max_turns` and leaves the game unfinished).
"""

from __future__ import annotations

import copy
import re
import secrets
from dataclasses import dataclass, field

from rlcore.envs.tictactoe import (
    board_message,
    game_state,
    model_reply,
    retry_message,
    system_prompt,
)
from rlcore.envs.tictactoe_game import (
    EMPTY,
    board_string,
    check_mark,
    empty_cells,
    game_over,
    other_mark,
    play_move,
    result_for,
    think_parser,
    winner,
)
from rlcore.policy.base import Policy
from rlcore.types import Message, SamplingParams

# The parts of the env's state a stored game keeps besides the board and the moves.
_RECORDS = ("invalid_moves", "model_turns", "move_sound", "think_correct", "well_formed")


@dataclass
class PlaySession:
    """One game of a human against a policy, for the web Play page; JSON via to_dict().

    Flow: create with `PlaySession.new(model_mark, model_starts)`; while not `finished`,
    call `human_move(cell)` or `await model_turn(policy, sampling)` according to `to_move`.
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
    # The env's game state (`game_state`): board, moves and the per-reply records.
    state: dict
    messages: list[Message] = field(default_factory=list)
    forfeited: bool = False

    @classmethod
    def new(cls, model_mark: str, model_starts: bool, seed: int | None = None) -> PlaySession:
        """A fresh game; `seed` feeds the built-in players' tie-breaks (random if None)."""
        check_mark(model_mark)
        if not isinstance(model_starts, bool):
            raise ValueError(f"model_starts must be true or false, got {model_starts!r}")
        seed = secrets.randbits(31) if seed is None else seed
        session = cls(
            model_mark=model_mark,
            model_starts=model_starts,
            seed=seed,
            state=_human_opponent_state(seed, model_mark, model_starts),
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
            "forfeited": self.forfeited,
            **{name: copy.deepcopy(self.state[name]) for name in _RECORDS},
        }

    @classmethod
    def from_dict(cls, data: dict) -> PlaySession:
        missing = {"model_mark", "model_starts", "seed", "board", "moves", "messages"} - set(data)
        if missing:
            raise ValueError(f"a PlaySession dict needs {sorted(missing)}; got keys {sorted(data)}")
        model_mark, model_starts = check_mark(data["model_mark"]), bool(data["model_starts"])
        state = _human_opponent_state(int(data["seed"]), model_mark, model_starts)
        state["board"] = list(board_string(data["board"]))
        state["moves"] = [dict(move) for move in data["moves"]]
        state["winner"] = winner(state["board"])
        # Games stored before the records were kept have only the invalid-move count.
        state["invalid_moves"] = int(data.get("invalid_moves", 0))
        for name in ("model_turns", "move_sound", "think_correct", "well_formed"):
            if name in data:
                state[name] = copy.deepcopy(data[name])
        return cls(
            model_mark=model_mark,
            model_starts=model_starts,
            seed=int(data["seed"]),
            state=state,
            messages=[dict(message) for message in data["messages"]],
            forfeited=bool(data.get("forfeited", False)),
        )

    @property
    def board(self) -> list[str]:
        return self.state["board"]

    @property
    def moves(self) -> list[dict]:
        return self.state["moves"]

    @property
    def invalid_moves(self) -> int:
        return self.state["invalid_moves"]

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
        """The state a built-in player reads: a copy of the env's, so a policy cannot
        change the game."""
        return copy.deepcopy(self.state)

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
        play_move(self.board, self.moves, cell, self.human_mark, "opponent")
        self.state["winner"] = winner(self.board)
        content = board_message(
            self.board, opponent_cell=cell, result=result_for(self.board, self.model_mark)
        )
        self.messages.append({"role": "user", "content": content})

    async def model_turn(
        self, policy: Policy, sampling: SamplingParams | None = None, max_attempts: int = 3
    ) -> dict:
        """Ask `policy` for its move, each reply judged by the env's `model_reply`.

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
            cell, error = model_reply(self.state, text)
            turn = {
                "text": text,
                "think": think_parser.think(text),
                "move": cell,
                "valid": error is None,
                "error": error,
                "attempts": attempt,
            }
            if error is None:
                if self.finished:
                    result = result_for(self.board, self.model_mark)
                    self.messages.append(
                        {"role": "user", "content": board_message(self.board, result=result)}
                    )
                return turn
            self.messages.append(retry_message(self.state, error))
        self.forfeited = True
        return turn


def _human_opponent_state(seed: int, model_mark: str, model_starts: bool) -> dict:
    # No random_move_prob: the person is the opponent.
    return game_state(
        seed=seed, model_mark=model_mark, model_starts=model_starts, random_move_prob=None
    )
