"""`python manage.py seed_lab`: give the admin user something to start from (for `make run`).

Registers, for the admin user, the built-in tiny model (characters, "tiny-bpe" with merges,
and "tiny-bpe-3l" with merges and 3 layers), the shipped tic-tac-toe player "tiny-master",
the tic-tac-toe oracle and random players, and one config with the schema's defaults for
every registered environment, named "<env> (defaults)". Idempotent: what already exists
under those names is left as it is, so edits a user made survive a restart.
"""

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from rlcore.envs import list_environments
from webapp.jobs import services
from webapp.jobs.models import EnvironmentConfig, ModelEntry

MODELS = [
    {"name": "tiny", "kind": ModelEntry.Kind.TINY},
    # The same model with a tokenizer of merges learned on tic-tac-toe games, where the
    # tic-tac-toe recipes start (recipes/tictactoe_tiny/sft.toml).
    {"name": "tiny-bpe", "kind": ModelEntry.Kind.TINY, "location": "tiny-bpe"},
    # That one with 3 layers, where the CPU variant starts (recipes/tictactoe_tiny/sft_cpu.toml).
    {"name": "tiny-bpe-3l", "kind": ModelEntry.Kind.TINY, "location": "tiny-bpe-3l"},
    # The tic-tac-toe player the lab ships (rlcore/data/tiny-master/README.md), offered on Play.
    {"name": "tiny-master", "kind": ModelEntry.Kind.TINY, "location": "tiny-master"},
    {"name": "tictactoe oracle", "kind": ModelEntry.Kind.BUILTIN, "location": "oracle"},
    {"name": "tictactoe random", "kind": ModelEntry.Kind.BUILTIN, "location": "random"},
]


class Command(BaseCommand):
    help = "Register the tiny models, the tic-tac-toe built-in players and default env configs."

    def add_arguments(self, parser):
        parser.add_argument("--username", default="admin")

    def handle(self, *args, username: str, **options):
        owner = get_user_model().objects.filter(username=username).first()
        if owner is None:
            raise CommandError(
                f"no user {username!r}; run `manage.py ensure_admin` first or pass --username"
            )
        created = []
        for spec in MODELS:
            if not ModelEntry.objects.filter(owner=owner, name=spec["name"]).exists():
                services.model_create(owner=owner, **spec)
                created.append(f"model {spec['name']!r}")
        for env in list_environments():
            name = f"{env.name} (defaults)"
            if not EnvironmentConfig.objects.filter(owner=owner, name=name).exists():
                services.env_config_save(owner=owner, name=name, env_name=env.name, params={})
                created.append(f"config {name!r}")
        if created:
            self.stdout.write(f"seeded for {username!r}: " + ", ".join(created))
        else:
            self.stdout.write(f"lab already seeded for {username!r}")
