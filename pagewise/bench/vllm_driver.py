"""vLLM's side of ``pagewise bench vllm``: run by path with the python of vLLM's own environment, never imported.

It imports nothing of pagewise (that environment has no pagewise) and only vLLM's offline API. Input: the path
of a JSON file ``{"model_dir", "dtype", "max_model_len", "seed", "prompts": [[ids]], "output_lens": [n],
"sampling": {...}, "warm_up": [[ids]], "warm_up_tokens": n}`` — with, for adapters, ``"lora": {"max_loras",
"max_lora_rank", "max_cpu_loras"}`` and ``"runs": [{"name", "adapters": [directory or null per request] or
null}]``, each run timed on its own — and the path the result is written to, as JSON: ``{"vllm_version",
"seconds", "output_tokens", "prompt_tokens", "output_tokens_per_s", "total_tokens_per_s"}`` of the first run,
and ``"runs": {name: those figures}`` when the spec named runs (a file, not stdout: vLLM logs on both of its
streams).

Every request has ``ignore_eos`` and its own ``max_tokens``, so both engines produce exactly the same number of
tokens; a run that produced another number is an error (exit 1), not a figure. The ``warm_up`` prompts run
first, outside the timing.
"""

from __future__ import annotations

import json
import sys
import time


def main(path: str, result_path: str) -> int:
    with open(path, encoding="utf-8") as file:
        spec = json.load(file)
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    lora = spec.get("lora")  # {"max_loras", "max_lora_rank", "max_cpu_loras"}: serve adapters
    engine_args = {} if lora is None else {"enable_lora": True, **lora}
    llm = LLM(
        model=spec["model_dir"], dtype=spec["dtype"], max_model_len=spec["max_model_len"], seed=spec["seed"],
        **engine_args,
    )
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"]]
    params = [SamplingParams(max_tokens=n, ignore_eos=True, **spec["sampling"]) for n in spec["output_lens"]]
    warm_up = [TokensPrompt(prompt_token_ids=ids) for ids in spec["warm_up"]]
    llm.generate(warm_up, SamplingParams(max_tokens=spec["warm_up_tokens"]), use_tqdm=False)
    # each run: request i under adapter directory `adapters[i]` (None: the base model); one run of the base model
    # without the key
    runs = spec.get("runs", [{"name": "base", "adapters": None}])
    adapter_ids = {d: i + 1 for i, d in enumerate(sorted({d for r in runs for d in r["adapters"] or [] if d}))}
    figures = {}
    for run in runs:
        lora_requests = None
        if run["adapters"] is not None:
            lora_requests = [
                None if d is None else LoRARequest(f"adapter-{adapter_ids[d]}", adapter_ids[d], d)
                for d in run["adapters"]
            ]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora_requests)
        seconds = time.perf_counter() - start
        produced = sum(len(o.outputs[0].token_ids) for o in outputs)
        wanted = sum(spec["output_lens"])
        if produced != wanted:
            print(f"vLLM produced {produced} tokens, expected {wanted}", file=sys.stderr)
            return 1
        prompt_tokens = sum(len(ids) for ids in spec["prompts"])
        figures[run["name"]] = {
            "seconds": seconds,
            "output_tokens": produced,
            "prompt_tokens": prompt_tokens,
            "output_tokens_per_s": produced / seconds,
            "total_tokens_per_s": (produced + prompt_tokens) / seconds,
        }
    result = {"vllm_version": vllm.__version__, **figures[runs[0]["name"]]}
    if "runs" in spec:
        result["runs"] = figures
    with open(result_path, "w", encoding="utf-8") as file:
        json.dump(result, file)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
