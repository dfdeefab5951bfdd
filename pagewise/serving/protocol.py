"""The engine protocol: every message between the API and the engines, as msgspec Structs. Imports no torch.

Both transports carry exactly these messages — the in-process loopback (embedded mode) and Redis Streams
(distributed mode) — so a route cannot tell them apart. One request's story on the wire:

    API ──Submit──▶ engine ──Delta…──▶ API        then exactly one of
                                                     Finished (completed / cancelled / failed, with the usage
                                                               written to the request's row)
                                                     Rejected (the engine refused the request before it ran)
    API ──Abort──▶  engine   (any time; the request ends `cancelled`, billed for what was computed)

Engine rejections cross as `Rejected` messages carrying an error code from `ErrorCode`, never as Python
exceptions. Every Redis key both sides use is named by `RedisKeys`, nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import TypeAlias

import msgspec

from pagewise.engine.model_config import ModelArchConfig
from pagewise.engine.sampling_params import SamplingParams
from pagewise.serving.money import micros_for


class RequestStatus(StrEnum):
    """A request's status, on its row and in `Finished`: `queued` → `running` → one terminal status, never changed
    afterwards."""

    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


class SpendRate(msgspec.Struct, frozen=True):
    """How a reservation's tokens count as spend: the first `prompt_tokens` at the input price, the rest at
    the output price (micro-dollars per million tokens)."""

    prompt_tokens: int
    input_per_mtok_micros: int
    output_per_mtok_micros: int

    def cost(self, tokens: int) -> int:
        prompt = min(tokens, self.prompt_tokens)
        return micros_for(prompt * self.input_per_mtok_micros + (tokens - prompt) * self.output_per_mtok_micros)


class Reservation(msgspec.Struct, frozen=True):
    """What one admitted request holds: `tokens`, `slots` concurrency slots (at least 1; 0 for a batch line) and
    `spend` micro-dollars (`rate.cost(tokens)`; 0 without a rate), counted for its tenant and, with `key_id`, its
    key.

    `minute` and `month` name the windows its tokens and spend were counted in (`minute` -1: none, a batch line).
    """

    id: str
    tenant_id: str
    tokens: int
    minute: int
    month: str
    slots: int = 1
    key_id: str | None = None
    spend: int = 0
    rate: SpendRate | None = None

    def spend_delta(self, actual_tokens: int, actual_cost: int | None = None) -> int:
        """What `reconcile` adds to the spend counters: the bill (`actual_cost`; without it, the rate's upper
        bound of `actual_tokens`, 0 without a rate) minus what was reserved."""
        if actual_cost is not None:
            return actual_cost - self.spend
        return 0 if self.rate is None else self.rate.cost(actual_tokens) - self.spend


class ErrorCode(StrEnum):
    """Why a request was refused or failed on the engine's side; the API maps each to one HTTP status."""

    INVALID_REQUEST = "invalid_request"  # 400: the input cannot run on this engine (names `param`)
    ENGINE_UNAVAILABLE = "engine_unavailable"  # 503: the engine died, or no worker could take the request
    WORKER_LOST = "worker_lost"  # 503: the worker running it died and it cannot be resumed or retried
    QUEUE_TIMEOUT = "queue_timeout"  # 503: it waited past its deadline before an engine took it
    INTERNAL = "internal_error"  # 500: the request failed inside the engine (alone: the others run on)


class TokenLogprob(msgspec.Struct, frozen=True):
    token_id: int
    token: str
    logprob: float


class PositionLogprobs(msgspec.Struct, frozen=True):
    """One generated position: the sampled token and the `top` alternatives, most likely first."""

    chosen: TokenLogprob
    top: list[TokenLogprob]


class ChoiceDelta(msgspec.Struct, frozen=True):
    """What one sample produced since its previous delta. `index` is request-wide: prompt `p`'s sample `i`
    is `p * n + i`."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[PositionLogprobs] | None = None


@dataclass(slots=True)
class ChoiceSoFar:
    """The sum of one sample's `ChoiceDelta`s: what the engine side writes to the row and the API answers with.
    `logprobs` None: not kept (the engine side's row has no place for them)."""

    index: int
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None
    logprobs: list[PositionLogprobs] | None = field(default_factory=list)

    def add(self, delta: ChoiceDelta) -> None:
        self.text.append(delta.text)
        self.num_tokens += len(delta.token_ids)
        self.finish_reason = delta.finish_reason or self.finish_reason
        if self.logprobs is not None and delta.logprobs:
            self.logprobs.extend(delta.logprobs)

    @property
    def full_text(self) -> str:
        return "".join(self.text)


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    """Tokens the engine computed for a request: what its row, its usage and its quota reconciliation record."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class ErrorInfo(msgspec.Struct, frozen=True):
    code: ErrorCode
    message: str
    param: str | None = None


class AdapterRef(msgspec.Struct, frozen=True):
    """A tenant's LoRA adapter as a request carries it: its id (`adapter-…`, also what a per-adapter price is
    keyed by), the name the tenant gave it, and the sha256 content address (`adapter_files.adapter_digest`) under
    which its files sit in the adapter store — the worker loads them from there and refuses files that hash
    otherwise."""

    id: str
    name: str
    digest: str


class Submit(msgspec.Struct, frozen=True, kw_only=True, tag="submit"):
    """One admitted request: its row exists (`queued`) and `reservation` holds its quota.

    `prompts` are token ids, already validated against the engine's `EngineInfo`; each runs `params.n`
    samples. `deadline` (Unix seconds) is when an engine that has not started it must give up on it. `model` is
    the base model's listed name (what workers are keyed by); `adapter`, when set, the tenant's adapter it runs
    under.
    """

    request_id: str
    tenant_id: str
    model: str
    endpoint: str
    prompts: list[list[int]]
    params: SamplingParams
    reservation: Reservation
    tenant_weight: float = 1.0
    priority: int = 0  # vLLM's: lower runs first; the body's, never better than the key's class allows
    deadline: float | None = None
    traceparent: str | None = None
    adapter: AdapterRef | None = None

    @property
    def usage_model(self) -> str:
        """The model its row, its usage and its bill are recorded under: `<base>:<adapter name>` under an
        adapter, else the base model."""
        return self.model if self.adapter is None else f"{self.model}:{self.adapter.name}"

    @property
    def price_models(self) -> tuple[str, ...]:
        return price_models(self.model, self.adapter)


def price_models(model: str, adapter: AdapterRef | None) -> tuple[str, ...]:
    """Where a request's price is looked up, first match wins: its adapter's own price (keyed by the adapter's
    id), then its base model's."""
    return (model,) if adapter is None else (adapter.id, model)


class Abort(msgspec.Struct, frozen=True, tag="abort"):
    request_id: str


class Delta(msgspec.Struct, frozen=True, kw_only=True, tag="delta"):
    """News since the previous delta. `attempt` counts deliveries of the Submit (1 first): a higher one means the
    request restarted from scratch on another worker. Token counts cover every prompt that reached the engine."""

    attempt: int = 1
    choices: list[ChoiceDelta]
    prompt_tokens: int
    cached_tokens: int
    # on an attempt's first delta with tokens: seconds from the engine side taking the Submit to that first token
    # (the API subtracts it from what it waited to get the queue hop); None on every other delta
    engine_ttft_s: float | None = None


class Finished(msgspec.Struct, frozen=True, kw_only=True, tag="finished"):
    """The request's end, sent after its final row was written: `status` is the row's terminal status and
    `usage` what was billed. `error` is set when `status` is `failed`."""

    attempt: int = 1
    status: str
    usage: Usage
    error: ErrorInfo | None = None
    started_at: float | None = None
    first_token_at: float | None = None
    finished_at: float


class Rejected(msgspec.Struct, frozen=True, kw_only=True, tag="rejected"):
    """The engine refused the request before running it; its row is `failed` and nothing was billed."""

    error: ErrorInfo


Event: TypeAlias = Delta | Finished | Rejected
"""What flows back for one request; the last one is a `Finished` or a `Rejected`."""


class EngineLimits(msgspec.Struct, frozen=True):
    """What an API replica checks a request against without the model."""

    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    kv_capacity_tokens: int


class TokenizerSpec(msgspec.Struct, frozen=True):
    """Everything needed to rebuild the engine's tokenizer: `tokenizer.json`, EOS ids, chat template."""

    tokenizer_json: str
    eos_token_ids: list[int]
    chat_template: str | None
    special_tokens: dict[str, str]


class AdapterSupport(msgspec.Struct, frozen=True):
    """An engine that serves LoRA adapters: the base model's shape and the largest rank, which is all an API
    replica needs to check an upload exactly as a worker will load it (`adapter_files.parse_adapter`)."""

    arch: ModelArchConfig
    max_lora_rank: int


class EngineInfo(msgspec.Struct, frozen=True):
    """What an engine serves: published by every worker of a model, read by API replicas at start."""

    model: str
    limits: EngineLimits
    tokenizer: TokenizerSpec | None = None  # None in process, where the tokenizer object itself is shared
    aliases: tuple[str, ...] = ()  # other names a request may use for the model (`--served-model-name`)
    adapters: AdapterSupport | None = None  # None: the engine serves the base model only (LoRA off)


class WorkerHeartbeat(msgspec.Struct, frozen=True, kw_only=True):
    """A worker's state, refreshed every heartbeat; a worker whose heartbeat expired is dead."""

    worker_id: str
    model: str
    host: str
    started_at: float
    last_heartbeat: float
    running: int
    waiting: int
    max_num_seqs: int
    kv_usage: float
    prefix_hit_rate: float
    stats: dict[str, float | int | str] = {}
    # sequences waiting per tenant (tenants with none left out); None where the engine's policy (fcfs) keeps no
    # per-tenant queues
    tenants_waiting: dict[str, int] | None = None

    @property
    def load(self) -> int:
        return self.running + self.waiting


_encoder = msgspec.msgpack.Encoder()
_event_decoder = msgspec.msgpack.Decoder(Event)
_submit_decoder = msgspec.msgpack.Decoder(Submit)


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decode_event(data: bytes) -> Event:
    return _event_decoder.decode(data)


def decode_submit(data: bytes) -> Submit:
    return _submit_decoder.decode(data)


class RedisKeys:
    """The names of every Redis key and stream of the distributed mode, under one prefix.

    - `submissions(worker)`: a worker's inbox stream (`Submit`), consumed by the group `GROUP`;
    - `events(request)`: one request's outbox stream (`Delta`… then `Finished` / `Rejected`), readable by any
      API replica from its start, trimmed and expiring;
    - `aborted(request)`: set when a request is cancelled; `aborts(model)`: the pub/sub channel that tells the
      model's workers at once;
    - `workers(model)`: hash worker id → its latest `WorkerHeartbeat`; `alive(worker)`: expires with the
      heartbeat; `info(model)`: the model's `EngineInfo`; `dead_letters(model)`: Submits delivered too often.
    """

    GROUP = "engines"

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def submissions(self, worker_id: str) -> str:
        return f"{self.prefix}submit:{worker_id}"

    def events(self, request_id: str) -> str:
        return f"{self.prefix}events:{request_id}"

    def aborted(self, request_id: str) -> str:
        return f"{self.prefix}aborted:{request_id}"

    def aborts(self, model: str) -> str:
        return f"{self.prefix}aborts:{model}"

    def workers(self, model: str) -> str:
        return f"{self.prefix}workers:{model}"

    def alive(self, worker_id: str) -> str:
        return f"{self.prefix}alive:{worker_id}"

    def info(self, model: str) -> str:
        return f"{self.prefix}engine-info:{model}"

    def dead_letters(self, model: str) -> str:
        return f"{self.prefix}dead-letters:{model}"
