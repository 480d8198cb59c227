"""Rollout.facts replaces the tic-tac-toe columns invalid_moves and random_move_prob.

Each environment declares the facts the inspector filters on and the worker stores their
values in one JSON field, so a new environment needs no migration. The old columns'
values are copied into `facts` (and back, on the way down). On PostgreSQL a GIN index
(jsonb_path_ops) serves containment filters on facts; SQLite has no such index and gets
none, which is why it is created here rather than declared in the model's Meta.
"""

from django.db import migrations, models

OLD_COLUMNS = ("invalid_moves", "random_move_prob")
GIN_INDEX = "jobs_rollout_facts_gin"
BATCH = 2000


def columns_to_facts(apps, schema_editor):
    Rollout = apps.get_model("jobs", "Rollout")
    rows = Rollout.objects.filter(
        models.Q(invalid_moves__isnull=False) | models.Q(random_move_prob__isnull=False)
    ).only("id", *OLD_COLUMNS)
    changed = []
    for row in rows.iterator(chunk_size=BATCH):
        row.facts = {
            name: getattr(row, name) for name in OLD_COLUMNS if getattr(row, name) is not None
        }
        changed.append(row)
        if len(changed) >= BATCH:
            Rollout.objects.bulk_update(changed, ["facts"])
            changed = []
    Rollout.objects.bulk_update(changed, ["facts"])


def facts_to_columns(apps, schema_editor):
    Rollout = apps.get_model("jobs", "Rollout")
    changed = []
    for row in Rollout.objects.only("id", "facts").iterator(chunk_size=BATCH):
        facts = row.facts if isinstance(row.facts, dict) else {}
        invalid, prob = facts.get("invalid_moves"), facts.get("random_move_prob")
        row.invalid_moves = invalid if isinstance(invalid, int) else None
        row.random_move_prob = float(prob) if isinstance(prob, int | float) else None
        if row.invalid_moves is not None or row.random_move_prob is not None:
            changed.append(row)
        if len(changed) >= BATCH:
            Rollout.objects.bulk_update(changed, OLD_COLUMNS)
            changed = []
    Rollout.objects.bulk_update(changed, OLD_COLUMNS)


def create_gin_index(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(
            f"CREATE INDEX {GIN_INDEX} ON jobs_rollout USING gin (facts jsonb_path_ops)"
        )


def drop_gin_index(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(f"DROP INDEX IF EXISTS {GIN_INDEX}")


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0002_api_keys_attempts_lost"),
    ]

    operations = [
        migrations.AddField(
            model_name="rollout",
            name="facts",
            field=models.JSONField(blank=True, default=dict),
        ),
        migrations.RunPython(columns_to_facts, facts_to_columns),
        migrations.RemoveField(model_name="rollout", name="invalid_moves"),
        migrations.RemoveField(model_name="rollout", name="random_move_prob"),
        migrations.RunPython(create_gin_index, drop_gin_index),
    ]
