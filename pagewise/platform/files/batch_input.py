"""The shape of a batch input file, checked when it is uploaded: JSONL, one request per line, as OpenAI's Batch
API reads it — `{"custom_id": str, "method": "POST", "url": "/v1/chat/completions" | "/v1/completions",
"body": {...}}` — with every `custom_id` distinct and at most `MAX_LINES` lines. A file that breaks any rule is
refused whole, with the first broken line named (1-based); whether each `body` is one its endpoint accepts is
checked when a batch is created from the file."""

from __future__ import annotations

import json
from dataclasses import dataclass

MAX_LINES = 50_000
BATCH_URLS = ("/v1/chat/completions", "/v1/completions")
MAX_CUSTOM_ID_CHARS = 512


class BatchInputError(ValueError):
    """What is wrong with a batch input file; `line` is 1-based, or None for the file as a whole."""

    def __init__(self, message: str, line: int | None = None) -> None:
        super().__init__(message if line is None else f"line {line}: {message}")
        self.line = line


@dataclass(frozen=True, slots=True)
class BatchLine:
    line: int
    custom_id: str
    url: str
    body: dict


def read_batch_input(content: bytes) -> list[BatchLine]:
    """Every request of a batch input file, in order; a `BatchInputError` for the first rule it breaks."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as error:
        raise BatchInputError(f"the file is not UTF-8 text (byte {error.start})") from None
    lines = [(number, raw) for number, raw in enumerate(text.splitlines(), 1) if raw.strip()]
    if not lines:
        raise BatchInputError("the file holds no request: one JSON object per line is expected")
    if len(lines) > MAX_LINES:
        raise BatchInputError(f"the file holds {len(lines):,} requests; at most {MAX_LINES:,} are allowed")
    seen: set[str] = set()
    return [_line(number, raw, seen) for number, raw in lines]


def _line(number: int, raw: str, seen: set[str]) -> BatchLine:
    try:
        request = json.loads(raw)
    except ValueError as error:
        raise BatchInputError(f"not valid JSON ({error.msg} at column {error.colno})", number) from None
    if not isinstance(request, dict):
        raise BatchInputError("each line must be a JSON object", number)
    unknown = sorted(set(request) - {"custom_id", "method", "url", "body"})
    if unknown:
        raise BatchInputError(f"unknown field {unknown[0]!r}", number)
    custom_id = request.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID_CHARS:
        raise BatchInputError(f"custom_id must be a string of 1 to {MAX_CUSTOM_ID_CHARS} characters", number)
    if "\x00" in custom_id:
        raise BatchInputError("custom_id must not contain U+0000", number)
    if custom_id in seen:
        raise BatchInputError(f"custom_id {custom_id!r} is used by an earlier line", number)
    seen.add(custom_id)
    if request.get("method") != "POST":
        raise BatchInputError(f"method must be 'POST', got {request.get('method')!r}", number)
    url = request.get("url")
    if url not in BATCH_URLS:
        raise BatchInputError(f"url must be one of {', '.join(BATCH_URLS)}; got {url!r}", number)
    body = request.get("body")
    if not isinstance(body, dict):
        raise BatchInputError("body must be a JSON object (the request's body for its url)", number)
    return BatchLine(number, custom_id, url, body)
