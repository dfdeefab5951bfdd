"""A batch line's line in the output or error file, OpenAI's shape: `{"id", "custom_id", "response":
{"status_code", "request_id", "body"}, "error"}` — the body a request to the line's endpoint would have answered
(its completion, or its error), or `response` null and `error` `{code, message}` for a line that never ran
(cancelled, expired)."""

from __future__ import annotations

from typing import Any

import msgspec

from pagewise.platform.db.ids import new_id
from pagewise.platform.db.models import BatchLine, RequestRecord, as_utc
from pagewise.platform.errors import APIError
from pagewise.platform.inference.job import engine_error
from pagewise.platform.inference.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    Completion,
    CompletionChoice,
    PromptTokensDetails,
    Usage,
)
from pagewise.platform.requests.store import row_error
from pagewise.serving.protocol import RequestStatus


def _line(line: BatchLine, response: dict[str, Any] | None, error: dict[str, str] | None) -> dict[str, Any]:
    return {"id": new_id("batch_req"), "custom_id": line.custom_id, "response": response, "error": error}


def finished_result(line: BatchLine, row: RequestRecord) -> tuple[bool, dict[str, Any]]:
    """(whether it succeeded, its result) for a line whose request's row is final."""
    if row.status == RequestStatus.COMPLETED:
        return True, _line(line, {"status_code": 200, "request_id": row.id, "body": _completion(row)}, None)
    error = row_error(row)
    failure = engine_error(error) if error is not None else APIError(499, "the request was cancelled")
    return False, refused_result(line, failure, row.id)


def refused_result(line: BatchLine, error: APIError, request_id: str | None = None) -> dict[str, Any]:
    """The result of a line its endpoint answered with `error` (refused at admission, or failed)."""
    body = msgspec.to_builtins(error.body())
    return _line(line, {"status_code": error.status_code, "request_id": request_id, "body": body}, None)


def unrun_result(line: BatchLine, code: str, message: str) -> dict[str, Any]:
    """The result of a line that never ran: `batch_cancelled` or `batch_expired`."""
    return _line(line, None, {"code": code, "message": message})


def _completion(row: RequestRecord) -> dict[str, Any]:
    usage = Usage(
        row.prompt_tokens,
        row.completion_tokens,
        row.prompt_tokens + row.completion_tokens,
        PromptTokensDetails(row.cached_tokens),
    )
    created = int(as_utc(row.finished_at or row.queued_at).timestamp())
    choices = row.output or []
    if row.endpoint == "chat.completions":
        chat = [
            ChatChoice(c["index"], AssistantMessage("assistant", c["text"]), None, c["finish_reason"]) for c in choices
        ]
        return msgspec.to_builtins(ChatCompletion(row.id, created, row.model, chat, usage))
    texts = [CompletionChoice(c["index"], c["text"], None, c["finish_reason"]) for c in choices]
    return msgspec.to_builtins(Completion(row.id, created, row.model, texts, usage))
