"""`/v1/chat/completions`, `/v1/completions` and `/v1/models` (inference scope)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from litestar import Controller, Request, Response, get, post
from litestar.params import FromPath
from sqlalchemy.ext.asyncio import AsyncSession

from pagewise.platform.adapters.schemas import model_name
from pagewise.platform.adapters.service import tenant_adapters
from pagewise.platform.bodies import StrictBody, parse_body
from pagewise.platform.db.models import Adapter
from pagewise.platform.db.session import DbSession
from pagewise.platform.inference.job import InferenceJob
from pagewise.platform.inference.prompts import PreparedRequest, model_not_found, prepare_chat, prepare_completion
from pagewise.platform.inference.rendering import (
    SettlingStream,
    chat_completion,
    chat_events,
    completion,
    completion_events,
)
from pagewise.platform.inference.schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    Model,
    ModelList,
)
from pagewise.platform.keys.auth import Principal, requires_scope
from pagewise.platform.services import PlatformServices, Services
from pagewise.serving.protocol import ChoiceSoFar


class InferenceController(Controller):
    path = "/v1"
    guards = [requires_scope("inference")]
    tags = ["inference"]

    @post("/chat/completions", status_code=200)
    async def chat_completions(
        self,
        data: StrictBody[ChatCompletionRequest],
        request: Request[Principal, str, object],
        services: Services,
    ) -> Response[ChatCompletion]:
        """OpenAI Chat Completions; `stream: true` answers with server-sent events ending in `[DONE]`."""
        body = parse_body(data, ChatCompletionRequest)
        return await _answer(services, request.user, lambda: prepare_chat(body, request.user, services.engine),
                             chat_events, chat_completion)

    @post("/completions", status_code=200)
    async def completions(
        self,
        data: StrictBody[CompletionRequest],
        request: Request[Principal, str, object],
        services: Services,
    ) -> Response[Completion]:
        """OpenAI (legacy) Completions; `prompt` may be a string, strings, token ids or lists of token ids."""
        body = parse_body(data, CompletionRequest)
        return await _answer(services, request.user, lambda: prepare_completion(body, request.user, services.engine),
                             completion_events, completion)

    @get("/models")
    async def list_models(
        self, request: Request[Principal, str, object], services: Services, db_session: DbSession
    ) -> ModelList:
        """The models this key may use: every name the model is served under (`--served-model-name`), then the
        caller's active adapters on it (`<model>:<adapter>`), or those of them in its `allowed_models`."""
        names = [*services.engine.model_names, *await _adapter_models(db_session, services, request.user)]
        return ModelList([_model(services, name, request.user) for name in names if _usable(request.user, name)])

    @get("/models/{model_id:str}")
    async def get_model(
        self,
        model_id: FromPath[str],
        request: Request[Principal, str, object],
        services: Services,
        db_session: DbSession,
    ) -> Model:
        """A served model or one of the caller's adapters this key may use; any other is a 404, as if it did not
        exist (another tenant's adapter included)."""
        known = model_id in services.engine.model_names or model_id in await _adapter_models(
            db_session, services, request.user
        )
        if not known or not _usable(request.user, model_id):
            raise model_not_found(model_id, services.engine)
        return _model(services, model_id, request.user)


async def _adapter_models(session: AsyncSession, services: PlatformServices, principal: Principal) -> list[str]:
    """The names the caller's active adapters are requested by, oldest first."""
    base = services.engine.model_name
    query = tenant_adapters(principal.tenant_id).where(Adapter.status == "active", Adapter.base_model == base)
    return [model_name(row.base_model, row.name) for row in await session.scalars(query.order_by(Adapter.id))]


def _usable(principal: Principal, model: str) -> bool:
    allowed = principal.allowed_models
    return allowed is None or model in allowed or model.partition(":")[0] in allowed


def _model(services: PlatformServices, name: str, principal: Principal) -> Model:
    owner = "pagewise" if ":" not in name else principal.tenant_name
    return Model(name, services.started_at, owner, services.engine.max_model_len)


async def _answer(
    services: PlatformServices,
    principal: Principal,
    prepare: Callable[[], Awaitable[PreparedRequest]],
    events: Callable[[InferenceJob], AsyncIterator[bytes]],
    body: Callable[[InferenceJob, list[ChoiceSoFar]], Any],
) -> Response[Any] | SettlingStream:
    """Run one inference request: the cheap quota refusal first, then preparation (tokenizing, checks), admission,
    and the answer — `events` streamed as server-sent events, or `body` once the request ended."""
    await InferenceJob.precheck(services, principal)
    job = await InferenceJob.admit(services, principal, await prepare())
    if job.prepared.stream:
        return SettlingStream(job, events)
    return Response(body(job, await job.collect()), headers=job.headers)
