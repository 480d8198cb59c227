"""`manage.py seed_lab` gives the admin the tiny models, the tic-tac-toe players and one
default config per environment, and running it again changes nothing."""

import pytest
from django.core.management import CommandError, call_command
from django.test import Client

from rlcore.envs import list_environments
from webapp.jobs.models import EnvironmentConfig, ModelEntry

pytestmark = pytest.mark.django_db


def test_it_seeds_the_admin_once(django_user_model, capsys):
    admin = django_user_model.objects.create_superuser("admin", password="pw")
    call_command("seed_lab")
    models = {m.name: (m.kind, m.location) for m in ModelEntry.objects.filter(owner=admin)}
    assert models == {
        "tiny": ("tiny", "tiny"),
        "tiny-bpe": ("tiny", "tiny-bpe"),
        "tiny-bpe-3l": ("tiny", "tiny-bpe-3l"),
        "tiny-master": ("tiny", "tiny-master"),
        "tictactoe oracle": ("builtin", "oracle"),
        "tictactoe random": ("builtin", "random"),
    }
    configs = EnvironmentConfig.objects.filter(owner=admin)
    assert sorted(c.name for c in configs) == sorted(
        f"{e.name} (defaults)" for e in list_environments()
    )
    ttt = configs.get(name="tictactoe (defaults)")
    assert ttt.env_name == "tictactoe" and ttt.params["max_turns"] == 10  # the schema default

    ttt.params["max_turns"] = 4
    ttt.save()
    call_command("seed_lab")
    assert "already seeded" in capsys.readouterr().out
    assert ModelEntry.objects.count() == len(models) and configs.count() == len(list_environments())
    assert EnvironmentConfig.objects.get(pk=ttt.pk).params["max_turns"] == 4


def test_it_needs_the_user_to_exist():
    with pytest.raises(CommandError, match="ensure_admin"):
        call_command("seed_lab", "--username", "nobody")


def test_the_shipped_player_is_offered_on_the_play_page(django_user_model):
    from webapp.play.services import players_for_user

    admin = django_user_model.objects.create_superuser("admin", password="pw")
    call_command("seed_lab")
    master = ModelEntry.objects.get(owner=admin, name="tiny-master")
    assert master.policy_args() == {"model": "tiny-master"} and master.is_local
    players = {p.name: p for p in players_for_user(admin)}
    assert players["tiny-master"].policy == {"kind": "tiny", "model": "tiny-master"}
    client = Client()
    client.force_login(admin)
    page = client.get("/play/").content.decode()
    assert f'value="model-{master.pk}"' in page and "tiny-master (tiny model)" in page
