"""Hostile input, checked in one place: JSON bodies, values, secrets and the 400s that
name the bad field.

Every value a user sends may be crafted: JSON nested a hundred thousand deep (Python's
parser recurses), integers of thousands of digits (int() refuses past 4,300), NaN and
Infinity (PostgreSQL's JSON refuses them), pasted API keys. The JSON API, the forms' free
`key=value` overrides and the Play API all go through `json_body` / `json_value`, and
everything a user can name as text goes through `refuse_secret`, so a bad value is a 400
naming its field, never a 500, and a key typed by mistake is never stored or echoed.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from django.core.exceptions import ValidationError
from django.http import JsonResponse

MAX_BODY_BYTES = 1_000_000
MAX_DEPTH = 20
# Integers beyond 64 bits are no setting's value; they also keep int() and the database
# out of harm's way.
MAX_INT = 2**63 - 1
MAX_NUMBER_CHARS = 40

# Shapes of common API tokens: OpenAI/Anthropic (sk-), GitHub (ghp_, gho_, ghu_, ghs_,
# ghr_, github_pat_), Slack (xox?-), AWS access keys (AKIA...), Hugging Face (hf_),
# GitLab (glpat-), Google (AIza...), and JSON web tokens.
SECRET_PATTERN = re.compile(
    r"(sk-[A-Za-z0-9_-]{12,}|gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}"
    r"|xox[abposr]-[A-Za-z0-9-]{10,}|AKIA[0-9A-Z]{16}|hf_[A-Za-z0-9]{20,}"
    r"|glpat-[A-Za-z0-9_-]{20,}|AIza[0-9A-Za-z_-]{35}|eyJ[A-Za-z0-9_-]{10,}\.eyJ[A-Za-z0-9_-]{10,})"
)


def looks_like_secret(text: str) -> bool:
    return bool(SECRET_PATTERN.search(text))


def refuse_secret(value: str, *, field: str) -> None:
    """ValidationError on `field` if `value` looks like an API token; the value itself is
    never repeated in the message."""
    if isinstance(value, str) and looks_like_secret(value):
        raise ValidationError(
            {
                field: "this looks like an API key or token; keys are never entered here "
                "(staff declare them on the workers; pick a declared key by name)"
            }
        )


def _depth_exceeds(text: str, limit: int) -> bool:
    """Whether brackets outside strings nest deeper than `limit` (a linear scan, so a
    hostile body cannot make the parser recurse)."""
    depth, in_string, escaped = 0, False, False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            if depth > limit:
                return True
        elif char in "]}":
            depth -= 1
    return False


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_NUMBER_CHARS:
        raise ValueError(f"an integer of {len(text)} digits is out of range")
    value = int(text)
    if abs(value) > MAX_INT:
        raise ValueError(f"integer {value} is out of range (at most {MAX_INT} in size)")
    return value


def _parse_float(text: str) -> float:
    if len(text) > MAX_NUMBER_CHARS * 2:
        raise ValueError(f"a number of {len(text)} characters is out of range")
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of range for a number")
    return value


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a number this lab accepts (finite numbers only)")


def json_loads(text: str | bytes, *, field: str) -> Any:
    """`text` parsed as JSON, or ValidationError on `field` saying what was wrong: too
    deep, numbers out of range, NaN/Infinity, not JSON at all."""
    if isinstance(text, bytes):
        if len(text) > MAX_BODY_BYTES:
            raise ValidationError({field: f"more than {MAX_BODY_BYTES} bytes"})
        try:
            text = text.decode()
        except UnicodeDecodeError:
            raise ValidationError({field: "not UTF-8 text"}) from None
    if _depth_exceeds(text, MAX_DEPTH):
        raise ValidationError({field: f"JSON nested deeper than {MAX_DEPTH} levels"})
    try:
        return json.loads(
            text, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_refuse_constant
        )
    except ValueError as exc:  # JSONDecodeError is a ValueError, and so are ours
        raise ValidationError({field: f"not valid JSON: {exc}"}) from None


def json_body(request) -> dict:
    """A request's JSON object body (empty body: {}), or ValidationError on `body`."""
    body = json_loads(request.body or b"{}", field="body")
    if not isinstance(body, dict):
        raise ValidationError({"body": "expected a JSON object"})
    return body


def json_value(value: Any, *, field: str, depth: int = 0) -> Any:
    """`value` (already parsed, e.g. from a form) if it is JSON a setting can hold:
    finite numbers in range, bounded depth; else ValidationError on `field`."""
    if depth > MAX_DEPTH:
        raise ValidationError({field: f"nested deeper than {MAX_DEPTH} levels"})
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        if abs(value) > MAX_INT:
            raise ValidationError({field: f"integer out of range (at most {MAX_INT} in size)"})
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValidationError({field: f"{value} is not a finite number"})
        return value
    if isinstance(value, list):
        return [json_value(item, field=field, depth=depth + 1) for item in value]
    if isinstance(value, dict):
        return {
            str(key): json_value(item, field=field, depth=depth + 1) for key, item in value.items()
        }
    raise ValidationError({field: f"unsupported value of type {type(value).__name__}"})


def ids_from(values: list[str]) -> list[int]:
    """The values that are row ids (decimal digits within 64 bits), in order; the rest
    are dropped, as a link to a row that cannot exist leads nowhere."""
    return [
        int(v) for v in values if v.isascii() and v.isdigit() and len(v) <= 19 and int(v) <= MAX_INT
    ]


def errors_response(errors: dict, status: int = 400) -> JsonResponse:
    """{"errors": {field: [messages]}} with `status`."""
    return JsonResponse(
        {"errors": {k: v if isinstance(v, list) else [v] for k, v in errors.items()}}, status=status
    )


def validation_response(exc: ValidationError) -> JsonResponse:
    if hasattr(exc, "error_dict"):
        return errors_response(exc.message_dict)
    return errors_response({"__all__": exc.messages})
