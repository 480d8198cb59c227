"""The Play page's forms: a new game (opponent, your mark, who starts) and one move."""

from __future__ import annotations

from django import forms

from webapp.play.services import players_for_user


class NewGameForm(forms.Form):
    player = forms.ChoiceField(label="Opponent")
    human_mark = forms.ChoiceField(
        label="You play", choices=[("X", "X"), ("O", "O")], initial="X", widget=forms.RadioSelect
    )
    starts = forms.ChoiceField(
        label="Who starts",
        choices=[("human", "you"), ("model", "the model")],
        initial="human",
        widget=forms.RadioSelect,
    )

    def __init__(self, *args, user, **kwargs):
        super().__init__(*args, **kwargs)
        self.players = players_for_user(user)
        self.fields["player"].choices = [(p.key, _label(p)) for p in self.players]
        if self.players and not self.is_bound:
            self.initial.setdefault("player", self.players[0].key)

    def create_args(self) -> dict:
        data = self.cleaned_data
        return {
            "player_key": data["player"],
            "human_mark": data["human_mark"],
            "human_starts": data["starts"] == "human",
        }


def _label(player) -> str:
    kind = {"builtin": "built-in player", "tiny": "tiny model", "openai": "endpoint"}.get(
        player.kind, player.kind
    )
    return player.name if player.name.endswith("(built-in)") else f"{player.name} ({kind})"


class MoveForm(forms.Form):
    cell = forms.IntegerField(min_value=0, max_value=8)
