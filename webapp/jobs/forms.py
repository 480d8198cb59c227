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
from rlcore.train.config import ADVANTAGES, LOSS_AGGREGATIONS, LOSS_TYPES
from webapp.jobs import services
from webapp.jobs.models import EnvironmentConfig, ModelEntry

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
    """Register a model. For an endpoint, the API key stays in the workers' environment:
    only the variable's name is asked for, and stored."""

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
    api_key_env = forms.CharField(
        max_length=100,
        required=False,
        label="API key environment variable",
        help_text="Endpoints only: the NAME of the variable holding the key on the workers "
        "(e.g. OPENAI_API_KEY). The key itself is never stored.",
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

    def generation(self) -> dict:
        return {
            key: self.cleaned_data[key]
            for key in ("temperature", "top_p", "max_tokens")
            if self.cleaned_data.get(key) is not None
        }

    def add_service_error(self, error: ValidationError) -> None:
        super().add_service_error(error)
        if "api_key_env" in self.errors:
            # Whatever was typed there may be a key: do not send it back in the page.
            self.data = self.data.copy()
            self.data["api_key_env"] = ""


def _number(label: str, *, minimum=None, maximum=None, required=True, integer=True, help_text=""):
    if integer:
        return forms.IntegerField(
            label=label,
            min_value=minimum,
            max_value=maximum,
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
        "num_examples": lambda: _number("examples", minimum=1, maximum=100000),
        "rollouts_per_example": lambda: _number("rollouts per example", minimum=1, maximum=256),
        "max_tokens": lambda: _number("max tokens per reply", minimum=1, maximum=32768),
        "temperature": lambda: _number("temperature", minimum=0.0, maximum=5.0, integer=False),
        "concurrency": lambda: _number("concurrency", minimum=1, maximum=4096),
        "baselines": lambda: forms.BooleanField(
            required=False, label="baselines", help_text="Also play random, oracle and constant."
        ),
    },
    "synth": {
        "num_examples": lambda: _number("examples", minimum=1, maximum=1000000),
        "rollouts_per_example": lambda: _number("rollouts per example", minimum=1, maximum=256),
        "max_kept": lambda: _number("stop after keeping", minimum=1, required=False),
        "temperature": lambda: _number("temperature", minimum=0.0, maximum=5.0, integer=False),
        "max_tokens": lambda: _number("max tokens per reply", minimum=1, maximum=32768),
        "exclude_outcomes": lambda: forms.CharField(
            required=False,
            label="drop outcomes",
            help_text="Comma-separated outcome labels to drop, e.g. loss, unfinished.",
        ),
        "min_reward": lambda: _number("min reward", required=False, integer=False),
        "require_format": lambda: forms.BooleanField(
            required=False, label="require format", help_text="Keep only well-formatted games."
        ),
        "max_invalid_moves": lambda: _number("max invalid moves", minimum=0, required=False),
    },
    "sft": {
        "dataset": lambda: forms.CharField(
            max_length=500,
            help_text="JSONL written by a synth job (pick one above) or a file under MODEL_ROOTS.",
        ),
        "epochs": lambda: _number("epochs", minimum=1, maximum=1000),
        "max_steps": lambda: _number(
            "steps", minimum=1, required=False, help_text="Overrides epochs."
        ),
        "lr": lambda: _number("learning rate", minimum=1e-9, maximum=1.0, integer=False),
        "batch_size": lambda: _number("batch size", minimum=1, maximum=4096),
        "micro_batch_size": lambda: _number("micro-batch size", minimum=1, maximum=4096),
        "max_seq_len": lambda: _number("max sequence length", minimum=16, maximum=131072),
        "save_every": lambda: _number(
            "checkpoint every (steps)", minimum=0, help_text="0: only the final one."
        ),
    },
    "rl": {
        "max_steps": lambda: _number("steps", minimum=1, maximum=1000000),
        "batch_size": lambda: _number("batch size (rollouts per step)", minimum=1, maximum=65536),
        "rollouts_per_example": lambda: _number("rollouts per example", minimum=1, maximum=1024),
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
        "lr": lambda: _number("learning rate", minimum=1e-9, maximum=1.0, integer=False),
        "temperature": lambda: _number("temperature", minimum=0.01, maximum=5.0, integer=False),
        "max_tokens": lambda: _number("max tokens per reply", minimum=1, maximum=32768),
        "save_every": lambda: _number(
            "checkpoint every (steps)", minimum=0, help_text="0: only the final one."
        ),
        "beta": lambda: _number(
            "KL beta", minimum=0.0, maximum=100.0, integer=False, help_text="0: no reference model."
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
    seed = forms.IntegerField(initial=0, min_value=0)
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

    def clean_dataset(self):
        try:
            return services.path_confine(
                location=self.cleaned_data["dataset"], what="dataset", is_file=True
            )
        except ValidationError as exc:
            raise ValidationError(exc.messages) from None

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
