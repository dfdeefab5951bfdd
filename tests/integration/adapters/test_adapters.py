"""Tenant adapters over HTTP: a tenant uploads PEFT's files, requests `<base>:<adapter>`, and gets exactly what HF
transformers + PEFT generate with the same adapter; another tenant can neither use, list, download nor time it; a
bad upload is a 400 naming the problem and stores nothing; usage and spend are recorded per adapter."""

from __future__ import annotations

import asyncio
import copy
import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis.asyncio as redis
import torch
from safetensors.numpy import save as save_safetensors

from pagewise.engine.adapter_files import CONFIG_FILE, WEIGHTS_FILE
from pagewise.engine.async_engine import AsyncLLMEngine
from pagewise.engine.config import EngineConfig
from pagewise.platform.app import create_app
from pagewise.platform.keys.key_format import generate_key
from pagewise.platform.quotas.redis_store import RedisQuotaStore
from pagewise.platform.requests.store import RequestStore
from pagewise.platform.settings import Settings
from pagewise.serving.adapter_store import AdapterStore
from pagewise.serving.host import EngineHost
from pagewise.serving.protocol import RedisKeys
from pagewise.worker.redis_worker import RedisWorker

from ..conftest import REDIS_URL
from ..harness import Platform, bearer
from ..transports.conftest import STOP_TIMEOUT_S, _within, with_admin

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.anyio

BASE = "tiny"
MAX_TOKENS = 8
PROMPTS = [[5, 900, 31, 7, 4000, 12, 77, 301, 45], [1200, 3, 48000, 20]]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {"support-bot": (8, 16, ALL), "legal": (16, 8, ["q_proj", "v_proj", "down_proj"])}
MAX_ADAPTER_BYTES = 4 * 2**20


def random_adapter(base: torch.nn.Module, rank: int, alpha: int, targets: list[str], seed: int, directory: Path):
    """A random PEFT adapter saved in `directory`; returns the PEFT model (the oracle)."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False)
    model = peft.get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, peft.tuners.lora.LoraLayer):
                module.lora_B["default"].weight.normal_(0, 0.3)
    model.save_pretrained(directory)
    return model.eval()


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    for _ in range(MAX_TOKENS):
        ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model("tenant-adapters")


@pytest.fixture(scope="module")
def adapters(tiny, tmp_path_factory) -> dict[str, tuple[bytes, bytes, list[list[int]]]]:
    """Each adapter's two files and its HF + PEFT greedy tokens per prompt; None: the base model's."""
    _, base = tiny
    made = {None: (b"", b"", [hf_greedy(base, p) for p in PROMPTS])}
    for seed, (name, (rank, alpha, targets)) in enumerate(ADAPTERS.items(), start=1):
        directory = tmp_path_factory.mktemp(name)
        oracle = random_adapter(base, rank, alpha, targets, seed, directory)
        made[name] = (
            (directory / CONFIG_FILE).read_bytes(),
            (directory / WEIGHTS_FILE).read_bytes(),
            [hf_greedy(oracle, p) for p in PROMPTS],
        )
        assert made[name][2] != made[None][2]
    return made


@pytest.fixture(scope="module")
def llm_engine(tiny) -> Iterator[AsyncLLMEngine]:
    """The tiny model with LoRA on and fewer slots than the adapters the tests load (replaces the session's)."""
    config = EngineConfig(
        model=str(tiny[0]), served_model_name=BASE, dtype="float32", max_model_len=256, block_size=8,
        enable_lora=True, max_loras=2, max_lora_rank=16,
    )
    engine = AsyncLLMEngine(config, progress=False)
    yield engine
    engine.shutdown()


@pytest.fixture
def platform_settings(tmp_path: Path) -> dict:
    return {"export_dir": str(tmp_path), "max_adapter_bytes": MAX_ADAPTER_BYTES}


def store_root(platform: Platform) -> Path:
    return platform.services.settings.adapters_path


async def upload(platform: Platform, key: str, name: str, config: bytes, weights: bytes, **fields: str):
    return await platform.http.post(
        "/v1/adapters",
        data={"name": name, **fields},
        files={"config": (CONFIG_FILE, config), "weights": (WEIGHTS_FILE, weights)},
        headers=bearer(key),
    )


async def uploaded(platform: Platform, key: str, name: str, adapters, as_name: str | None = None) -> dict:
    config, weights, _ = adapters[name]
    response = await upload(platform, key, as_name or name, config, weights)
    assert response.status_code == 200, response.text
    return response.json()


async def complete(platform: Platform, key: str, model: str, prompt: list[int]):
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    return await platform.http.post("/v1/completions", json=body, headers=bearer(key))


def text_of(tokens: list[int], platform: Platform) -> str:
    return platform.services.engine.transport.tokenizer().decode(tokens)


async def test_requests_under_adapters_equal_hf_peft_mixed_with_the_base_model(platform: Platform, adapters) -> None:
    tenant, key = await platform.tenant_with_key()
    objects = {name: await uploaded(platform, key, name, adapters) for name in ADAPTERS}
    bot = objects["support-bot"]
    assert (bot["model"], bot["base_model"], bot["rank"], bot["status"]) == (f"{BASE}:support-bot", BASE, 8, "active")
    assert bot["target_modules"] == sorted(ALL) and len(bot["digest"]) == 64
    assert (store_root(platform) / bot["digest"] / WEIGHTS_FILE).read_bytes() == adapters["support-bot"][1]

    cases = [(name, i) for name in (None, *ADAPTERS) for i in range(len(PROMPTS))]
    responses = await asyncio.gather(
        *(complete(platform, key, BASE if name is None else f"{BASE}:{name}", PROMPTS[i]) for name, i in cases)
    )
    for (name, i), response in zip(cases, responses, strict=True):
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["model"] == (BASE if name is None else f"{BASE}:{name}")
        assert body["choices"][0]["text"] == text_of(adapters[name][2][i], platform), (name, i)
        assert body["usage"]["completion_tokens"] == MAX_TOKENS

    usage = await platform.http.get("/v1/usage", params={"group_by": ["model"]}, headers=bearer(key))
    requests = {
        r["model"]: r["num_model_requests"] for bucket in usage.json()["data"] for r in bucket["results"]
    }
    assert requests == {BASE: 2, f"{BASE}:support-bot": 2, f"{BASE}:legal": 2}
    lora = (await platform.http.get("/admin/engine", headers=bearer(platform.admin_key))).json()["stats"]["lora"]
    assert lora["loads"] >= 2 and set(lora["resident"]) <= {f"{tenant['id']}/{o['digest']}" for o in objects.values()}


async def test_another_tenants_adapter_cannot_be_used_listed_or_downloaded(platform: Platform, adapters) -> None:
    _, owner = await platform.tenant_with_key()
    _, other = await platform.tenant_with_key()
    adapter = await uploaded(platform, owner, "support-bot", adapters)
    model = adapter["model"]

    own = (await platform.http.get("/v1/models", headers=bearer(owner))).json()["data"]
    assert [m["id"] for m in own] == [BASE, model]
    listed = (await platform.http.get("/v1/models", headers=bearer(other))).json()["data"]
    assert [m["id"] for m in listed] == [BASE]
    assert (await platform.http.get("/v1/adapters", headers=bearer(other))).json()["data"] == []

    missing = await complete(platform, other, f"{BASE}:no-such-adapter", PROMPTS[0])
    theirs = await complete(platform, other, model, PROMPTS[0])
    assert missing.status_code == theirs.status_code == 404
    assert theirs.json()["error"]["code"] == "model_not_found"
    assert theirs.json()["error"]["message"].replace(model, "X") == missing.json()["error"]["message"].replace(
        f"{BASE}:no-such-adapter", "X"
    )
    for method, path in [
        ("GET", f"/v1/models/{model}"),
        ("GET", f"/v1/adapters/{adapter['id']}"),
        ("GET", f"/v1/adapters/{adapter['id']}/files/{WEIGHTS_FILE}"),
        ("GET", f"/v1/adapters/{adapter['id']}/files/{CONFIG_FILE}"),
        ("PATCH", f"/v1/adapters/{adapter['id']}"),
        ("DELETE", f"/v1/adapters/{adapter['id']}"),
    ]:
        body = {"json": {"status": "disabled"}} if method == "PATCH" else {}
        response = await platform.http.request(method, path, headers=bearer(other), **body)
        assert response.status_code == 404, (method, path, response.text)
    # the owner still has it, unchanged, and may download it
    mine = await platform.http.get(f"/v1/adapters/{adapter['id']}/files/{WEIGHTS_FILE}", headers=bearer(owner))
    assert mine.status_code == 200 and mine.content == adapters["support-bot"][1]
    assert (await complete(platform, owner, model, PROMPTS[0])).status_code == 200


async def test_identical_files_of_two_tenants_share_no_engine_state(platform: Platform, adapters) -> None:
    """Whether an adapter is resident, or a prompt cached under it, is never visible to another tenant: the same
    bytes uploaded by two tenants share the store's directory, but neither a slot, a host copy nor KV."""
    first, a = await platform.tenant_with_key()
    second, b = await platform.tenant_with_key()
    one = await uploaded(platform, a, "legal", adapters)
    two = await uploaded(platform, b, "legal", adapters, as_name="same-bytes")
    assert one["digest"] == two["digest"] and one["id"] != two["id"]

    async def lora_stats() -> dict:
        return (await platform.http.get("/admin/engine", headers=bearer(platform.admin_key))).json()["stats"]["lora"]

    prompt = PROMPTS[0] * 3  # three full blocks: a second run of it by the same tenant hits the cache
    assert (await complete(platform, a, one["model"], prompt)).status_code == 200
    again = await complete(platform, a, one["model"], prompt)
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    before = await lora_stats()
    response = await complete(platform, b, two["model"], prompt)
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == again.json()["choices"][0]["text"]
    assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    after = await lora_stats()
    assert after["reads"] == before["reads"] + 1 and after["loads"] == before["loads"] + 1
    assert f"{second['id']}/{two['digest']}" in after["resident"]
    assert f"{first['id']}/{one['digest']}" in after["resident"]


def _config(**changes) -> bytes:
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]} | changes
    return json.dumps(config).encode()


def _weights(tiny, rank: int = 8, poison: bool = False, hidden: int | None = None) -> bytes:
    arch = tiny[1].config
    size = hidden or arch.hidden_size
    kv = arch.num_key_value_heads * (arch.hidden_size // arch.num_attention_heads)
    tensors = {}
    for layer in range(arch.num_hidden_layers):
        for proj, out in (("q_proj", size), ("v_proj", kv)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = np.full((rank, size), 0.01, np.float32)
            tensors[f"{prefix}.lora_B.weight"] = np.full((out, rank), 0.01, np.float32)
    if poison:
        next(iter(tensors.values()))[0, 0] = np.nan
    return save_safetensors(tensors)


BAD_UPLOADS = {  # case: (config, weights maker, what the 400's message names)
    "malformed config": (b"{not json", lambda t: _weights(t), "adapter_config.json is not valid JSON"),
    "oversized": (_config(), lambda t: _weights(t) + b"\0" * MAX_ADAPTER_BYTES, "at most"),
    "another base model": (_config(), lambda t: _weights(t, hidden=48), "another base model"),
    "rank above the limit": (_config(r=32), lambda t: _weights(t, rank=32), "rank 32"),
    "unknown target module": (_config(target_modules=["q_proj", "lm_head"]), lambda t: _weights(t), "lm_head"),
    "NaN": (_config(), lambda t: _weights(t, poison=True), "NaN"),
    "truncated weights": (_config(), lambda t: _weights(t)[:-100], "safetensors"),
}


@pytest.mark.parametrize("case", list(BAD_UPLOADS))
async def test_a_bad_upload_is_a_400_naming_the_problem_and_stores_nothing(platform: Platform, tiny, case) -> None:
    _, key = await platform.tenant_with_key()
    config, weights, named = BAD_UPLOADS[case]
    response = await upload(platform, key, "bad", config, weights(tiny))
    assert response.status_code == 400, response.text
    assert named in response.json()["error"]["message"], response.json()
    assert (await platform.http.get("/v1/adapters", headers=bearer(key))).json()["data"] == []
    assert not store_root(platform).exists() or not any(store_root(platform).iterdir())


@pytest.mark.parametrize(
    ("fields", "param"), [({"name": "has:colon"}, "name"), ({"name": ""}, "name"), ({"model": "other"}, "model")]
)
async def test_a_bad_name_or_base_model_is_a_400(platform: Platform, tiny, fields, param) -> None:
    _, key = await platform.tenant_with_key()
    response = await upload(platform, key, **({"name": "ok"} | fields), config=_config(), weights=_weights(tiny))
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


async def test_disable_enable_delete_and_a_name_taken_twice(platform: Platform, adapters) -> None:
    _, key = await platform.tenant_with_key()
    config, weights, _ = adapters["support-bot"]
    config += b"\n"  # bytes of its own (other tests' tenants hold the same adapter): its files go with it
    adapter = (await upload(platform, key, "support-bot", config, weights)).json()
    assert (await upload(platform, key, "support-bot", config, weights)).status_code == 409

    path = f"/v1/adapters/{adapter['id']}"
    disabled = await platform.http.patch(path, json={"status": "disabled"}, headers=bearer(key))
    assert disabled.status_code == 200 and disabled.json()["status"] == "disabled"
    refused = await complete(platform, key, adapter["model"], PROMPTS[0])
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "adapter_disabled"
    assert [m["id"] for m in (await platform.http.get("/v1/models", headers=bearer(key))).json()["data"]] == [BASE]
    assert (await platform.http.patch(path, json={"status": "active"}, headers=bearer(key))).status_code == 200
    assert (await complete(platform, key, adapter["model"], PROMPTS[0])).status_code == 200

    assert (await platform.http.delete(path, headers=bearer(key))).json() == {
        "id": adapter["id"], "deleted": True, "object": "adapter"
    }
    assert (await complete(platform, key, adapter["model"], PROMPTS[0])).status_code == 404
    assert not (store_root(platform) / adapter["digest"]).exists()
    again = await uploaded(platform, key, "support-bot", adapters)  # the name is free again
    assert again["id"] != adapter["id"]


async def test_deleting_the_last_user_of_files_waits_for_their_lock_and_an_identical_upload_keeps_them(
    platform: Platform, adapters
) -> None:
    """Deleting an adapter removes its files only under their digest's store lock, so a deletion racing another
    tenant's upload of the same bytes either finishes first (the upload writes them again) or finds the new user:
    the uploaded adapter always has its files."""
    config, weights, _ = adapters["legal"]
    config += b"\n\n"  # bytes no other test's tenant holds
    _, key_a = await platform.tenant_with_key()
    _, key_b = await platform.tenant_with_key()
    first = (await upload(platform, key_a, "legal", config, weights)).json()
    store = AdapterStore(store_root(platform))
    directory = store.directory(first["digest"])
    held = await asyncio.to_thread(store.lock, first["digest"])
    try:
        deleting = asyncio.create_task(platform.http.delete(f"/v1/adapters/{first['id']}", headers=bearer(key_a)))
        uploading = asyncio.create_task(upload(platform, key_b, "legal", config, weights))
        await asyncio.sleep(1.0)
        assert not deleting.done() and not uploading.done()  # both wait for the lock the test holds
        assert directory.is_dir()
    finally:
        os.close(held)
    assert (await asyncio.wait_for(deleting, 30)).status_code == 200
    second = await asyncio.wait_for(uploading, 30)
    assert second.status_code == 200, second.text
    assert (directory / CONFIG_FILE).read_bytes() == config and (directory / WEIGHTS_FILE).read_bytes() == weights
    served = await complete(platform, key_b, second.json()["model"], PROMPTS[0])
    assert served.status_code == 200, served.text


async def test_an_admin_registers_for_a_tenant_and_prices_an_adapter(platform: Platform, adapters) -> None:
    tenant, key = await platform.tenant_with_key()
    config, weights, _ = adapters["legal"]
    admin = bearer(platform.admin_key)
    response = await platform.http.post(
        f"/admin/tenants/{tenant['id']}/adapters",
        data={"name": "legal"},
        files={"config": (CONFIG_FILE, config), "weights": (WEIGHTS_FILE, weights)},
        headers=admin,
    )
    assert response.status_code == 200, response.text
    adapter = response.json()
    listed = (await platform.http.get(f"/admin/tenants/{tenant['id']}/adapters", headers=admin)).json()["data"]
    assert [a["id"] for a in listed] == [adapter["id"]]
    assert [a["id"] for a in (await platform.http.get("/v1/adapters", headers=bearer(key))).json()["data"]] == [
        adapter["id"]
    ]
    # the base model costs $1 per million tokens each way, this adapter $10: requests are priced by their own
    for model, dollars in ((BASE, 1), (adapter["id"], 10)):
        price = {"model": model, "input": dollars, "output": dollars}
        assert (await platform.http.post("/admin/prices", json=price, headers=admin)).status_code == 201
    base = (await complete(platform, key, BASE, PROMPTS[1])).json()
    tuned = (await complete(platform, key, adapter["model"], PROMPTS[1])).json()
    usage = await platform.http.get("/v1/usage", params={"group_by": ["model"]}, headers=bearer(key))
    cost = {r["model"]: r["cost_micros"] for bucket in usage.json()["data"] for r in bucket["results"]}
    assert cost == {BASE: base["usage"]["total_tokens"], adapter["model"]: 10 * tuned["usage"]["total_tokens"]}


async def test_a_worker_behind_redis_serves_tenant_adapters(
    database_url: str, llm_engine: AsyncLLMEngine, redis_key_prefix: str, tmp_path: Path, adapters
) -> None:
    """The distributed mode: the API replica (no model) checks the upload against the architecture the worker
    published over Redis, and the worker loads the adapter from the shared store, verifying its digest."""
    quotas = RedisQuotaStore.from_url(REDIS_URL, redis_key_prefix)
    settings = Settings.from_env(
        {}, database_url=database_url, auto_migrate=False, admin_key=generate_key().key, redis_url=REDIS_URL,
        redis_key_prefix=redis_key_prefix, engine_mode="redis", worker_heartbeat_s=0.2, export_dir=str(tmp_path),
        engine={"served_model_name": BASE},  # the name the worker announces the model under
    )
    app = create_app(settings, quotas=quotas)
    async with app.lifespan():
        host = EngineHost(
            llm_engine, RequestStore(app.state.services.database), quotas, adapters=AdapterStore(settings.adapters_path)
        )
        client = redis.Redis.from_url(REDIS_URL)
        worker = RedisWorker(host, client, RedisKeys(redis_key_prefix), worker_id="w-lora", heartbeat_s=0.2)
        running = asyncio.get_running_loop().create_task(worker.run())
        try:
            async for platform in with_admin(app):
                for _ in range(100):
                    if (await platform.http.get("/ready")).status_code == 200:
                        break
                    await asyncio.sleep(0.1)
                _, key = await platform.tenant_with_key()
                adapter = await uploaded(platform, key, "support-bot", adapters)
                for i, prompt in enumerate(PROMPTS):
                    response = await complete(platform, key, adapter["model"], prompt)
                    assert response.status_code == 200, response.text
                    assert response.json()["choices"][0]["text"] == text_of(adapters["support-bot"][2][i], platform)
        finally:
            worker.stop()
            await _within(running, STOP_TIMEOUT_S)
            await client.aclose()
            await quotas.close()
