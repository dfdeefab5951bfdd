"""The engine's matmul plan: forced names are checked, ``auto`` times this machine once per CPU kind and
model shape and reuses the timing, a cached plan reaches every projection, and a broken cache entry only costs a
new timing."""

from __future__ import annotations

import json

import pytest
import torch

from pagewise import EngineConfig
from pagewise.engine.errors import InvalidConfigError
from pagewise.engine.gemm_selection import FEW_ROWS_TIMED, select_gemm_path, weight_shapes
from pagewise.engine.llm_engine import LLMEngine
from pagewise.engine.model_config import ModelArchConfig
from pagewise.engine.models.llama import Linear
from pagewise.kernels.gemm import GemmPath, GemmPlan, WeightShape, few_rows_product_available, supported_paths

CPU = torch.device("cpu")
FEW_ROWS_AVAILABLE = few_rows_product_available(torch.float32)


def arch(**overrides) -> ModelArchConfig:
    fields = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        attention_bias=False,
    )
    return ModelArchConfig(**(fields | overrides))


def test_weight_shapes_are_one_forwards_projections() -> None:
    assert weight_shapes(arch()) == [
        WeightShape(64 + 2 * 32, 64, 2),
        WeightShape(64, 64, 2),
        WeightShape(192, 64, 2),
        WeightShape(64, 96, 2),
        WeightShape(256, 64, 1, max_rows=64),
    ]


def test_an_unknown_path_is_a_config_error() -> None:
    with pytest.raises(InvalidConfigError, match="gemm_path must be one of"):
        EngineConfig(gemm_path="mkl-fast", dtype="float32")


@pytest.mark.parametrize("path", supported_paths(CPU, torch.float32))
def test_a_named_path_is_used_as_given(tmp_path, path: GemmPath) -> None:
    selection = select_gemm_path(path.value, arch(), CPU, torch.float32, tmp_path)
    assert (selection.plan, selection.source) == (GemmPlan.single(path), "forced")
    assert not (tmp_path / "gemm").exists()


def test_a_named_path_this_device_cannot_run_is_refused(tmp_path) -> None:
    with pytest.raises(InvalidConfigError, match="does not run on cuda"):
        select_gemm_path("onednn-packed", arch(), torch.device("cuda"), torch.float32, tmp_path)


def test_auto_on_cuda_is_torch_without_timing(tmp_path) -> None:
    selection = select_gemm_path("auto", arch(), torch.device("cuda"), torch.float32, tmp_path)
    assert (selection.plan, selection.source) == (GemmPlan.single(GemmPath.TORCH), "device")


def test_auto_times_once_then_reuses_the_timing(tmp_path) -> None:
    first = select_gemm_path("auto", arch(), CPU, torch.float32, tmp_path)
    assert first.source == "measured"
    assert set(first.gflops) == {p.value for p in supported_paths(CPU, torch.float32)}
    few_rows = first.plan.few_rows
    assert few_rows in (0, *FEW_ROWS_TIMED) and (few_rows == 0 or FEW_ROWS_AVAILABLE)
    entries = list((tmp_path / "gemm").iterdir())
    assert len(entries) == 1 and json.loads(entries[0].read_text())["bands"] == first.plan.as_json()
    again = select_gemm_path("auto", arch(), CPU, torch.float32, tmp_path)
    assert (again.plan, again.source, again.gflops) == (first.plan, "cached", first.gflops)


def test_other_shapes_or_dtype_are_timed_anew(tmp_path) -> None:
    select_gemm_path("auto", arch(), CPU, torch.float32, tmp_path)
    assert select_gemm_path("auto", arch(intermediate_size=128), CPU, torch.float32, tmp_path).source == "measured"
    assert len(list((tmp_path / "gemm").iterdir())) == 2


def test_a_cached_choice_is_what_the_entry_says(tmp_path) -> None:
    """The engine runs the cached plan (here written by hand) without timing again."""
    select_gemm_path("auto", arch(), CPU, torch.float32, tmp_path)
    (entry,) = (tmp_path / "gemm").iterdir()
    bands = [[16, "onednn-packed"], [None, "torch"]]
    entry.write_text(json.dumps({"bands": bands, "candidates_gflops": {"torch": 1.0}, "few_rows": 3}))
    selection = select_gemm_path("auto", arch(), CPU, torch.float32, tmp_path)
    assert (selection.source, selection.gflops) == ("cached", {"torch": 1.0})
    assert selection.plan == GemmPlan(((16, GemmPath.ONEDNN_PACKED), (None, GemmPath.TORCH)), few_rows=3)


@pytest.mark.skipif(not FEW_ROWS_AVAILABLE, reason="needs the compiled kernels and AVX2 with FMA")
def test_the_engine_runs_its_projections_with_the_selected_plan(tmp_path, tiny_model) -> None:
    """A cached plan (written by hand over the engine's own measurement) reaches every projection, and the
    engine reports it."""
    path, _ = tiny_model("llama-tiny")
    config = EngineConfig(model=str(path), dtype="float32", cache_dir=str(tmp_path))
    assert LLMEngine(config).gemm.source == "measured"
    (entry,) = (tmp_path / "gemm").iterdir()
    bands = [[64, "onednn-packed"], [None, "torch"]]
    entry.write_text(json.dumps({"bands": bands, "candidates_gflops": {}, "few_rows": 5}))
    engine = LLMEngine(config)
    stats = engine.stats()
    assert (engine.gemm.source, stats["gemm_few_rows"]) == ("cached", 5)
    assert stats["gemm_path"] == "onednn-packed up to 64 rows, torch above"
    linears = [m for m in engine.model.modules() if isinstance(m, Linear)]
    assert linears and all(m._gemm.plan == engine.gemm.plan for m in linears)


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        '{"chosen": "gpu-magic", "candidates_gflops": {}, "few_rows": 0}',
        '{"chosen": "torch", "candidates_gflops": {}}',  # written before the few-rows limit was measured
        '{"chosen": "torch", "candidates_gflops": {}, "few_rows": 0}',  # before the plan had bands
        '{"bands": [[16, "torch"]], "candidates_gflops": {}, "few_rows": 0}',
        "[]",
    ],
)
def test_a_broken_cache_entry_is_timed_again(tmp_path, content: str) -> None:
    select_gemm_path("auto", arch(), CPU, torch.float32, tmp_path)
    (entry,) = (tmp_path / "gemm").iterdir()
    entry.write_text(content)
    assert select_gemm_path("auto", arch(), CPU, torch.float32, tmp_path).source == "measured"
    assert {path for _, path in json.loads(entry.read_text())["bands"]} <= {p.value for p in GemmPath}
