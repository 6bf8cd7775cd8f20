"""Every attention backend equals the portable SDPA one: on a paged decode batch directly, and on
whole generations through the engine."""

import pytest
import torch

from common.attention import SDPAAttention, _decode_difference
from common.engine import Engine
from common.sampling import SamplingParams
from tests.test_engine import mixed_params, prompts

pytestmark = pytest.mark.slow  # the first FlexAttention call compiles (tens of seconds on CPU)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2), (4, 1)])
def test_flex_decode_equals_sdpa(heads, kv_heads):
    from common.attention.flex import FlexAttention

    err = _decode_difference(FlexAttention(heads, kv_heads, 16), SDPAAttention(heads, kv_heads, 16),
                             torch.device("cpu"))
    assert err < 1e-5


@pytest.mark.parametrize("model", ["dummy:nanogpt", "dummy:llama-tiny"])
def test_flex_engine_generates_sdpa_tokens(model):
    ps, params = prompts(8, 1, 60, seed=11), mixed_params(8, max_tokens=10)
    sdpa = Engine(model=model, attention_backend="sdpa").generate(ps, params)
    flex = Engine(model=model, attention_backend="flex").generate(ps, params)
    assert [o.token_ids for o in flex] == [o.token_ids for o in sdpa]


def test_auto_is_sdpa_on_cpu():
    engine = Engine(model="dummy:nanogpt", attention_backend="auto")
    assert engine.model.layers[0].attention.name == "sdpa"
    out = engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert len(out[0].token_ids) == 2
