"""Forms: the environment form is built from the environment's own parameter schema, the
job form from the job kind's settings with defaults from the tictactoe_tiny recipes.

Forms check types and ranges; the services check the rest (the environment's
cross-field rules, MODEL_ROOTS, rlcore's config validation) and their ValidationErrors
land on the right fields through `add_service_error`.
"""

from __future__ import annotations

from django import forms
from django.core.exceptions import ValidationError

from rlcore.envs import ParamError, get_env_class
from rlcore.train.config import config_schema
from webapp.jobs import services
from webapp.jobs.models import ApiKey, EnvironmentConfig, ModelEntry
from webapp.jobs.nodes import NEEDS_KEYS, needs_schema
from webapp.jobs.selectors import FACT_PREFIX, FactFilter, RolloutFilters
from webapp.jobs.validation import looks_like_secret

PARAM_PREFIX = "param_"


class ServiceErrorsMixin:
    def add_service_error(self, error: ValidationError) -> None:
        """Put a service's ValidationError under the fields it names (else on top)."""
        if hasattr(error, "error_dict"):
            for field, messages in error.message_dict.items():
                self.add_error(field if field in self.fields else None, messages)
        else:
            self.add_error(None, error)


def _param_field(param: dict) -> forms.Field:
    """The form field for one schema entry: numbers with min/max, choices as a select,
    bools as a checkbox, the parameter's help text under it. A number left blank, or a
    choice left out, takes the parameter's default (so a post from before a parameter
    existed still validates)."""
    common = {"label": param["name"], "help_text": param["help"], "initial": param["default"]}
    kind = param["type"]
    if param.get("choices"):
        return forms.TypedChoiceField(
            choices=[(c, c) for c in param["choices"]],
            coerce={"int": int, "float": float}.get(kind, str),
            required=False,
            empty_value=None,
            **common,
        )
    if kind == "bool":
        return forms.BooleanField(required=False, **common)
    if kind == "int":
        return forms.IntegerField(
            required=False, min_value=param.get("min"), max_value=param.get("max"), **common
        )
    if kind == "float":
        return forms.FloatField(
            required=False,
            min_value=param.get("min"),
            max_value=param.get("max"),
            widget=forms.NumberInput(attrs={"step": "any"}),
            **common,
        )
    return forms.CharField(required=False, **common)


class EnvConfigForm(ServiceErrorsMixin, forms.Form):
    """A named parameter set for one environment; fields come from its schema."""

    name = forms.CharField(
        max_length=100, help_text="A name to pick this config by in the job form."
    )

    def __init__(self, *args, env_name: str, instance: EnvironmentConfig | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.env_name = env_name
        self.schema = get_env_class(env_name).schema()
        for param in self.schema:
            field = _param_field(param)
            if instance is not None and param["name"] in instance.params:
                field.initial = instance.params[param["name"]]
            self.fields[PARAM_PREFIX + param["name"]] = field
        if instance is not None:
            self.fields["name"].initial = instance.name

    @property
    def param_fields(self):
        return [self[PARAM_PREFIX + p["name"]] for p in self.schema]

    def params(self) -> dict:
        values = {}
        for p in self.schema:
            value = self.cleaned_data.get(PARAM_PREFIX + p["name"])
            values[p["name"]] = p["default"] if value is None else value
        return values

    def clean(self):
        cleaned = super().clean()
        if self.errors:
            return cleaned
        try:
            self.resolved = services.env_params_resolve(
                env_name=self.env_name, params=self.params()
            )
        except ParamError as exc:
            for name, message in exc.errors.items():
                field = PARAM_PREFIX + name
                self.add_error(field if field in self.fields else None, f"{message}")
        return cleaned


class ModelEntryForm(ServiceErrorsMixin, forms.Form):
    """Register a model. For an endpoint, an API key is picked by name among those staff
    declared (each bound to one base URL); no key is ever typed or stored here."""

    name = forms.CharField(max_length=200)
    kind = forms.ChoiceField(
        choices=[c for c in ModelEntry.Kind.choices if c[0] != ModelEntry.Kind.CHECKPOINT]
        + [(ModelEntry.Kind.CHECKPOINT, ModelEntry.Kind.CHECKPOINT.label)]
    )
    location = forms.CharField(
        max_length=500,
        required=False,
        help_text="Directory under MODEL_ROOTS, hub id, served model name, or built-in player "
        "(oracle, random, constant). Built-in tiny model: tiny (default), tiny-bpe (with a "
        "tokenizer of merges learned on tic-tac-toe), tiny-bpe-3l (that one with 3 layers) or "
        "tiny-master.",
    )
    base_url = forms.CharField(
        max_length=500,
        required=False,
        label="Base URL",
        help_text="Endpoints only, e.g. http://127.0.0.1:8000/v1",
    )
    api_key = forms.ChoiceField(
        required=False,
        label="API key",
        help_text="Endpoints only: a key staff declared for this base URL (admin, API keys). "
        "Keys are never typed here.",
        error_messages={"invalid_choice": "pick one of the declared keys, or none"},
    )
    temperature = forms.FloatField(
        required=False,
        min_value=0.0,
        max_value=5.0,
        widget=forms.NumberInput(attrs={"step": "any"}),
    )
    top_p = forms.FloatField(
        required=False,
        min_value=0.0,
        max_value=1.0,
        widget=forms.NumberInput(attrs={"step": "any"}),
    )
    max_tokens = forms.IntegerField(required=False, min_value=1, max_value=32768)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["api_key"].choices = [("", "none")] + [
            (key.name, f"{key.name} ({key.base_url})") for key in ApiKey.objects.all()
        ]

    def generation(self) -> dict:
        return {
            key: self.cleaned_data[key]
            for key in ("temperature", "top_p", "max_tokens")
            if self.cleaned_data.get(key) is not None
        }

    def full_clean(self):
        # A pasted key is refused and never sent back in the page: its field is blanked
        # before anything renders the form again.
        pasted = [
            name
            for name, value in self.data.items()
            if isinstance(value, str) and looks_like_secret(value)
        ]
        if pasted:
            self.data = self.data.copy()
            for name in pasted:
                self.data[name] = ""
        super().full_clean()
        for name in pasted:
            self.add_error(
                name if name in self.fields else None,
                "this looks like an API key or token; keys are never entered here (staff "
                "declare them on the workers; pick a declared key by name)",
            )


# The settings each kind shows first; every other setting of its config class appears
# under "All settings" by itself, built from the class's schema (type, bounds, choices,
# help), so a new config field needs no web code.
FEATURED = {
    "eval": ["num_examples", "rollouts_per_example", "max_tokens", "temperature", "concurrency", "baselines"],
    "synth": ["num_examples", "rollouts_per_example", "max_kept", "temperature", "max_tokens",
              "exclude_outcomes", "min_reward", "require_format", "max_invalid_moves"],
    "sft": ["dataset", "epochs", "max_steps", "optimizer.lr", "batch_size", "micro_batch_size",
            "max_seq_len", "save_every"],
    "rl": ["max_steps", "batch_size", "rollouts_per_example", "advantage", "turn_reward_weight",
           "optimizer.lr", "sampling.temperature", "sampling.max_tokens", "loss.type",
           "loss.aggregation", "loss.beta", "save_every"],
}  # fmt: skip
COMMON = ["device", "seed"]
# Settings the lab decides (services.LAB_KEYS) or the job's pickers give.
NOT_IN_FORM = {*services.LAB_KEYS, "env", "env_args"}


def setting_field(row: dict) -> forms.Field:
    """The form field for one config setting of `config_schema`."""
    label = row["name"].replace(".", " · ").replace("_", " ")
    label = label[0].upper() + label[1:]
    optional = row["type"].endswith("| None")
    common = {"label": label, "help_text": row["help"], "required": not optional}
    if optional:
        common["help_text"] += " (blank: none)"
    if row["choices"]:
        return forms.ChoiceField(choices=[(c, c) for c in row["choices"]], **common)
    if row["type"] == "bool":
        return forms.BooleanField(**common | {"required": False})
    if row["type"].startswith("int"):
        low, high = row["min"], row["max"]
        return forms.IntegerField(
            min_value=None if low is None else int(low),
            max_value=None if high is None else int(high),
            **common,
        )
    if row["type"].startswith("float"):
        return forms.FloatField(
            min_value=row["min"],
            max_value=row["max"],
            widget=forms.NumberInput(attrs={"step": "any"}),
            **common,
        )
    if row["type"].startswith("list"):
        common["help_text"] += " (comma-separated)"
        return forms.CharField(**common | {"required": False})
    return forms.CharField(
        max_length=500, **common | {"required": not optional and row["default"] != ""}
    )


class NamedChoiceField(forms.ModelChoiceField):
    """A model choice shown by its name alone."""

    def label_from_instance(self, obj) -> str:
        return obj.name


def form_name(setting: str) -> str:
    """A setting's form field name (`optimizer.lr` -> `optimizer__lr`)."""
    return setting.replace(".", "__")


class JobForm(ServiceErrorsMixin, forms.Form):
    """A new job of one kind: what to run it on, and every setting of the kind's config
    class (its schema gives each field's type, bounds, choices and help)."""

    env_config = NamedChoiceField(
        queryset=EnvironmentConfig.objects.none(), label="Environment config"
    )
    model = NamedChoiceField(queryset=ModelEntry.objects.none(), label="Model")
    # Which recipe of recipes/tictactoe_tiny the settings start from: picked by the page's
    # recipe links (a GET reload shows its defaults), posted back with the form.
    recipe = forms.CharField(required=False, widget=forms.HiddenInput, max_length=100)
    overrides = forms.CharField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 3}),
        help_text="More settings, one key=value per line (e.g. optimizer.lr=3e-4); values are JSON.",
    )

    def __init__(self, *args, kind: str, user, recipe: str | None = None, **kwargs):
        """`recipe`: one of `services.recipe_names(kind)` (checked: ValidationError on the
        `recipe` field), None for the kind's default."""
        super().__init__(*args, **kwargs)
        from webapp.jobs import selectors

        self.kind = kind
        self.recipe = services.recipe_check(kind, recipe) or services.default_recipe(kind)
        self.fields["recipe"].initial = self.recipe
        configs = selectors.env_configs_for_user(user).filter(owner=user)
        models = selectors.models_for_user(user).filter(owner=user)
        self.fields["env_config"].queryset = configs
        self.fields["model"].queryset = models
        # Start from what the user ran last (else what they made last).
        recent = selectors.jobs_for_user(user).filter(owner=user).first()
        self.fields["env_config"].initial = (recent and recent.env_config_id) or (
            configs.order_by("-created").values_list("pk", flat=True).first()
        )
        self.fields["model"].initial = (recent and recent.model_id) or (
            models.order_by("-created").values_list("pk", flat=True).first()
        )
        defaults = services.kind_defaults(kind, self.recipe)
        if kind == "sft":
            self.fields["env_config"].required = False
            self.fields["env_config"].help_text = "Not used by SFT."
            # SFT starts where its recipe does (sft_cpu.toml: the built-in `tiny-bpe-3l`;
            # sft.toml: `tiny-bpe`) when the user has that built-in model registered.
            starting = models.filter(kind=ModelEntry.Kind.TINY, location=defaults.get("model"))
            self.fields["model"].initial = (
                starting.values_list("pk", flat=True).first() or self.fields["model"].initial
            )
        self.settings: list[str] = []
        self.lists: set[str] = set()  # settings entered as comma-separated text
        for row in config_schema(services.CONFIG_CLASSES[kind]):
            if row["name"] in NOT_IN_FORM or row["type"] == "dict":
                continue
            field = setting_field(row)
            default = defaults.get(row["name"])
            if row["name"] == "dataset":
                field = self.dataset_field(user)
                default = field.choices[1][0] if len(field.choices) > 1 else ""  # the newest
            field.initial = ", ".join(map(str, default)) if isinstance(default, list) else default
            self.fields[form_name(row["name"])] = field
            self.settings.append(row["name"])
            if row["type"].startswith("list"):
                self.lists.add(row["name"])
        # What the job needs of its node: the lab's settings, beside rlcore's.
        for row in needs_schema():
            if kind == "sft" and row["name"] == "engine":
                continue  # SFT samples nothing
            field = setting_field(row)
            field.required = False  # blank: the default (a CPU job on the local engine)
            field.initial = services.RECIPE_NEEDS.get(self.recipe, {}).get(
                row["name"], row["default"]
            )
            self.fields[row["name"]] = field
            self.settings.append(row["name"])

    @staticmethod
    def dataset_field(user) -> forms.ChoiceField:
        """SFT data: the datasets the user's own synth jobs wrote, newest first."""
        from webapp.jobs import selectors

        datasets = selectors.synth_datasets_for_user(user)
        return forms.ChoiceField(
            label="Dataset",
            choices=[("", "pick a dataset" if datasets else "no datasets yet")] + datasets,
            help_text="A dataset written by one of your synth jobs"
            + ("." if datasets else ": run a synth job first."),
        )

    def _bound(self, names):
        return [self[form_name(name)] for name in names if name in self.settings]

    @property
    def common_fields(self):
        return [self["env_config"], self["model"], *self._bound(COMMON)]

    @property
    def kind_fields(self):
        return self._bound(FEATURED[self.kind])

    @property
    def needs_fields(self):
        return self._bound(NEEDS_KEYS)

    @property
    def more_fields(self):
        shown = {*COMMON, *FEATURED[self.kind], *NEEDS_KEYS}
        return self._bound([name for name in self.settings if name not in shown])

    def add_service_error(self, error: ValidationError) -> None:
        if hasattr(error, "error_dict"):
            error = ValidationError({form_name(k): v for k, v in error.message_dict.items()})
        super().add_service_error(error)

    def options(self) -> dict:
        """Every setting as the config's dotted key; lists from their comma-separated text."""
        values = {}
        for name in self.settings:
            value = self.cleaned_data.get(form_name(name))
            if name in self.lists:
                value = [part.strip() for part in (value or "").split(",") if part.strip()]
            values[name] = value
        return values


class RolloutFilterForm(forms.Form):
    """The inspector's filters (GET); the same names work on the JSON API.

    Besides the filters every job has, each fact the job's env declares (`facts`, from
    `selectors.job_facts`) adds its own: `fact_<name>_min` and `fact_<name>_max` for a
    number, `fact_<name>` for text, and sorting by it (`sort=fact_<name>`, `-fact_<name>`).
    """

    outcome = forms.CharField(required=False)
    reward_min = forms.FloatField(required=False, label="reward ≥")
    reward_max = forms.FloatField(required=False, label="reward ≤")
    step = forms.IntegerField(required=False)
    example = forms.IntegerField(required=False, min_value=0)
    q = forms.CharField(required=False, label="text", max_length=200)
    errors = forms.BooleanField(required=False, label="errors only")
    flagged = forms.BooleanField(required=False, label="flagged only")
    sort = forms.ChoiceField(
        required=False,
        choices=[
            ("step", "step ↑"),
            ("-step", "step ↓"),
            ("reward", "reward ↑"),
            ("-reward", "reward ↓"),
            ("example", "example"),
            ("length", "length ↑"),
            ("-length", "length ↓"),
        ],
    )

    def __init__(self, *args, facts=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.facts = list(facts)
        for fact in self.facts:
            key = f"{FACT_PREFIX}{fact.name}"
            if fact.type == "str":
                self.fields[key] = forms.CharField(
                    required=False, label=fact.label, max_length=200, help_text=fact.help
                )
            else:
                number = forms.IntegerField if fact.type == "int" else forms.FloatField
                for end, sign in (("min", "≥"), ("max", "≤")):
                    self.fields[f"{key}_{end}"] = number(
                        required=False,
                        min_value=fact.min,
                        max_value=fact.max,
                        label=f"{fact.label} {sign}",
                        help_text=fact.help,
                    )
            self.fields["sort"].choices += [
                (key, f"{fact.label} ↑"),
                (f"-{key}", f"{fact.label} ↓"),
            ]
        # The env's filters before the free text, the checkbox and the sort.
        self.order_fields(
            [name for name in self.fields if name not in ("q", "errors", "flagged", "sort")]
        )

    def filters(self):
        data = self.cleaned_data
        facts = []
        for fact in self.facts:
            key = f"{FACT_PREFIX}{fact.name}"
            if fact.type == "str":
                if data.get(key):
                    facts.append(FactFilter(fact.name, equals=data[key]))
            elif data.get(f"{key}_min") is not None or data.get(f"{key}_max") is not None:
                facts.append(FactFilter(fact.name, low=data[f"{key}_min"], high=data[f"{key}_max"]))
        return RolloutFilters(
            outcome=data.get("outcome") or "",
            reward_min=data.get("reward_min"),
            reward_max=data.get("reward_max"),
            step=data.get("step"),
            example_id=data.get("example"),
            facts=facts,
            search=data.get("q") or "",
            errors_only=bool(data.get("errors")),
            flagged_only=bool(data.get("flagged")),
            sort=data.get("sort") or "step",
        )


class AuditForm(forms.Form):
    """The verifier audit of an env config (`python -m rlcore audit`'s options)."""

    num_examples = forms.IntegerField(
        min_value=1, max_value=200, initial=16, help_text="Examples each player plays."
    )
    seed = forms.IntegerField(
        min_value=0, max_value=2**31 - 1, initial=0, help_text="Dataset seed."
    )
    rollouts_per_step = forms.IntegerField(
        min_value=1,
        max_value=65536,
        initial=64,
        help_text="Rollouts an RL step verifies (examples x rollouts per example).",
    )
    step_seconds = forms.FloatField(
        required=False,
        min_value=0.001,
        max_value=86400,
        widget=forms.NumberInput(attrs={"step": "any"}),
        help_text="Seconds an RL step takes without verification, to compare against "
        "(blank: not compared).",
    )


class DeltaForm(ServiceErrorsMixin, forms.Form):
    """The held-out delta: a trained model against its starting model on examples
    training did not see (`python -m rlcore delta`'s options)."""

    env_config = NamedChoiceField(
        queryset=EnvironmentConfig.objects.none(), label="Environment config"
    )
    trained = NamedChoiceField(
        queryset=ModelEntry.objects.none(),
        label="Trained model",
        help_text="A checkpoint an SFT or RL job made.",
    )
    base = NamedChoiceField(
        queryset=ModelEntry.objects.none(),
        label="Starting model",
        help_text="The model training started from.",
    )
    num_examples = forms.IntegerField(min_value=2, max_value=1000, initial=100)
    rollouts_per_example = forms.IntegerField(min_value=1, max_value=16, initial=1)
    seed = forms.IntegerField(
        min_value=0,
        max_value=2**31 - 1,
        initial=services.HELD_OUT_SEED,
        help_text="Dataset seed of the held-out examples: pick one training did not use.",
    )
    max_tokens = forms.IntegerField(min_value=1, max_value=32768, initial=256)
    temperature = forms.FloatField(
        min_value=0.0, max_value=5.0, initial=0.0, widget=forms.NumberInput(attrs={"step": "any"})
    )
    gpus = forms.IntegerField(
        required=False,
        min_value=0,
        max_value=64,
        initial=0,
        help_text="GPUs the job runs on (0: a CPU job); both models load on the node.",
    )
    gpu_memory_gib = forms.FloatField(
        required=False,
        min_value=0.0,
        max_value=4096.0,
        initial=0.0,
        label="GPU memory (GiB)",
        widget=forms.NumberInput(attrs={"step": "any"}),
        help_text="The memory each of its GPUs must have (0: any).",
    )

    def __init__(self, *args, user, **kwargs):
        super().__init__(*args, **kwargs)
        from webapp.jobs import selectors

        self.fields["env_config"].queryset = selectors.env_configs_for_user(user).filter(owner=user)
        models = selectors.models_for_user(user).filter(owner=user)
        self.fields["trained"].queryset = models
        self.fields["base"].queryset = models


class FlagForm(forms.Form):
    """A person's flag on a rollout that was scored wrongly."""

    reason = forms.CharField(
        required=False,
        max_length=200,
        help_text="Optional: what the verifier got wrong (at most 200 characters).",
    )
