"""The sampler: keyed noise is uniform and reproducible, filters do what they say, and sampling
follows the softmax distribution."""

import math

import pytest
import torch

from common.sampling import keyed_uniform, sample
from common.sampling_params import SamplingParams


def test_keyed_uniform_is_deterministic_and_uniform():
    seeds = torch.tensor([1, 2, 3, 2**62], dtype=torch.int64)
    pos = torch.tensor([0, 5, 5, 99], dtype=torch.int64)
    u = keyed_uniform(seeds, pos, 50_000)
    assert torch.equal(u, keyed_uniform(seeds, pos, 50_000))
    assert 0 < u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.005
    assert abs(u.var().item() - 1 / 12) < 0.002
    # Rows differ: seed and position both enter the key.
    assert not torch.equal(u[1], u[2])
    assert not torch.equal(keyed_uniform(seeds[:1], pos[:1] + 1, 10), u[:1, :10])


def test_the_largest_noise_is_below_one_so_a_ruled_out_token_is_never_sampled():
    # (seed 9, position 45) draws the largest noise for token 44719 of 49,152: it once rounded to
    # 1.0, its Gumbel noise to +inf, and a token top-k, top-p or a grammar had ruled out won.
    seeds, pos, V = torch.tensor([9]), torch.tensor([45]), 49_152
    u = keyed_uniform(seeds, pos, V)
    assert u.max() < 1 and u.argmax().item() == 44719
    logits = torch.full((1, V), -math.inf)
    logits[0, 1799] = 0.0
    logits[0, 44719] = -30.0
    for params in (SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=0.01)):
        assert sample(logits.clone(), [params], [9], [45]).item() == 1799
    logits[0, 44719] = -math.inf  # as a grammar's mask leaves it
    assert sample(logits, [SamplingParams(temperature=1.0)], [9], [45]).item() == 1799


def test_noise_of_a_row_does_not_depend_on_its_batch():
    u_all = keyed_uniform(torch.tensor([7, 8, 9]), torch.tensor([3, 4, 5]), 100)
    u_one = keyed_uniform(torch.tensor([8]), torch.tensor([4]), 100)
    assert torch.equal(u_all[1:2], u_one)


def test_sampling_follows_softmax():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 20_000
    logits = probs.log().expand(n, 4).clone()
    params = [SamplingParams(temperature=1.0)] * n
    draws = sample(logits, params, [42] * n, list(range(n)))
    freq = torch.bincount(draws, minlength=4).float() / n
    assert torch.allclose(freq, probs, atol=0.015), freq


def test_filters():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]] * 400)
    n = logits.shape[0]
    seeds, pos = list(range(n)), [0] * n
    top_k = sample(logits, [SamplingParams(temperature=2.0, top_k=2)] * n, seeds, pos)
    assert set(top_k.tolist()) == {0, 1}
    p0 = math.exp(3) / sum(math.exp(x) for x in (3, 2, 1, 0, -1))  # mass of token 0, about 0.64
    top_p = sample(logits, [SamplingParams(temperature=1.0, top_p=p0 + 0.01)] * n, seeds, pos)
    assert set(top_p.tolist()) == {0, 1}
    tiny_p = sample(logits, [SamplingParams(temperature=1.0, top_p=0.01)] * n, seeds, pos)
    assert set(tiny_p.tolist()) == {0}
    mixed = sample(logits[:2], [SamplingParams(temperature=0), SamplingParams(temperature=5.0)], [1, 1], [0, 0])
    assert mixed[0].item() == 0


@pytest.mark.parametrize("top_k", [1])
def test_top_k_one_is_greedy(top_k):
    logits = torch.randn(64, 300, generator=torch.Generator().manual_seed(0))
    got = sample(logits, [SamplingParams(temperature=1.5, top_k=top_k)] * 64, list(range(64)), [3] * 64)
    assert torch.equal(got, logits.argmax(-1))


@pytest.mark.parametrize("temperature", [1e-6, 1e-38, 1e-300])
def test_a_temperature_too_small_to_divide_by_is_greedy(temperature):
    """float32 logits over 1e-38 are infinities (over 1e-300, which float32 rounds to 0, infinities
    and NaNs), whose argmax is not the likeliest token: under vLLM's 1e-5 a temperature is greedy."""
    logits = 10 * torch.randn(64, 300, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=temperature, top_p=0.9)
    assert params.greedy
    got = sample(logits, [params] * 64, list(range(64)), [3] * 64)
    assert torch.equal(got, logits.argmax(-1))
    assert not SamplingParams(temperature=1e-5).greedy


def test_tied_alternatives_are_the_lowest_ids_whatever_the_batch_asks_for():
    """A structured output's mask sets most logits to -inf: its row's top alternatives are ties,
    which topk listed by the batch's largest count (found by a helper: another request's
    logprobs=5 changed this one's three)."""
    from common.sampling import logprob_entries, logprobs_on_device

    logits = torch.full((1, 300), -math.inf)
    logits[0, 101] = 1.0
    for k in (3, 5, 20, 300):
        entry = logprob_entries(logprobs_on_device(logits, torch.tensor([101]), k), [3])[0]
        assert entry == [0.0, [101, 0, 1], [0.0, -math.inf, -math.inf]], k


def test_token_logprobs_are_log_softmax_and_its_top_n():
    from common.sampling import logprob_entries, logprobs_on_device

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    ref = torch.log_softmax(logits, dim=-1)
    out = logprob_entries(logprobs_on_device(logits, torch.tensor([4, 7, 9]), 20), [0, 3, 20])
    for row, (lp, ids, lps), token, n in zip(ref, out, [4, 7, 9], [0, 3, 20]):
        assert lp == pytest.approx(row[token].item(), abs=1e-6)
        assert ids == row.topk(n).indices.tolist() and lps == pytest.approx(row.topk(n).values.tolist(), abs=1e-6)
    with pytest.raises(Exception, match="logprobs=21"):
        SamplingParams(logprobs=21)


def test_a_row_asking_for_no_filter_leaves_the_filter_untouched():
    """In a batch where another row asks for top-k or top-p, a row asking for neither goes through
    the same sort; it must come out bit for bit, even where the cumulative probability rounds to 1
    before the row's end (here after two tokens of 0.5: the third's mass before it is 1.0)."""
    from common.sampling import top_k_top_p

    scaled = torch.tensor([[0.0, 0.0, -30.0, -31.0], [1.0, 2.0, 3.0, 4.0]])
    out = top_k_top_p(scaled, torch.tensor([4, 2]), torch.tensor([1.0, 1.0]))
    assert torch.equal(out[0], scaled[0])
    assert out[1].tolist() == [-math.inf, -math.inf, 3.0, 4.0]  # top-2 still cuts
    nucleus = top_k_top_p(scaled, torch.tensor([4, 4]), torch.tensor([1.0, 0.5]))
    assert torch.equal(nucleus[0], scaled[0]) and nucleus[1].isinf().tolist() == [True, True, True, False]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_ties_at_the_top_k_boundary_keep_the_lowest_ids_in_any_batch(device):
    """bfloat16 logits tie often. A row whose k-th and (k+1)-th logits tie keeps the lower ids,
    alone and among other rows. Unstable sorts kept 20,000 here on a CPU, and on CUDA order ties
    by the batch's shape."""
    from common.sampling import top_k_top_p

    V, k = 50_000, 3
    row = torch.full((V,), -5.0)
    tied = [7, 901, 20_000, 44_444]  # four ties for the last two places
    row[123] = 9.0
    row[tied] = 4.0
    for batch in (1, 3, 64):
        rows = torch.randn(batch, V, generator=torch.Generator().manual_seed(batch))
        rows[batch // 2] = row
        out = top_k_top_p(rows.to(device), torch.full((batch,), k, device=device),
                          torch.ones(batch, device=device))[batch // 2].cpu()
        assert out.isfinite().nonzero().flatten().tolist() == [7, 123, 901], batch
