"""A rubric: weighted reward functions whose every value is kept per rollout.

A reward function takes keyword arguments (`messages`, `completion`, `state`, `example`,
`parser`) and returns a float; it may ignore what it does not need by taking `**_`. The
rubric records each function's raw value under its name and the weighted sum as `reward`,
so the CLI, the database and the charts can show every function, not only the total.
Each function may declare the range its values lie in (`bounds`), so a test can check a
reward against what the environment promises rather than against numbers of its own, and
`reward_bounds()` gives the range of the weighted total.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

RewardFunc = Callable[..., float]


@dataclass
class RewardSpec:
    name: str
    func: RewardFunc
    weight: float
    bounds: tuple[float, float] | None = None  # (lowest, highest) value; None: not declared


class Rubric:
    def __init__(self, funcs: list[RewardFunc] | None = None, weights: list[float] | None = None):
        self.specs: list[RewardSpec] = []
        funcs = funcs or []
        weights = weights or [1.0] * len(funcs)
        if len(weights) != len(funcs):
            raise ValueError(f"rubric got {len(funcs)} functions but {len(weights)} weights")
        for func, weight in zip(funcs, weights, strict=True):
            self.add(func, weight)

    def add(
        self,
        func: RewardFunc,
        weight: float = 1.0,
        name: str | None = None,
        bounds: tuple[float, float] | None = None,
    ) -> None:
        name = name or func.__name__
        if any(spec.name == name for spec in self.specs):
            raise ValueError(f"reward function {name!r} is already in the rubric")
        if bounds is not None:
            low, high = (float(value) for value in bounds)
            if not low <= high:
                raise ValueError(f"bounds of {name!r} must be (lowest, highest), got {bounds!r}")
            bounds = (low, high)
        self.specs.append(RewardSpec(name=name, func=func, weight=float(weight), bounds=bounds))

    @property
    def names(self) -> list[str]:
        return [spec.name for spec in self.specs]

    @property
    def weights(self) -> dict[str, float]:
        return {spec.name: spec.weight for spec in self.specs}

    @property
    def bounds(self) -> dict[str, tuple[float, float] | None]:
        """Each function's declared (lowest, highest) value, None where it declared none."""
        return {spec.name: spec.bounds for spec in self.specs}

    def reward_bounds(self) -> tuple[float, float] | None:
        """The range of the weighted total, or None unless every weighted function
        declared its bounds."""
        low = high = 0.0
        for spec in self.specs:
            if spec.weight == 0:
                continue
            if spec.bounds is None:
                return None
            ends = (spec.weight * spec.bounds[0], spec.weight * spec.bounds[1])
            low, high = low + min(ends), high + max(ends)
        return low, high

    def score(self, **context) -> tuple[dict[str, float], float]:
        """Every function's value and the weighted total for one rollout."""
        values: dict[str, float] = {}
        for spec in self.specs:
            values[spec.name] = float(spec.func(**context))
        total = sum(spec.weight * values[spec.name] for spec in self.specs)
        return values, total
