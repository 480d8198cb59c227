"""What the lab does: typed, keyword-only services with verb names.

Views and the JSON API validate input, call one of these, and render. Services check
what only the server can check (environment parameters against the env's schema, model
paths against MODEL_ROOTS, job settings against rlcore's config classes), resolve a job's
full rlcore config so it is stored with the job, and enqueue work after the transaction
commits so a worker never sees a job row that was rolled back.
"""

from __future__ import annotations

import json
import re
import tomllib
import uuid
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.utils import timezone

from rlcore.envs import ParamError, get_env_class, load_environment
from rlcore.evaluate import EvalConfig
from rlcore.policy.tiny import BUILTIN_MODELS
from rlcore.train.config import (
    ConfigError,
    RLConfig,
    SFTConfig,
    SynthConfig,
    build_config,
    config_schema,
    flatten_settings,
    place_setting,
)
from webapp.jobs.live import notify_job
from webapp.jobs.models import (
    ApiKey,
    Checkpoint,
    EnvironmentConfig,
    Job,
    LogLine,
    Metric,
    ModelEntry,
    Rollout,
    RolloutFlag,
)
from webapp.jobs.nodes import NEEDS_KEYS, JobNeeds, gpus_needed, needs_resolve, queue_for_needs
from webapp.jobs.validation import json_loads, json_value, refuse_secret

RECIPE_DIR = settings.BASE_DIR / "recipes" / "tictactoe_tiny"
CONFIG_CLASSES = {"eval": EvalConfig, "synth": SynthConfig, "sft": SFTConfig, "rl": RLConfig}
# The config key each kind writes its outputs under.
OUTPUT_KEYS = {
    "eval": "out_dir",
    "synth": "output_dir",
    "sft": "output_dir",
    "rl": "output_dir",
    "audit": "out_dir",
    "delta": "out_dir",
}
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
BUILTIN_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


# ---------------------------------------------------------------------------------------
# Environments


def env_params_resolve(*, env_name: str, params: dict) -> dict:
    """`params` checked by the environment itself: defaults filled in, values coerced.

    Raises ParamError(field -> what was wrong), the environment's own errors, so a form
    can put each message under its field.
    """
    try:
        env = load_environment(env_name, **params)
    except KeyError as exc:
        raise ParamError({"env_name": str(exc.args[0])}) from None
    judge_key_check(env_name=env_name, params=env.config)
    return dict(env.config)


def judge_key_check(*, env_name: str, params: dict) -> None:
    """ParamError on the key variable's parameter unless the judge's API key may go to the
    judge's endpoint (ApiKey.check_use): an env parameter must not let a user send a
    server secret (SECRET_KEY, a cloud token) to a URL of their choosing."""
    names = get_env_class(env_name).judge_params
    if not names.get("api_key_env"):
        return
    try:
        ApiKey.check_use(
            base_url=params.get(names.get("base_url", "")), env_var=params.get(names["api_key_env"])
        )
    except PermissionError as exc:
        raise ParamError({names["api_key_env"]: f"{exc}; leave it blank to send no key"}) from None


def env_config_save(
    *,
    owner,
    name: str,
    env_name: str,
    params: dict,
    env_config: EnvironmentConfig | None = None,
) -> EnvironmentConfig:
    """Create (or update `env_config`) a named, validated set of environment parameters."""
    resolved = env_params_resolve(env_name=env_name, params=params)
    config = env_config or EnvironmentConfig(owner=owner)
    config.name, config.env_name, config.params = name, env_name, resolved
    try:
        with transaction.atomic():
            config.save()
    except IntegrityError:
        raise ValidationError(
            {"name": f"you already have an environment config named {name!r}"}
        ) from None
    return config


def env_examples_preview(
    *, env_name: str, params: dict, count: int = 3, seed: int = 0
) -> list[dict]:
    """The first `count` examples the environment would serve: prompts and metadata."""
    env = load_environment(env_name, **params)
    return [
        {"id": ex.id, "group": ex.group, "prompt": ex.prompt, "info": ex.info}
        for ex in env.examples(count, seed=seed)
    ]


# ---------------------------------------------------------------------------------------
# Models


def _job_roots() -> list[Path]:
    """The directories holding one folder per job: RUNS_DIR and CHECKPOINT_ROOT."""
    roots = (settings.RUNS_DIR, settings.CHECKPOINT_ROOT)
    return list(dict.fromkeys(Path(root).expanduser().resolve() for root in roots))


def shared_roots() -> list[Path]:
    """The configured directories (MODEL_ROOTS) every user may read models and data from,
    less the runs and checkpoint directories, whose job folders belong each to its job's
    owner."""
    job_roots = _job_roots()
    roots = [Path(root).expanduser().resolve() for root in settings.MODEL_ROOTS]
    return [root for root in roots if root not in job_roots]


def _own_run_dirs(owner) -> list[Path]:
    pks = list(Job.objects.filter(owner=owner).values_list("pk", flat=True))
    return [root / f"job-{pk}" for root in _job_roots() for pk in pks]


def job_output_dir(kind: str, job_id: int) -> Path:
    """Where a job writes: SFT and RL (checkpoints) under CHECKPOINT_ROOT, the shared path
    every node reads checkpoints from; eval and synth under RUNS_DIR."""
    root = settings.CHECKPOINT_ROOT if kind in ("sft", "rl") else settings.RUNS_DIR
    return Path(root) / f"job-{job_id}"


MAX_PATH_CHARS = 1024


def path_confine(
    *, location: str, owner, what: str = "model directory", is_file: bool = False
) -> str:
    """`location` resolved (symlinks followed) if `owner` may use it: under the folder of
    one of their own jobs (RUNS_DIR/job-N, CHECKPOINT_ROOT/job-N) or under a shared root
    (MODEL_ROOTS). The one
    check for every path a user can name: model directories, datasets, resume_from.

    Jobs run on workers with the lab's permissions, so a path elsewhere is refused with
    the same words whether or not it exists: nothing outside can be probed.
    """
    outside = ValidationError(
        f"{what} {location[:200]!r} is not one you may use: paths must lie in the folder "
        "of one of your own jobs or under a shared model directory "
        f"({', '.join(str(r) for r in shared_roots()) or 'none configured'})"
    )
    if not location or len(location) > MAX_PATH_CHARS or "\x00" in location:
        raise outside
    try:
        path = Path(location).expanduser()
        if not path.is_absolute():
            path = settings.BASE_DIR / path
        resolved = path.resolve()
    except (OSError, RuntimeError, ValueError):  # a name too long, a symlink loop
        raise outside from None
    roots = shared_roots() + _own_run_dirs(owner)
    if not any(resolved == root or resolved.is_relative_to(root) for root in roots):
        raise outside
    try:
        exists = resolved.is_file() if is_file else resolved.is_dir()
    except (OSError, ValueError):
        exists = False
    if not exists:
        kind = "a file" if is_file else "a directory"
        raise ValidationError(f"{what} {str(resolved)!r} does not exist or is not {kind}")
    return str(resolved)


IMAGE_TYPES = {"jpg": "image/jpeg", "jpeg": "image/jpeg", "png": "image/png"}


def job_file_path(*, job: Job, name: str, what: str = "file") -> str:
    """The file `name` (relative) in `job`'s output folder, through path_confine as the
    job's owner, and inside that job's own folder (not only some folder of its owner's);
    ValidationError otherwise."""
    folder = job.config.get(OUTPUT_KEYS.get(job.kind, ""), "") or job_output_dir(job.kind, job.pk)
    if not name or Path(name).is_absolute():
        raise ValidationError(f"{what} {name[:200]!r} is not a path inside the job's folder")
    path = path_confine(location=str(Path(folder) / name), owner=job.owner, what=what, is_file=True)
    own = Path(job_output_dir(job.kind, job.pk)).expanduser().resolve()
    if not Path(path).is_relative_to(own):
        raise ValidationError(f"{what} {name[:200]!r} is not inside job {job.pk}'s folder")
    return path


def _looks_like_path(location: str) -> bool:
    return location.startswith(("/", "~", "./", "../")) or (settings.BASE_DIR / location).exists()


def model_create(
    *,
    owner,
    name: str,
    kind: str,
    location: str = "",
    base_url: str = "",
    api_key: str = "",
    generation: dict | None = None,
) -> ModelEntry:
    """Register a model; ValidationError(field -> why) when a field cannot be used.

    An endpoint may use an API key staff declared (ApiKey, by name), and only with the
    base URL it was declared for: no user can choose where a server secret is sent."""
    location, base_url, api_key = location.strip(), base_url.strip(), api_key.strip()
    errors: dict[str, str] = {}
    for field, value in (("name", name), ("location", location), ("base_url", base_url)):
        try:
            refuse_secret(value, field=field)
        except ValidationError as exc:
            errors |= {k: v[0] for k, v in exc.message_dict.items()}
    if errors:
        raise ValidationError(errors)
    declared_key = None
    if kind not in ModelEntry.Kind.values:
        errors["kind"] = f"unknown kind {kind!r}; accepted: {', '.join(ModelEntry.Kind.values)}"
    elif kind == ModelEntry.Kind.TINY:
        location = location or "tiny"
        if location not in BUILTIN_MODELS:
            errors["location"] = (
                f"a built-in model is one of {', '.join(BUILTIN_MODELS)} (empty: tiny), "
                f"got {location[:100]!r}"
            )
    elif kind == ModelEntry.Kind.CHECKPOINT or (
        kind == ModelEntry.Kind.HF and location and _looks_like_path(location)
    ):
        try:
            location = path_confine(location=location, owner=owner)
        except ValidationError as exc:
            errors["location"] = exc.messages[0]
    elif kind == ModelEntry.Kind.HF:
        if not HUB_ID.match(location):
            errors["location"] = (
                f"{location!r} is neither a directory under MODEL_ROOTS nor a hub id "
                "such as 'Qwen/Qwen2.5-0.5B-Instruct'"
            )
    elif kind == ModelEntry.Kind.OPENAI:
        if not re.match(r"^https?://\S+$", base_url) or len(base_url) > 500:
            errors["base_url"] = (
                f"an OpenAI-compatible endpoint needs an http(s) base URL such as "
                f"http://127.0.0.1:8000/v1, got {base_url[:100]!r}"
            )
        if not location:
            errors["location"] = "the served model's name is required (e.g. gpt-4o-mini)"
        if api_key:
            declared_key = ApiKey.objects.filter(name=api_key).first()
            if declared_key is None:
                names = ", ".join(ApiKey.objects.values_list("name", flat=True)) or "none yet"
                errors["api_key"] = (
                    "no API key of that name is declared (declared: "
                    f"{names}); staff declare keys in the admin"
                )
            elif not declared_key.serves(base_url):
                errors["api_key"] = (
                    f"key {declared_key.name!r} may only be sent to {declared_key.base_url}; "
                    "use that base URL or pick no key"
                )
    elif kind == ModelEntry.Kind.BUILTIN and not BUILTIN_NAME.match(location):
        errors["location"] = (
            f"a built-in player is named in lower case (oracle, random, constant), got {location!r}"
        )
    if kind != ModelEntry.Kind.OPENAI:
        base_url, declared_key = "", None
    if errors:
        raise ValidationError(errors)
    entry = ModelEntry(
        owner=owner,
        name=name,
        kind=kind,
        location=location,
        base_url=base_url,
        api_key=declared_key,
        generation=generation or {},
    )
    try:
        with transaction.atomic():
            entry.save()
    except IntegrityError:
        raise ValidationError({"name": f"you already have a model named {name!r}"}) from None
    return entry


def model_delete(*, model: ModelEntry) -> None:
    """Forget a registered model (jobs that used it keep their stored config)."""
    model.delete()


# ---------------------------------------------------------------------------------------
# Job configs


# The recipe a new job of the kind starts from when none is named: the best measured recipe
# a CPU worker can run (docs/mastery.md): for RL per-move credit and the sound mass, for SFT
# the 3-layer model that RL starts from; the GPU profile's, rl_gpu from sft, are offered
# beside them.
DEFAULT_RECIPES = {"rl": "rl_sound", "sft": "sft_cpu"}
# What a recipe asks of the node that runs it, where the job does not say (the lab's
# settings, not rlcore's: a recipe file stays loadable by `python -m rlcore`).
RECIPE_NEEDS = {"rl_gpu": {"gpus": 1}}


def recipe_names(kind: str) -> list[str]:
    """The recipes of recipes/tictactoe_tiny for `kind`: `<kind>.toml` and `<kind>_*.toml`,
    by name, the default first; none for a kind that is not one (never globbed)."""
    if kind not in CONFIG_CLASSES:
        return []
    names = sorted(
        path.stem
        for path in RECIPE_DIR.glob(f"{kind}*.toml")
        if path.stem == kind or path.stem.startswith(f"{kind}_")
    )
    default = default_recipe(kind)
    return sorted(names, key=lambda name: name != default)


def default_recipe(kind: str) -> str:
    return DEFAULT_RECIPES.get(kind, kind)


def recipe_path(kind: str, name: str | None = None) -> Path | None:
    """The file of recipe `name` (the kind's default when None) for `kind`; None when the
    kind has no recipe of that name. A name is looked up among `recipe_names`, never joined
    to a path as given."""
    name = name or default_recipe(kind)
    if name not in recipe_names(kind):
        return None
    return RECIPE_DIR / f"{name}.toml"


def recipe_check(kind: str, name: str | None) -> str | None:
    """`name` when it is one of the kind's recipes (None stays None: the default);
    ValidationError on the `recipe` field otherwise."""
    if name is None or name == "":
        return None
    names = recipe_names(kind)
    if not isinstance(name, str) or name not in names:
        raise ValidationError(
            {
                "recipe": f"no {kind} recipe {str(name)[:100]!r}; accepted: "
                + (", ".join(names) or "none")
            }
        )
    return name


def recipe_choices(kind: str) -> list[dict[str, str]]:
    """The kind's recipes for the job form: name, and the summary and notes of its
    opening comment (`recipe_summary`)."""
    choices = []
    for name in recipe_names(kind):
        summary, notes = recipe_summary(RECIPE_DIR / f"{name}.toml")
        choices.append({"name": name, "summary": summary, "notes": notes})
    return choices


def recipe_summary(path: Path) -> tuple[str, str]:
    """The recipe file's opening comment as (its first sentence, the rest), up to its
    `Run:` line."""
    lines = []
    for line in path.read_text().splitlines():
        text = line.lstrip("#").strip()
        if not line.startswith("#") or text.startswith("Run:"):
            break
        lines.append(text)
    first, *rest = re.split(r"(?<=[.!?]) +(?=[A-Z(])", " ".join(lines), maxsplit=1)
    return first, "".join(rest)


def recipe_values(kind: str, name: str | None = None) -> dict[str, Any]:
    """The settings of recipe `name` (the kind's default when None) of
    recipes/tictactoe_tiny ({} without one)."""
    path = recipe_path(kind, name)
    return tomllib.loads(path.read_text()) if path is not None else {}


def kind_defaults(kind: str, recipe: str | None = None) -> dict[str, Any]:
    """Every setting of the kind (dotted names for sections' settings) with its default
    under the tictactoe_tiny recipe `recipe` (the kind's default when None)."""
    cls = CONFIG_CLASSES[kind]
    defaults = {row["name"]: row["default"] for row in config_schema(cls)}
    for key, value in flatten_settings(recipe_values(kind, recipe)).items():
        defaults[place_setting(cls, key)] = value
    return defaults


def _parse_overrides(text: str) -> dict[str, Any]:
    """`key=value` lines (values parsed as JSON when they parse) into a dict."""
    values: dict[str, Any] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, raw = line.partition("=")
        if not sep or not key.strip():
            raise ValidationError(
                {"overrides": f"line {number}: {line[:100]!r} is not of the form key=value"}
            )
        try:
            values[key.strip()] = json_loads(raw, field="overrides")
        except ValidationError as exc:
            if raw.strip()[:1] in "[{" or raw.strip()[:1].isdigit() or raw.strip()[:1] == "-":
                # Meant as JSON (a list, a table, a number) and not valid: say so.
                message = exc.message_dict["overrides"][0]
                raise ValidationError({"overrides": f"line {number}: {message}"}) from None
            values[key.strip()] = raw.strip()
    return values


# Settings the lab fixes itself: where a job writes, which model it loads and which key
# goes to which endpoint come from the job row and the model entry, never from a form.
LAB_KEYS = ("model", "base_url", "api_key_env", "output_dir", "out_dir")
# Settings that name a file or directory a job reads: each goes through path_confine.
PATH_KEYS = {"dataset": ("dataset", True), "resume_from": ("checkpoint directory", False)}


def _user_settings(options: dict, overrides: str) -> dict[str, Any]:
    """The form's settings and the free overrides, checked: JSON a setting can hold,
    no pasted secrets, none of the settings only the lab may set."""
    values = {k: v for k, v in options.items() if v is not None and v != ""}
    values |= _parse_overrides(overrides)
    errors: dict[str, str] = {}
    for key, value in values.items():
        head = key.split(".", 1)[0]
        field = key if key in options else "overrides"
        if head in LAB_KEYS:
            errors[field] = (
                f"{key} is set by the lab (the model entry and the job decide it), not per job"
            )
            continue
        try:
            json_value(value, field=field)
            refuse_secret(f"{key}={json.dumps(value)}", field=field)
        except ValidationError as exc:
            errors |= {k: v[0] for k, v in exc.message_dict.items()}
    if errors:
        raise ValidationError(errors)
    return values


def job_config_resolve(
    *,
    owner,
    kind: str,
    env_config: EnvironmentConfig | None,
    model: ModelEntry,
    options: dict,
    overrides: str = "",
    recipe: str | None = None,
) -> dict:
    """The full rlcore config a job will run with, as a JSON-able dict.

    Layers, later winning: the config class defaults, the recipe `recipe` of
    recipes/tictactoe_tiny (`recipe_names`; the kind's default when None), the model's
    generation defaults, the environment config (for RL, its parameters left at the env's
    default keep the recipe's env_args), the form's settings, then free `key=value` overrides. The same checks run for the form and the
    JSON API: each setting's bounds (rlcore's config.BOUNDS), the environment's own
    parameter schema for `env_args`, path_confine for every path, then rlcore's
    validation; each message lands under the field it is about.
    """
    if kind not in CONFIG_CLASSES:
        raise ValidationError(
            {"kind": f"unknown job kind {kind!r}; accepted: eval, synth, sft, rl"}
        )
    if model.kind in (ModelEntry.Kind.OPENAI, ModelEntry.Kind.BUILTIN) and kind in ("sft", "rl"):
        raise ValidationError(
            {
                "model": f"{kind} trains local weights; pick the tiny model, a checkpoint or a hub model"
            }
        )
    if kind in ("eval", "synth", "rl") and env_config is None:
        raise ValidationError({"env_config": f"a {kind} job needs an environment config"})
    if model.kind == ModelEntry.Kind.BUILTIN:
        offered = load_environment(env_config.env_name, **env_config.params).builtin_policies()
        if model.location not in offered:
            raise ValidationError(
                {
                    "model": f"environment {env_config.env_name!r} has no built-in player "
                    f"{model.location!r}; it offers: {', '.join(offered)}"
                }
            )

    name = recipe_check(kind, recipe) or default_recipe(kind)
    recipe = recipe_values(kind, name)
    if env_config is not None and recipe.get("env") != env_config.env_name:
        # The recipe's env parameters are tic-tac-toe's: another env's job gets none.
        recipe.pop("env_args", None)
    layers = [(f"recipe {name}.toml", recipe)]
    if kind != "sft":  # sampling settings: SFT samples nothing
        layers.append(("the model's generation defaults", dict(model.generation or {})))
    layers.append(("the model", model.policy_args()))
    if kind in ("eval", "synth", "rl"):
        # The environment config's parameters win over the recipe's, except, for RL, those
        # it leaves at the env's default: there the recipe's training regime applies
        # (rl_gpu's self-play and opening moves under a config that never set them). An
        # eval or synth job plays exactly the config's task.
        params = dict(env_config.params)
        if kind == "rl" and "env_args" in recipe:
            defaults = {
                p["name"]: p["default"] for p in get_env_class(env_config.env_name).schema()
            }
            params = {
                k: v
                for k, v in params.items()
                if k not in recipe["env_args"] or k not in defaults or v != defaults[k]
            }
        layers.append(("the environment config", {"env": env_config.env_name, "env_args": params}))
    layers.append(("the job's settings", _user_settings(options, overrides)))
    try:
        config = build_config(CONFIG_CLASSES[kind], layers).to_dict()
    except ConfigError as exc:
        if exc.errors:
            # A key the form shows keeps its message; any other came from the overrides.
            # Named as the user named it (`lr` for optimizer.lr); others were overrides.
            named = {place_setting(CONFIG_CLASSES[kind], key): key for key in options}
            by_field: dict[str, list[str]] = {}
            for key, message in exc.errors.items():
                field = named.get(key, key if key in options else "overrides")
                by_field.setdefault(field, []).append(message)
            raise ValidationError(by_field) from None
        raise ValidationError(str(exc)) from None
    if "env_args" in config:
        try:
            config["env_args"] = env_params_resolve(
                env_name=config["env"], params=config["env_args"]
            )
        except ParamError as exc:
            raise ValidationError(
                {f"env_args.{name}": message for name, message in exc.errors.items()}
            ) from None
    for key, (what, is_file) in PATH_KEYS.items():
        if config.get(key):
            try:
                config[key] = path_confine(
                    location=config[key], owner=owner, what=what, is_file=is_file
                )
            except ValidationError as exc:
                raise ValidationError({key: exc.messages}) from None
    return config


def job_needs_split(options: dict, overrides: str) -> tuple[dict, str, dict]:
    """The options and override lines without the job's needs (gpus, gpu_memory_gib,
    engine: settings of the lab, not of rlcore's config), and the needs they gave."""
    options = dict(options)
    needs = {key: options.pop(key) for key in NEEDS_KEYS if key in options}
    kept = []
    for line in overrides.splitlines():
        key, sep, raw = line.partition("=")
        if sep and key.strip() in NEEDS_KEYS:
            needs[key.strip()] = _parse_overrides(line)[key.strip()]
        else:
            kept.append(line)
    return options, "\n".join(kept), needs


def _enqueue_on_commit(job: Job) -> None:
    """Send the job to its queue once the row is committed (never for a rolled-back row)."""
    from workers.tasks import run_job

    job_id, queue, task_id = job.pk, job.queue, job.celery_task_id
    transaction.on_commit(lambda: run_job.apply_async(args=[job_id], queue=queue, task_id=task_id))


def job_create(
    *,
    owner,
    kind: str,
    env_config: EnvironmentConfig | None,
    model: ModelEntry,
    options: dict | None = None,
    overrides: str = "",
    parent_checkpoint: Checkpoint | None = None,
    recipe: str | None = None,
) -> Job:
    """Resolve the job's config and what it needs (gpus, gpu_memory_gib, engine, among
    the options or overrides), store them, and queue the job on a queue that can serve it
    (cpu, or a gpu queue whose live nodes have the GPUs); ValidationError naming the field
    when no live node can."""
    options, overrides, asked = job_needs_split(options or {}, overrides)
    wanted = RECIPE_NEEDS.get(recipe_check(kind, recipe) or default_recipe(kind), {})
    asked = wanted | {key: value for key, value in asked.items() if value not in (None, "")}
    needs = needs_resolve(asked, kind=kind)
    config = job_config_resolve(
        owner=owner,
        kind=kind,
        env_config=env_config,
        model=model,
        options=options,
        overrides=overrides,
        recipe=recipe,
    )
    _check_placement(kind, config, needs)
    if parent_checkpoint is None and model.kind == ModelEntry.Kind.CHECKPOINT:
        parent_checkpoint = model.checkpoint
    return _job_insert(
        owner=owner,
        kind=kind,
        config=config,
        needs=needs,
        env_config=env_config,
        model=model,
        parent_checkpoint=parent_checkpoint,
    )


def _check_placement(kind: str, config: dict, needs: JobNeeds) -> None:
    """An RL job that splits generation from training needs two GPUs (or none: on the
    CPU both sides share it); on one GPU it could only fail when it starts."""
    if kind != "rl" or config.get("placement") != "split":
        return
    if gpus_needed(needs, config.get("device", "auto"))[0] == 1:
        raise ValidationError(
            {
                "placement": "split runs generation on one GPU and training on another: "
                "set gpus to 2, or placement to colocated"
            }
        )


def _job_needs(job: Job) -> JobNeeds:
    return JobNeeds(gpus=job.gpus, gpu_memory_gib=job.gpu_memory_gib, engine=job.engine)


def _job_insert(
    *, owner, kind, config, needs: JobNeeds, env_config, model, parent_checkpoint, retry_of=None
) -> Job:
    queue = queue_for_needs(needs, device=config.get("device", "auto"))
    with transaction.atomic():
        job = Job.objects.create(
            retry_of=retry_of,
            owner=owner,
            kind=kind,
            config=config,
            env_config=env_config,
            model=model,
            parent_checkpoint=parent_checkpoint,
            queue=queue,
            gpus=needs.gpus,
            gpu_memory_gib=needs.gpu_memory_gib,
            engine=needs.engine,
            celery_task_id=str(uuid.uuid4()),
        )
        # Each job writes under its own directory, named after its id.
        job.config[OUTPUT_KEYS[kind]] = str(job_output_dir(kind, job.pk))
        job.save(update_fields=["config"])
        _enqueue_on_commit(job)
    return job


def job_cancel(*, job: Job) -> Job:
    """Cancel a queued job at once; ask a running one to stop after its current step."""
    if not job.is_active:
        raise ValidationError(
            f"job #{job.pk} is already {job.status}; only queued or running jobs can be cancelled"
        )
    now = timezone.now()
    if Job.objects.filter(pk=job.pk, status=Job.Status.QUEUED).update(
        status=Job.Status.CANCELLED, finished=now, cancel_requested=True
    ):
        from workers.celery import app

        app.control.revoke(job.celery_task_id)
    else:
        # It started in the meantime: the worker's sink sees the flag between steps.
        Job.objects.filter(pk=job.pk, status=Job.Status.RUNNING).update(cancel_requested=True)
    job.refresh_from_db()
    notify_job(job.pk, {"type": "job.status", **job_status_payload(job)})
    return job


def job_status_payload(job: Job) -> dict:
    return {
        "job": job.pk,
        "status": job.status,
        "cancel_requested": job.cancel_requested,
        "error": job.error,
        "worker": job.worker,
        "engine_used": job.engine_used,
        "progress": job.progress_dict(),
        "last_step": job.last_step,
    }


def job_retry(*, job: Job) -> Job:
    """A new job with the same config; an RL job resumes from the last checkpoint of the
    job's current attempt (never one an earlier attempt left behind)."""
    config = dict(job.config)
    # At a tie (the last step's checkpoint and final/) the step's, which has the
    # trainer state to resume from, was recorded first.
    last = job.current_checkpoints().order_by("-step", "id").first()
    if job.kind == Job.Kind.RL and last is not None:
        config["resume_from"] = last.path
    return _job_insert(
        owner=job.owner,
        kind=job.kind,
        config=config,
        needs=_job_needs(job),
        env_config=job.env_config,
        model=job.model,
        parent_checkpoint=last or job.parent_checkpoint,
        retry_of=job,
    )


def job_requeue(*, job: Job) -> Job:
    """Run the same job row again from the start as its next attempt: what the last
    attempt reported is dropped, its checkpoints stay archived under their attempt (models
    made from them keep working), and the new attempt writes into a folder of its own."""
    if job.status == Job.Status.RUNNING:
        raise ValidationError(f"job #{job.pk} is running; cancel it before requeueing")
    # The nodes may have changed since: the job goes where it can run now.
    queue = queue_for_needs(_job_needs(job), device=job.config.get("device", "auto"))
    with transaction.atomic():
        job.attempt += 1
        job.queue = queue
        job.config[OUTPUT_KEYS[job.kind]] = str(
            job_output_dir(job.kind, job.pk) / f"attempt-{job.attempt}"
        )
        Metric.objects.filter(job=job).delete()
        Rollout.objects.filter(job=job).delete()
        LogLine.objects.filter(job=job).delete()
        job.status = Job.Status.QUEUED
        job.cancel_requested = False
        job.error = ""
        job.worker = ""
        job.summary = job.result = job.last_step = job.started = job.finished = None
        job.heartbeat = None
        job.engine_used = ""
        job.progress_done = job.progress_total = 0
        job.progress_desc = ""
        job.celery_task_id = str(uuid.uuid4())
        job.save()
        _enqueue_on_commit(job)
    return job


def job_check_worker(*, job: Job) -> Job:
    """A running job silent for WORKER_LOST_SECONDS whose worker does not say it still runs
    it is marked lost (called when its page or API detail loads; the workers' watchdogs do
    the same on their own, this covers a lab with no worker left)."""
    if job.status != Job.Status.RUNNING:
        return job
    from workers.tasks import heartbeat_is_fresh, job_mark_worker_lost, task_holders

    if heartbeat_is_fresh(job):
        return job
    if not task_holders(job.worker, job.celery_task_id):
        job_mark_worker_lost(
            job_id=job.pk,
            reason=f"worker {job.worker or '?'} stopped answering while the job was running",
        )
        job.refresh_from_db()
    return job


# ---------------------------------------------------------------------------------------
# The verifier checklist: audits, held-out deltas, flags, judges

# Examples of the held-out delta when none is named: a seed no training recipe uses
# (rlcore's CLI default, so the page and `python -m rlcore delta` agree).
HELD_OUT_SEED = 1_000_003


def audit_create(
    *,
    owner,
    env_config: EnvironmentConfig,
    num_examples: int,
    seed: int,
    rollouts_per_step: int,
    step_seconds: float | None,
) -> Job:
    """Queue the verifier audit (rlcore/audit.py) of `env_config` on its current
    parameters: trivial exploits, format brittleness, throughput."""
    env_args = env_params_resolve(env_name=env_config.env_name, params=env_config.params)
    config = {
        "env": env_config.env_name,
        "env_args": env_args,
        "num_examples": num_examples,
        "seed": seed,
        "rollouts_per_step": rollouts_per_step,
        "step_seconds": step_seconds,
    }
    return _job_insert(
        owner=owner,
        kind=Job.Kind.AUDIT,
        config=config,
        needs=JobNeeds(),
        env_config=env_config,
        model=None,
        parent_checkpoint=None,
    )


def delta_create(
    *,
    owner,
    env_config: EnvironmentConfig,
    base: ModelEntry,
    trained: ModelEntry,
    num_examples: int,
    rollouts_per_example: int,
    seed: int,
    max_tokens: int,
    temperature: float,
    gpus: int | None = None,
    gpu_memory_gib: float | None = None,
) -> Job:
    """Queue the held-out delta (rlcore/delta.py) of `trained` against `base` on
    `env_config`'s examples from `seed`, on a node with `gpus` GPUs of `gpu_memory_gib`
    (none: the cpu queue). The job's model is the trained one and its parent checkpoint
    the trained checkpoint, which is how a training job finds its deltas."""
    needs = needs_resolve({"gpus": gpus, "gpu_memory_gib": gpu_memory_gib}, kind="delta")
    errors = {}
    if base.pk == trained.pk:
        errors["trained"] = f"{trained.name!r} is also the base model; pick the trained one"
    offered = load_environment(env_config.env_name, **env_config.params).builtin_policies()
    for field, entry in (("base", base), ("trained", trained)):
        if entry.kind == ModelEntry.Kind.BUILTIN and entry.location not in offered:
            errors[field] = (
                f"environment {env_config.env_name!r} has no built-in player "
                f"{entry.location!r}; it offers: {', '.join(offered)}"
            )
    if errors:
        raise ValidationError(errors)
    config = {
        "env": env_config.env_name,
        "env_args": env_params_resolve(env_name=env_config.env_name, params=env_config.params),
        "base": base.policy_args(),
        "trained": trained.policy_args(),
        "base_model": base.pk,
        "base_name": base.name,
        "trained_name": trained.name,
        "num_examples": num_examples,
        "rollouts_per_example": rollouts_per_example,
        "seed": seed,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "device": "auto",
    }
    return _job_insert(
        owner=owner,
        kind=Job.Kind.DELTA,
        config=config,
        needs=needs,
        env_config=env_config,
        model=trained,
        parent_checkpoint=trained.checkpoint,
    )


def rollout_flag(*, user, rollout: Rollout, reason: str = "") -> RolloutFlag:
    """Flag `rollout` as wrongly scored by `user` (again: the reason is replaced)."""
    reason = reason.strip()
    refuse_secret(reason, field="reason")
    if len(reason) > 200:
        raise ValidationError({"reason": f"at most 200 characters, got {len(reason)}"})
    flag, _ = RolloutFlag.objects.update_or_create(
        rollout=rollout, user=user, defaults={"reason": reason}
    )
    return flag


def rollout_unflag(*, user, rollout: Rollout) -> bool:
    """Remove `user`'s flag on `rollout`; False when there was none."""
    deleted, _ = RolloutFlag.objects.filter(rollout=rollout, user=user).delete()
    return bool(deleted)


# Model families by the start of a model's name or config `model_type`; a judge of the
# policy's own family favours that family's style.
FAMILIES = (
    "qwen", "llama", "mistral", "mixtral", "gemma", "phi", "gpt", "claude", "deepseek",
    "olmo", "smollm", "falcon", "granite", "command", "internlm", "yi", "glm", "o1", "o3",
)  # fmt: skip
MAX_CONFIG_BYTES = 1_000_000


def model_family(name: str) -> str:
    """The family a model name or `model_type` belongs to ("Qwen/Qwen2.5-7B-Instruct",
    "qwen2" -> "qwen"; "gpt-4o-mini" -> "gpt"); else its first word; "" for none."""
    base = name.strip().rstrip("/").rsplit("/", 1)[-1].lower()
    for family in FAMILIES:
        if base.startswith(family):
            return "mistral" if family == "mixtral" else "gpt" if family in ("o1", "o3") else family
    match = re.match(r"[a-z]+", base)
    return match.group(0) if match else ""


def model_entry_family(entry: ModelEntry) -> str:
    """A registered model's family: its weights' `model_type` where they are a local
    directory (the tiny model is a Qwen2), else its name at the hub or endpoint; "" for an
    env's built-in player."""
    if entry.kind == ModelEntry.Kind.BUILTIN:
        return ""
    if entry.kind == ModelEntry.Kind.TINY:
        return "qwen"
    config_path = Path(entry.location) / "config.json"
    try:
        if config_path.is_file() and config_path.stat().st_size <= MAX_CONFIG_BYTES:
            model_type = json.loads(config_path.read_text()).get("model_type")
            if isinstance(model_type, str) and model_type:
                return model_family(model_type)
    except (OSError, ValueError, AttributeError):
        pass  # unreadable weights: the name still tells
    return model_family(entry.location)


def judge_model_of(env_config: EnvironmentConfig | None) -> str | None:
    """The judge model `env_config` scores with ("" when its env has a judge but none is
    set), or None when its env scores without a judge."""
    if env_config is None:
        return None
    try:
        param = get_env_class(env_config.env_name).judge_params.get("model")
    except KeyError:
        return None
    if not param:
        return None
    return str(env_config.params.get(param) or "")


def judge_family_warning(*, env_config: EnvironmentConfig | None, model: ModelEntry) -> str:
    """A warning when `env_config`'s judge is of `model`'s family ("" otherwise)."""
    judge = judge_model_of(env_config)
    if not judge:
        return ""
    family = model_family(judge)
    if family and family == model_entry_family(model):
        return (
            f"the judge {judge!r} is of the {family} family, like the policy {model.name!r}: "
            "a judge favours its own family's style; one of another family is recommended"
        )
    return ""
