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
from rlcore.train.config import ADVANTAGES, BOUNDS, LOSS_AGGREGATIONS, LOSS_TYPES
from webapp.jobs import services
from webapp.jobs.models import ApiKey, EnvironmentConfig, ModelEntry
from webapp.jobs.validation import looks_like_secret

PARAM_PREFIX = "param_"
DEVICES = [
    ("auto", "auto (cuda when the worker has it)"),
    ("cpu", "cpu"),
    ("cuda", "cuda (gpu queue)"),
]


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
        "(oracle, random, constant). Ignored for the tiny model.",
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


def _number(label: str, *, name: str, required=True, integer=True, help_text=""):
    """A number field for config setting `name`, bounded as rlcore's config.BOUNDS says
    (the one place a setting's range is kept: the JSON API checks the same)."""
    minimum, maximum = BOUNDS[name]
    if integer:
        return forms.IntegerField(
            label=label,
            min_value=int(minimum),
            max_value=int(maximum),
            required=required,
            help_text=help_text,
        )
    return forms.FloatField(
        label=label,
        min_value=minimum,
        max_value=maximum,
        required=required,
        help_text=help_text,
        widget=forms.NumberInput(attrs={"step": "any"}),
    )


KIND_FIELDS = {
    "eval": {
        "num_examples": lambda: _number("examples", name="num_examples"),
        "rollouts_per_example": lambda: _number(
            "rollouts per example", name="rollouts_per_example"
        ),
        "max_tokens": lambda: _number("max tokens per reply", name="max_tokens"),
        "temperature": lambda: _number("temperature", name="temperature", integer=False),
        "concurrency": lambda: _number("concurrency", name="concurrency"),
        "baselines": lambda: forms.BooleanField(
            required=False, label="baselines", help_text="Also play random, oracle and constant."
        ),
    },
    "synth": {
        "num_examples": lambda: _number("examples", name="num_examples"),
        "rollouts_per_example": lambda: _number(
            "rollouts per example", name="rollouts_per_example"
        ),
        "max_kept": lambda: _number("stop after keeping", name="max_kept", required=False),
        "temperature": lambda: _number("temperature", name="temperature", integer=False),
        "max_tokens": lambda: _number("max tokens per reply", name="max_tokens"),
        "exclude_outcomes": lambda: forms.CharField(
            required=False,
            label="drop outcomes",
            help_text="Comma-separated outcome labels to drop, e.g. loss, unfinished.",
        ),
        "min_reward": lambda: _number(
            "min reward", name="min_reward", required=False, integer=False
        ),
        "require_format": lambda: forms.BooleanField(
            required=False, label="require format", help_text="Keep only well-formatted games."
        ),
        "max_invalid_moves": lambda: _number(
            "max invalid moves", name="max_invalid_moves", required=False
        ),
    },
    "sft": {
        "dataset": lambda: forms.CharField(
            max_length=500,
            help_text="JSONL written by a synth job (pick one above) or a file under MODEL_ROOTS.",
        ),
        "epochs": lambda: _number("epochs", name="epochs"),
        "max_steps": lambda: _number(
            "steps", name="max_steps", required=False, help_text="Overrides epochs."
        ),
        "lr": lambda: _number("learning rate", name="lr", integer=False),
        "batch_size": lambda: _number("batch size", name="batch_size"),
        "micro_batch_size": lambda: _number("micro-batch size", name="micro_batch_size"),
        "max_seq_len": lambda: _number("max sequence length", name="max_seq_len"),
        "save_every": lambda: _number(
            "checkpoint every (steps)", name="save_every", help_text="0: only the final one."
        ),
    },
    "rl": {
        "max_steps": lambda: _number("steps", name="max_steps"),
        "batch_size": lambda: _number("batch size (rollouts per step)", name="batch_size"),
        "rollouts_per_example": lambda: _number(
            "rollouts per example", name="rollouts_per_example"
        ),
        "loss_type": lambda: forms.ChoiceField(choices=[(t, t) for t in LOSS_TYPES], label="loss"),
        "loss_aggregation": lambda: forms.ChoiceField(
            choices=[(a, a) for a in LOSS_AGGREGATIONS],
            label="loss aggregation",
            help_text="sequence: every rollout weighs the same (long failed games cannot "
            "outweigh their group's wins); turn: every move does; token: every completion "
            "token does.",
        ),
        "advantage": lambda: forms.ChoiceField(
            choices=[(a, a) for a in ADVANTAGES],
            label="advantage",
            help_text="group: a rollout's reward minus its group's mean (GRPO); tree: per "
            "move, against the other moves the group tried in the same position.",
        ),
        "lr": lambda: _number("learning rate", name="lr", integer=False),
        "temperature": lambda: _number("temperature", name="temperature", integer=False),
        "max_tokens": lambda: _number("max tokens per reply", name="max_tokens"),
        "save_every": lambda: _number(
            "checkpoint every (steps)", name="save_every", help_text="0: only the final one."
        ),
        "beta": lambda: _number(
            "KL beta", name="beta", integer=False, help_text="0: no reference model."
        ),
    },
}


class JobForm(ServiceErrorsMixin, forms.Form):
    """A new job of one kind: what to run it on, and the kind's settings."""

    env_config = forms.ModelChoiceField(
        queryset=EnvironmentConfig.objects.none(), label="environment config"
    )
    model = forms.ModelChoiceField(queryset=ModelEntry.objects.none())
    device = forms.ChoiceField(choices=DEVICES, initial="auto")
    seed = forms.IntegerField(initial=0, min_value=BOUNDS["seed"][0], max_value=BOUNDS["seed"][1])
    overrides = forms.CharField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 3}),
        help_text="More settings, one key=value per line (e.g. top_p=0.9); values are JSON.",
    )

    def __init__(self, *args, kind: str, user, **kwargs):
        super().__init__(*args, **kwargs)
        from webapp.jobs import selectors

        self.kind = kind
        self.fields["env_config"].queryset = selectors.env_configs_for_user(user).filter(owner=user)
        self.fields["model"].queryset = selectors.models_for_user(user).filter(owner=user)
        if kind == "sft":
            self.fields["env_config"].required = False
            self.fields["env_config"].help_text = "Not used by SFT."
            self.datasets = selectors.synth_datasets_for_user(user)
        defaults = services.kind_defaults(kind)
        for name, make in KIND_FIELDS[kind].items():
            field = make()
            default = defaults.get(name)
            if isinstance(default, list):
                default = ", ".join(map(str, default))
            field.initial = default
            self.fields[name] = field
        self.fields["device"].initial = defaults.get("device", "auto")
        self.fields["seed"].initial = defaults.get("seed", 0)

    @property
    def kind_fields(self):
        return [self[name] for name in KIND_FIELDS[self.kind]]

    @property
    def common_fields(self):
        return [self[name] for name in ("env_config", "model", "device", "seed")]

    def clean_exclude_outcomes(self):
        text = self.cleaned_data.get("exclude_outcomes") or ""
        return [part.strip() for part in text.split(",") if part.strip()]

    def options(self) -> dict:
        """The kind's settings and the common ones, as rlcore config keys."""
        names = [*KIND_FIELDS[self.kind], "device", "seed"]
        return {name: self.cleaned_data.get(name) for name in names}


class RolloutFilterForm(forms.Form):
    """The inspector's filters (GET); the same names work on the JSON API."""

    outcome = forms.CharField(required=False)
    reward_min = forms.FloatField(required=False, label="reward ≥")
    reward_max = forms.FloatField(required=False, label="reward ≤")
    step = forms.IntegerField(required=False)
    example = forms.IntegerField(required=False, min_value=0)
    opponent_min = forms.FloatField(
        required=False, min_value=0.0, max_value=1.0, label="opponent random p ≥"
    )
    opponent_max = forms.FloatField(
        required=False, min_value=0.0, max_value=1.0, label="opponent random p ≤"
    )
    q = forms.CharField(required=False, label="text", max_length=200)
    errors = forms.BooleanField(required=False, label="errors only")
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
            ("invalid", "invalid moves ↑"),
            ("-invalid", "invalid moves ↓"),
            ("opponent", "opponent p ↑"),
            ("-opponent", "opponent p ↓"),
        ],
    )

    def filters(self):
        from webapp.jobs.selectors import RolloutFilters

        data = self.cleaned_data
        return RolloutFilters(
            outcome=data.get("outcome") or "",
            reward_min=data.get("reward_min"),
            reward_max=data.get("reward_max"),
            step=data.get("step"),
            example_id=data.get("example"),
            opponent_min=data.get("opponent_min"),
            opponent_max=data.get("opponent_max"),
            search=data.get("q") or "",
            errors_only=bool(data.get("errors")),
            sort=data.get("sort") or "step",
        )
