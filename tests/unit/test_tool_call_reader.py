"""`CallReader` reads a constrained tool-call answer as it streams: each call's name once its head has arrived,
then its arguments' text piece by piece, whatever the chunking; an answer in a shape it does not expect makes it
give up (the calls then go out whole) without returning a wrong piece."""

from __future__ import annotations

import json
import random

import pytest

from pagewise.platform.inference.tools import CallReader

ANSWER = (
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Pa\\"ris {x} ]", "unit": "celsius", '
    '"days": [1, {"a": [2]}]}}</tool_call>\n<tool_call>{"name":"get_time","arguments":{}}</tool_call>'
)


def _read(text: str, seed: int) -> tuple[CallReader, dict[int, list[str]]]:
    reader, calls, rng, at = CallReader(), {}, random.Random(seed), 0
    while at < len(text):
        size = rng.randint(1, 9)
        for piece in reader.feed(text[at : at + size]):
            if piece.name is not None:
                assert piece.index not in calls and piece.arguments == ""
                calls[piece.index] = [piece.name, ""]
            else:
                calls[piece.index][1] += piece.arguments
        at += size
    return reader, calls


@pytest.mark.parametrize("seed", range(40))
def test_any_chunking_gives_each_call_its_name_and_exact_arguments(seed: int) -> None:
    reader, calls = _read(ANSWER, seed)
    assert not reader.lost and reader.calls == 2
    assert [calls[0][0], calls[1][0]] == ["get_weather", "get_time"]
    assert json.loads(calls[0][1]) == {"city": 'Pa"ris {x} ]', "unit": "celsius", "days": [1, {"a": [2]}]}
    assert calls[0][1] == '{"city": "Pa\\"ris {x} ]", "unit": "celsius", "days": [1, {"a": [2]}]}'
    assert calls[1][1] == "{}"


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"arguments": {"city": "x"}, "name": "get_weather"}</tool_call>',  # the keys the other way
        '<tool_call>{"name": "get_weather", "arguments": "not an object"}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {}} trailing</tool_call>',
    ],
)
def test_an_unexpected_shape_loses_the_reader(text: str) -> None:
    reader, calls = _read(text, 0)
    assert reader.lost
    # what was returned before it gave up is right: a call's name alone, or its whole arguments object
    assert all(arguments == "" or isinstance(json.loads(arguments), dict) for _, arguments in calls.values())
