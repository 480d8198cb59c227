"""The shared environment machinery: typed parameters, tool schemas, text tool calls,
rubrics, parsers and example seeds."""

from __future__ import annotations

import json

import pytest

from rlcore.envs.base import (
    Param,
    ParamError,
    example_seed,
    parse_text_tool_calls,
    tool_schema,
    validate_params,
)
from rlcore.parsers import ThinkParser, XMLParser, assistant_texts, last_assistant_text
from rlcore.rubric import Rubric

SCHEMA = [
    Param("rounds", int, 3, "How many rounds.", min=1, max=10),
    Param("temperature", float, 0.5, "Sampling heat.", min=0.0, max=2.0),
    Param("verbose", bool, False, "Say more."),
    Param("mode", str, "fast", "Which mode.", choices=("fast", "slow")),
]


# ---------------------------------------------------------------------------------------
# Param and validate_params


@pytest.mark.parametrize(
    ("param", "raw", "value"),
    [
        (SCHEMA[0], "7", 7),
        (SCHEMA[0], 4.0, 4),
        (SCHEMA[1], "1.25", 1.25),
        (SCHEMA[1], 2, 2.0),
        (SCHEMA[2], "on", True),
        (SCHEMA[2], "FALSE", False),
        (SCHEMA[2], 1, True),
        (SCHEMA[3], "slow", "slow"),
    ],
)
def test_param_coerces_form_and_cli_values(param, raw, value):
    coerced = param.coerce(raw)
    assert coerced == value
    assert type(coerced) is param.type


@pytest.mark.parametrize(
    ("param", "raw", "message"),
    [
        (SCHEMA[0], 4.5, "expected an integer, got 4.5"),
        (SCHEMA[0], True, "expected an integer, got True"),
        (SCHEMA[0], float("inf"), "expected an integer, got inf"),
        (SCHEMA[0], "three", "expected an integer, got 'three'"),
        (SCHEMA[0], 0, "must be at least 1, got 0"),
        (SCHEMA[0], 11, "must be at most 10, got 11"),
        (SCHEMA[1], "nan", "got nan"),
        (SCHEMA[1], "warm", "expected a number, got 'warm'"),
        (SCHEMA[2], "maybe", "expected true or false, got 'maybe'"),
        (SCHEMA[2], 2, "expected true or false, got 2"),
        (SCHEMA[3], "medium", "expected one of ['fast', 'slow'], got 'medium'"),
        (SCHEMA[3], 3, "expected text, got 3"),
    ],
)
def test_param_names_the_bad_value_and_what_is_accepted(param, raw, message):
    with pytest.raises(ValueError) as caught:
        param.coerce(raw)
    assert message in str(caught.value)


def test_validate_params_fills_defaults_and_coerces():
    assert validate_params(SCHEMA, None) == {
        "rounds": 3,
        "temperature": 0.5,
        "verbose": False,
        "mode": "fast",
    }
    assert validate_params(SCHEMA, {"rounds": "5", "verbose": "true"})["rounds"] == 5


def test_validate_params_collects_every_error_at_once():
    with pytest.raises(ParamError) as caught:
        validate_params(SCHEMA, {"rounds": 0, "mode": "slow", "colour": "red"})
    errors = caught.value.errors
    assert set(errors) == {"rounds", "colour"}
    assert errors["colour"] == "unknown parameter; accepted: mode, rounds, temperature, verbose"
    assert "rounds: must be at least 1" in str(caught.value)
    assert isinstance(caught.value, ValueError)


def test_param_to_dict_is_what_the_web_form_is_built_from():
    assert SCHEMA[3].to_dict() == {
        "name": "mode",
        "type": "str",
        "default": "fast",
        "help": "Which mode.",
        "min": None,
        "max": None,
        "choices": ["fast", "slow"],
    }
    assert SCHEMA[0].to_dict()["type"] == "int"
    assert SCHEMA[0].to_dict()["max"] == 10


def test_example_seeds_are_stable_distinct_and_31_bit():
    seeds = {example_seed(0, index) for index in range(500)}
    assert len(seeds) == 500
    assert all(0 <= seed < 2**31 for seed in seeds)
    assert example_seed(7, 3) == example_seed(7, 3)
    assert example_seed(7, 3) != example_seed(8, 3)


# ---------------------------------------------------------------------------------------
# Tools


def lookup(city: str, days: int = 1, metric: bool = True) -> str:
    """Look up the weather forecast.

    Longer explanation that is not part of the description.

    city: the city name
    days: how many days ahead
    """
    return f"{city}:{days}:{metric}"


def test_tool_schema_reads_the_signature_and_docstring():
    schema = tool_schema(lookup)
    assert schema["type"] == "function"
    function = schema["function"]
    assert function["name"] == "lookup"
    assert function["description"] == "Look up the weather forecast."
    assert function["parameters"]["required"] == ["city"]
    assert function["parameters"]["properties"] == {
        "city": {"type": "string", "description": "the city name"},
        "days": {"type": "integer", "description": "how many days ahead"},
        "metric": {"type": "boolean"},
    }


def test_text_tool_calls_are_parsed_in_order_with_unique_ids():
    text = (
        'thinking <tool_call>{"name": "lookup", "arguments": {"city": "Oslo"}}</tool_call>'
        ' and <tool_call> {"name": "lookup", "arguments": "{\\"city\\": \\"Rome\\"}"} </tool_call>'
    )
    first, second = parse_text_tool_calls(text)
    assert first["type"] == "function"
    assert first["function"] == {"name": "lookup", "arguments": json.dumps({"city": "Oslo"})}
    assert json.loads(second["function"]["arguments"]) == {"city": "Rome"}
    assert first["id"] != second["id"]


@pytest.mark.parametrize("body", ["{not json", "[1, 2]", '"just a string"', ""])
def test_malformed_text_tool_calls_become_nameless_calls(body):
    (call,) = parse_text_tool_calls(f"<tool_call>{body}</tool_call>")
    assert call["function"]["name"] == ""
    assert isinstance(call["function"]["arguments"], str)


def test_text_without_tool_calls_has_none():
    assert parse_text_tool_calls(None) == []
    assert parse_text_tool_calls("<tool_call>unclosed") == []


# ---------------------------------------------------------------------------------------
# Rubric


def exact(*, completion, **_):
    return 1.0 if completion == "yes" else 0.0


def length(*, completion, **_):
    return len(completion)


def test_rubric_keeps_every_value_and_weights_the_sum():
    rubric = Rubric([exact, length], [1.0, 0.5])
    values, total = rubric.score(completion="yes")
    assert values == {"exact": 1.0, "length": 3.0}
    assert total == pytest.approx(1.0 + 1.5)
    assert rubric.names == ["exact", "length"]
    assert rubric.weights == {"exact": 1.0, "length": 0.5}


def test_rubric_weight_zero_functions_are_reported_but_not_summed():
    rubric = Rubric()
    rubric.add(exact)
    rubric.add(length, 0.0, name="chars")
    values, total = rubric.score(completion="no")
    assert values == {"exact": 0.0, "chars": 2.0}
    assert total == 0.0


def test_rubric_rejects_duplicate_names_and_mismatched_weights():
    rubric = Rubric([exact])
    with pytest.raises(ValueError, match="'exact' is already in the rubric"):
        rubric.add(exact)
    with pytest.raises(ValueError, match="2 functions but 1 weights"):
        Rubric([exact, length], [1.0])


# ---------------------------------------------------------------------------------------
# Parsers


def test_xml_parser_takes_the_last_complete_tag_and_strips_it():
    parser = XMLParser(["answer", "move"])
    parsed = parser.parse("<answer> 1 </answer> <answer>\n2\n</answer> <move>3")
    assert parsed == {"answer": "2", "move": None}
    assert parser.parse_answer(None, "answer") is None
    assert not parser.has_all("<answer>1</answer>")
    assert parser.has_all("<move>4</move><answer>1</answer>")
    assert parser.format(answer="7", move="2") == "<answer>7</answer><move>2</move>"


def test_xml_parser_spans_lines_and_escapes_tag_names():
    assert XMLParser(["a.b"]).parse("<a.b>x\ny</a.b> <aXb>z</aXb>") == {"a.b": "x\ny"}


def test_think_parser_splits_reasoning_from_the_answer():
    think = ThinkParser()
    assert think.parse("  <think>plan\n</think>\n<move>4</move>") == ("plan", "<move>4</move>")
    assert think.parse("no thinking") == (None, "no thinking")
    assert think.parse("<think>never closed <move>1</move>") == (
        None,
        "<think>never closed <move>1</move>",
    )
    assert think.parse(None) == (None, "")
    assert think.answer("<think>a</think>b") == "b"
    assert think.think("<think>a</think>b") == "a"


def test_assistant_text_helpers_read_only_assistant_messages():
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "one"},
        {"role": "tool", "content": "result"},
        {"role": "assistant", "content": None, "tool_calls": []},
    ]
    assert last_assistant_text(messages) == ""
    assert assistant_texts(messages) == ["one", ""]
    assert last_assistant_text(messages[:3]) == "one"
    assert last_assistant_text([]) == ""
    assert assistant_texts([]) == []
