"""Tool calling on chat completions: OpenAI's `tools`, `tool_choice`, `parallel_tool_calls` and the messages that
carry calls and their results.

The model is told about the functions in a system message and calls one by answering
`<tool_call>{"name": …, "arguments": {…}}</tool_call>` — the format of Hermes and Qwen, which many open chat
models are tuned on — one block per call. What each `tool_choice` means:
- `none`: no function is offered; the answer is text.
- `auto` (the default when `tools` are given): the model answers text or calls; an answer that starts with a
  `<tool_call>` block, and whose blocks all parse as calls of offered functions with arguments valid JSON objects,
  is returned as `tool_calls` (`finish_reason` `tool_calls`); anything else is content.
- `required`, or a named function: the answer is constrained by a grammar (structured outputs) to calls — one, or
  with `parallel_tool_calls` (OpenAI's default) and `required` one to as many as there are functions — and each
  call's `arguments` to its function's `parameters` schema, so they always parse and validate (a cut by
  `max_tokens` is `length`, as content).
Earlier calls and tool results in `messages` are rendered in the same format (`<tool_call>…</tool_call>` in the
assistant's turn, `<tool_response>…</tool_response>` in the tool's), so a conversation can go round.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any, Literal

from pagewise.engine.errors import InvalidRequestError
from pagewise.engine.structured_outputs import StructuredOutputsParams
from pagewise.platform.inference.schemas import ChatCompletionRequest, FunctionCall, NamedToolChoice, ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"\s*<tool_call>(.*?)</tool_call>\s*", re.DOTALL)


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a request's tools mean for its prompt, its constraint and its answer."""

    mode: Literal["auto", "required"]
    functions: dict[str, dict[str, Any]]  # name -> {"name", "description", "parameters"}
    only: str | None  # the function a named tool_choice forces
    parallel: bool

    @property
    def constrained(self) -> bool:
        return self.mode == "required" or self.only is not None


def plan_tools(body: ChatCompletionRequest) -> ToolPlan | None:
    """The request's tool plan, or None when no function is offered; an inconsistent request is a 400."""
    choice, tools = body.tool_choice, body.tools or []
    if not tools:
        if choice not in (None, "none"):
            raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
        if body.parallel_tool_calls is not None:
            raise InvalidRequestError("parallel_tool_calls needs tools", param="parallel_tool_calls")
        return None
    functions: dict[str, dict[str, Any]] = {}
    for index, tool in enumerate(tools):
        function = tool.function
        if function.name in functions:
            raise InvalidRequestError(f"two tools are named {function.name!r}", param=f"tools[{index}].function.name")
        parameters = function.parameters if function.parameters is not None else {"type": "object"}
        functions[function.name] = {"name": function.name, "description": function.description or "",
                                    "parameters": parameters}
    if choice == "none":
        return None
    only = None
    if isinstance(choice, NamedToolChoice):
        only = choice.function.name
        if only not in functions:
            raise InvalidRequestError(f"tool_choice names {only!r}, which is not in tools", param="tool_choice")
    parallel = body.parallel_tool_calls is not False
    return ToolPlan("required" if choice == "required" else "auto", functions, only, parallel)


def system_prompt(plan: ToolPlan) -> str:
    offered = [plan.functions[plan.only]] if plan.only else list(plan.functions.values())
    listing = "\n".join(json.dumps(f, separators=(",", ":")) for f in offered)
    return (
        "You can call functions. To call one, answer with exactly "
        f'{OPEN}{{"name": <function name>, "arguments": <arguments as a JSON object>}}{CLOSE}'
        " — one such block per call and nothing else. Otherwise answer normally.\n"
        f"Functions:\n{listing}"
    )


def constraint(plan: ToolPlan) -> StructuredOutputsParams | None:
    """The grammar that holds a `required` or named answer to calls; None for `auto`. A parameters schema that
    cannot be enforced is a 400 naming the tool."""
    if not plan.constrained:
        return None
    names = [plan.only] if plan.only else list(plan.functions)
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": plan.functions[name]["parameters"]},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name in names
    ]
    # parallel: at most one call per offered function, so a model cannot loop on calls until max_tokens
    most = len(names) if plan.parallel and plan.only is None else 1
    lark = (
        f"start: call{{1,{most}}}\n"
        f'call: "{OPEN}" body "{CLOSE}"\n'
        f"body: %json {json.dumps({'anyOf': calls})}"
    )
    try:
        return StructuredOutputsParams(grammar=lark)
    except InvalidRequestError as error:
        raise InvalidRequestError(f"tools cannot be enforced: {error}", param="tools") from None


def parse_calls(text: str, plan: ToolPlan) -> list[ToolCall] | None:
    """The calls an answer makes, or None when it is content (not made only of well-formed calls of offered
    functions)."""
    if not text.lstrip().startswith(OPEN):
        return None
    calls, end = [], 0
    for match in _BLOCK.finditer(text):
        if match.start() != end:
            return None
        end = match.end()
        try:
            call = json.loads(match.group(1))
        except ValueError:
            return None
        if not (isinstance(call, dict) and call.get("name") in plan.functions and isinstance(call.get("arguments"),
                                                                                               dict)):
            return None
        arguments = json.dumps(call["arguments"], ensure_ascii=False)
        calls.append(ToolCall(id=new_call_id(), function=FunctionCall(name=call["name"], arguments=arguments)))
    if end != len(text) or not calls:
        return None
    return calls


_CALL_HEAD = re.compile(r'\s*<tool_call>\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')
_CALL_TAIL = re.compile(r"\s*\}\s*</tool_call>")
_ARGUMENTS_KEY = re.compile(r'"arguments"\s*:')  # once it has arrived, a head that does not match never will
_MAX_HEAD_CHARS = 1024  # a head not recognised by then is not in the expected shape


@dataclass(frozen=True, slots=True)
class CallPiece:
    """A piece of a streamed call: its first piece names it (``name`` set, ``arguments`` empty), later pieces
    carry the next fragment of its arguments' JSON text."""

    index: int
    name: str | None
    arguments: str


class CallReader:
    """Reads a constrained answer (`constraint`'s grammar) as it streams and returns each call's pieces as soon
    as they are known: a call's name once `<tool_call>{"name": …, "arguments": ` has arrived, then its arguments'
    JSON text as it comes, to the end of the object — so a client sees the arguments grow, as OpenAI streams them.

    Invariants: the pieces of one call, joined, are exactly its arguments' text in the answer; ``calls`` counts
    the calls whose first piece was returned. An answer in a shape the grammar allows but this reader does not
    expect (the keys in the other order) makes it stop (``lost``): the calls after ``calls`` then go out whole."""

    def __init__(self) -> None:
        self._buffer = ""
        self._state = "head"  # head -> arguments -> tail -> head …
        self._depth, self._in_string, self._escaped = 0, False, False
        self.calls = 0
        self.lost = False

    def feed(self, text: str) -> list[CallPiece]:
        self._buffer += text
        pieces: list[CallPiece] = []
        while not self.lost and self._buffer:
            if self._state == "head":
                if not self._read_head(pieces):
                    break
            elif self._state == "arguments":
                if self._depth == 0:  # before the object: the space after the key's colon is no part of it
                    self._buffer = self._buffer.lstrip()
                end = self._object_end()
                if self.lost:  # not an object: nothing of it may go out as arguments
                    break
                fragment = self._buffer if end is None else self._buffer[:end]
                if fragment:
                    pieces.append(CallPiece(self.calls - 1, None, fragment))
                self._buffer = self._buffer[len(fragment) :]
                if end is None:
                    break
                self._state = "tail"
            else:
                match = _CALL_TAIL.match(self._buffer)
                if match is None:
                    self.lost = not ("}" + CLOSE).startswith("".join(self._buffer.split()))
                    break
                self._buffer, self._state = self._buffer[match.end() :], "head"
        return pieces

    def _read_head(self, pieces: list[CallPiece]) -> bool:
        match = _CALL_HEAD.match(self._buffer)
        if match is None:
            self.lost = _ARGUMENTS_KEY.search(self._buffer) is not None or len(self._buffer) > _MAX_HEAD_CHARS
            return False
        pieces.append(CallPiece(self.calls, json.loads(match.group(1)), ""))
        self.calls += 1
        self._buffer, self._state = self._buffer[match.end() :], "arguments"
        self._depth, self._in_string, self._escaped = 0, False, False
        return True

    def _object_end(self) -> int | None:
        """Where the arguments object ends in the buffer (exclusive), or None if it goes on; its scanning state
        carries over to the next call. An arguments value that is not an object loses the reader."""
        for i, char in enumerate(self._buffer):
            if self._depth == 0 and not char.isspace() and char != "{":
                self.lost = True
                return None
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        return None


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def might_be_calls(text: str) -> bool:
    """Whether a streamed answer so far could still turn out to be calls (its start is `<tool_call>` or a prefix)."""
    start = text.lstrip()
    return start.startswith(OPEN) or OPEN.startswith(start)


def render_message(role: str, content: str, tool_calls: list[ToolCall] | None) -> dict[str, str]:
    """A message of the conversation as the chat template gets it: an assistant's earlier calls in the call
    format, a tool's result wrapped as one."""
    if tool_calls:
        blocks = "".join(
            f'{OPEN}{{"name": {json.dumps(c.function.name)}, "arguments": {c.function.arguments}}}{CLOSE}'
            for c in tool_calls
        )
        content = content + blocks
    if role == "tool":
        content = f"<tool_response>{content}</tool_response>"
    return {"role": role, "content": content}
