"""A game of tic-tac-toe between a person and a model, as the Play page keeps it.

The whole game lives in `session`, the JSON form of rlcore's PlaySession (board, moves,
the conversation the model saw); the other columns are what pages filter and count on.
`replies` keeps every reply the model gave, invalid ones included, with its reasoning
and what was wrong with it. `outcome` is from the model's view (win, draw, loss, or
unfinished when it forfeited), like the environment's rollouts; `result_text` says the
same thing to the person who played.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.urls import reverse
from django.utils import timezone

from rlcore.envs.tictactoe_game import LINES
from rlcore.envs.tictactoe_play import PlaySession


class Game(models.Model):
    class Status(models.TextChoices):
        HUMAN_TURN = "human_turn", "your turn"
        MODEL_TURN = "model_turn", "the model is thinking"
        MODEL_FAILED = "model_failed", "the model could not be asked"
        FINISHED = "finished", "finished"

    class Outcome(models.TextChoices):
        WIN = "win", "win"
        DRAW = "draw", "draw"
        LOSS = "loss", "loss"
        UNFINISHED = "unfinished", "unfinished (forfeit)"

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE)
    model = models.ForeignKey(
        "jobs.ModelEntry", null=True, blank=True, on_delete=models.SET_NULL, related_name="games"
    )
    player = models.CharField(
        max_length=100,
        help_text="Which player this was: 'model-<id>' for a registered model, "
        "'builtin-<name>' for an environment's built-in player. Games are counted by it.",
    )
    player_name = models.CharField(max_length=200)
    policy = models.JSONField(
        default=dict, help_text="kind, model, base_url, api_key_env: how a worker loads it."
    )
    sampling = models.JSONField(default=dict)
    max_attempts = models.PositiveSmallIntegerField(default=3)
    model_mark = models.CharField(max_length=1)
    model_starts = models.BooleanField()
    session = models.JSONField(default=dict)
    replies = models.JSONField(default=list)
    status = models.CharField(max_length=20, choices=Status.choices)
    outcome = models.CharField(max_length=20, choices=Outcome.choices, blank=True)
    error = models.TextField(blank=True)
    task_id = models.CharField(max_length=100, blank=True)
    created = models.DateTimeField(default=timezone.now)
    updated = models.DateTimeField(auto_now=True)
    finished = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created"]
        indexes = [models.Index(fields=["owner", "player", "-created"])]

    def __str__(self) -> str:
        return f"game {self.pk}: {self.player_name} as {self.model_mark}"

    def get_absolute_url(self) -> str:
        return reverse("play:game", args=[self.pk])

    @property
    def group_name(self) -> str:
        """The Channels group told when the game changes."""
        return f"play-{self.pk}"

    def play_session(self) -> PlaySession:
        return PlaySession.from_dict(self.session)

    @property
    def human_mark(self) -> str:
        return "O" if self.model_mark == "X" else "X"

    @property
    def moves(self) -> list[dict]:
        return self.session.get("moves", [])

    @property
    def board(self) -> list[str]:
        return self.session.get("board", ["."] * 9)

    @property
    def winning_line(self) -> list[int]:
        """The three cells of the completed line, if someone has one."""
        board = self.board
        for line in LINES:
            if board[line[0]] != "." and board[line[0]] == board[line[1]] == board[line[2]]:
                return list(line)
        return []

    @property
    def is_finished(self) -> bool:
        return self.status == self.Status.FINISHED

    @property
    def invalid_replies(self) -> int:
        return sum(1 for reply in self.replies if not reply.get("valid"))

    @property
    def result_text(self) -> str:
        """How the game ended, said to the person who played it."""
        if self.outcome == self.Outcome.WIN:
            return f"{self.player_name} won."
        if self.outcome == self.Outcome.LOSS:
            return "You won."
        if self.outcome == self.Outcome.DRAW:
            return "Draw."
        if self.outcome == self.Outcome.UNFINISHED:
            return (
                f"{self.player_name} forfeited after {self.max_attempts} invalid replies "
                "in a row: you won."
            )
        return ""

    @property
    def status_text(self) -> str:
        if self.status == self.Status.FINISHED:
            return self.result_text
        if self.status == self.Status.HUMAN_TURN:
            return f"Your move ({self.human_mark})."
        if self.status == self.Status.MODEL_TURN:
            return f"{self.player_name} ({self.model_mark}) is thinking…"
        return f"{self.player_name} could not be asked for its move: {self.error}"

    def to_dict(self) -> dict:
        return {
            "id": self.pk,
            "player": self.player,
            "player_name": self.player_name,
            "model": self.model_id,
            "model_mark": self.model_mark,
            "human_mark": self.human_mark,
            "model_starts": self.model_starts,
            "status": self.status,
            "status_text": self.status_text,
            "board": self.board,
            "moves": self.moves,
            "winning_line": self.winning_line,
            "replies": self.replies,
            "invalid_replies": self.invalid_replies,
            "max_attempts": self.max_attempts,
            "outcome": self.outcome or None,
            "result_text": self.result_text,
            "error": self.error,
            "messages": self.session.get("messages", []),
            "created": self.created.isoformat(),
            "finished": self.finished.isoformat() if self.finished else None,
            "url": self.get_absolute_url(),
        }
