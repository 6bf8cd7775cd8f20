"""GPU checks, skipped without CUDA: the same engine on a GPU gives the CPU's tokens, and the
backend `auto` picks there equals SDPA."""

import pytest
import torch

from common.engine import Engine
from tests.test_engine import mixed_params, prompts

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("model", ["dummy:nanogpt", "dummy:llama-tiny"])
def test_cuda_float32_matches_cpu(model):
    ps, params = prompts(8, 1, 60, seed=12), mixed_params(8)
    cpu = Engine(model=model, device="cpu").generate(ps, params)
    gpu = Engine(model=model, device="cuda:0", dtype="float32", attention_backend="sdpa").generate(ps, params)
    assert [o.token_ids for o in gpu] == [o.token_ids for o in cpu]


@pytest.mark.parametrize("model", ["dummy:nanogpt", "dummy:llama-tiny"])
def test_cuda_auto_backend_equals_sdpa(model):
    ps, params = prompts(8, 1, 60, seed=13), mixed_params(8)
    auto = Engine(model=model, device="cuda:0", dtype="float32", attention_backend="auto")
    assert auto.model.layers[0].attention.name == "flex"
    sdpa = Engine(model=model, device="cuda:0", dtype="float32", attention_backend="sdpa")
    assert [o.token_ids for o in auto.generate(ps, params)] == [o.token_ids for o in sdpa.generate(ps, params)]


def test_bfloat16_default_on_gpu_runs_llama_1b_shapes():
    engine = Engine(model="dummy:llama-1b", device="cuda:0", max_num_seqs=4, max_model_len=512)
    assert engine.kv_cache.dtype == torch.bfloat16
    out = engine.generate([[1, 2, 3]] * 2, mixed_params(2, max_tokens=8))
    assert all(len(o.token_ids) == 8 for o in out)
