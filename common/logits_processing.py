"""The logit adjustments a request may ask for (SamplingParams: a structured output's mask,
logit_bias, min_tokens, repetition, frequency and presence penalties, min_p), applied to its row
of logits before the sampler, in vLLM's order.

Each depends on the request's own tokens alone, never on the rest of its batch, so a request
adjusted this way still samples the same tokens alone or batched, on a prefill or decode worker,
after a preemption or a migration: the counts come from the sequence's tokens, split into prompt
and output where its prompt ends, wherever it runs.

Under async scheduling the newest token of a decode may still be sampled on the device when the
next step is prepared (PENDING on the host). That token is the decode's input, so its count is
taken from the step's input ids on the device, and the host counts the tokens before it.

The host's work per step is a memcpy of each adjusted sequence's tokens (Sequence.settled_tokens)
into one buffer and one copy to the device, which spreads them into rows; a Python loop over
tokens would cost tens of milliseconds a step at batch 64 with long prompts.
"""

from __future__ import annotations

import array
import math

import torch

from common.config import upload
from common.sequence import Sequence
from common.structured_output import fill_masks


def adjusted_rows(seqs: list[Sequence]) -> list[int]:
    """The rows whose requests adjust their logits this step (min_tokens only until it is met).
    Every step asks, so a batch with none costs a flag read per sequence."""
    return [i for i, q in enumerate(seqs) if q.adjusts_logits and q.adjusted_now]


def adjust(logits_SV: torch.Tensor, seqs: list[Sequence], rows: list[int], num_decode: int,
           input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float32 copy of logits_SV (one row per sampling sequence, seqs[i] on row i), its `rows`
    adjusted, and the logits to take logprobs from: the raw ones, but for the tokens a structured
    output's grammar rules out, at -inf (as vLLM's, whose mask comes before its sampler). Rows below
    num_decode are decodes whose newest token is input_ids[row]."""
    V = logits_SV.shape[1]
    R = len(rows)
    out_n, prompt_n, last_src = array.array("q"), array.array("q"), array.array("q")
    bias_r, bias_t, bias_v, stop_r, stop_t = array.array("q"), array.array("q"), [], array.array("q"), array.array("q")
    grammar_r, matchers = array.array("q"), []  # rows held to a structured output, and their matchers
    # rows whose structured output begins if their pending token ends its run (Sequence.held_matcher):
    # its first mask, where input_ids[src] (that token, on the device) is the run's last
    begin_r, begin_src, begin_t, begin_masks = array.array("q"), array.array("q"), array.array("q"), []
    masked_logprobs = False  # one of those rows asks for logprobs
    tokens = array.array("q")  # each row's output tokens, then each row's prompt tokens
    prompts = []
    rep, freq, pres, temp, log_min_p = [], [], [], [], []  # per row
    for j, i in enumerate(rows):
        q, p = seqs[i], seqs[i].params
        settled = q.settled_tokens()
        outputs = settled[q.num_prompt_tokens:]
        if i < num_decode:  # its newest token: from the device, where it may still be pending on the host
            last_src.append(i)
        elif len(q) > q.num_prompt_tokens:  # a re-prefill's last output token: known on the host
            outputs.append(q.token_ids[-1])
        tokens += outputs
        out_n.append(len(outputs))
        prompt_n.append(q.num_prompt_tokens if p.repetition_penalty != 1.0 else 0)
        if p.repetition_penalty != 1.0:
            prompts.append(settled[:q.num_prompt_tokens] if len(settled) >= q.num_prompt_tokens else
                           array.array("q", q.prompt_token_ids))
        bias_t.extend(p.logit_bias)
        bias_r.extend([j] * len(p.logit_bias))
        bias_v.extend(p.logit_bias.values())
        if q.matcher is not None:  # its grammar, not min_tokens, says where it may end
            grammar_r.append(j)
            matchers.append(q.matcher)
            masked_logprobs = masked_logprobs or p.logprobs is not None
        elif len(q) - q.num_prompt_tokens < p.min_tokens:  # the token sampled now is output number len - prompt
            stops = [t for t in q.stop_ids if t < V]
            stop_t.extend(stops)
            stop_r.extend([j] * len(stops))
        if q.held_matcher is not None and i < num_decode and q.pending and _run_ends_pending(q, settled):
            begin_r.append(j)
            begin_src.append(i)
            begin_t.append(p.structured_outputs_after[-1])
            begin_masks.append(_first_mask(q, -(-V // 32), logits_SV.device))
            masked_logprobs = masked_logprobs or p.logprobs is not None
        rep.append(p.repetition_penalty)
        freq.append(p.frequency_penalty)
        pres.append(p.presence_penalty)
        temp.append(p.temperature or 1.0)
        log_min_p.append(math.log(p.min_p) if p.min_p > 0 and not p.greedy else -math.inf)
    for prompt in prompts:
        tokens += prompt
    parts = (array.array("q", rows), out_n, prompt_n, last_src, bias_r, bias_t, stop_r, stop_t, grammar_r, begin_r,
             begin_src, begin_t, tokens)
    buf = array.array("q")
    for part in parts:
        buf += part
    dev = logits_SV.device
    ints = upload(torch.frombuffer(buf, dtype=torch.int64).clone(), dev)
    (rows_R, out_n_R, prompt_n_R, last_src, bias_r, bias_t, stop_r, stop_t, grammar_r, begin_r, begin_src, begin_t,
     tokens) = ints.split(list(map(len, parts)))
    floats = upload(torch.tensor(rep + freq + pres + temp + log_min_p + bias_v, dtype=torch.float32), dev)
    rep_R, freq_R, pres_R, temp_R, log_min_p_R = floats[:5 * R].view(5, R).unbind(0)
    x_RV = logits_SV[rows_R].float()  # a copy: the graph's logits stay the raw ones, for logprobs
    for_logprobs_SV = logits_SV
    if matchers:
        masks_CW = torch.empty(len(matchers), -(-V // 32), dtype=torch.int32)
        fill_masks(matchers, masks_CW)
        x_RV[grammar_r] = _allowed_only(x_RV[grammar_r], upload(masks_CW, dev))
    ends_R = None  # rows whose grammar begins now, on the device (begin_r's, where their pending token ends the run)
    if begin_masks:  # no host sync: where the pending token is not the run's end, the logits stay as they are
        x_BV = x_RV[begin_r]
        ends_B = input_ids[begin_src] == begin_t
        x_RV[begin_r] = torch.where(ends_B[:, None], _allowed_only(x_BV, torch.stack(begin_masks)), x_BV)
        ends_R = torch.zeros(R, dtype=torch.bool, device=dev)
        ends_R[begin_r] = ends_B
    if masked_logprobs:  # a copy only where one is asked for
        for_logprobs_SV = logits_SV.float().clone()
        masked_r = torch.cat([grammar_r, begin_r])
        for_logprobs_SV[rows_R[masked_r]] = x_RV[masked_r]
    if bias_v:
        x_RV.index_put_((bias_r, bias_t), floats[5 * R:], accumulate=True)
    if len(stop_t):  # (where a grammar begins, it says where the output may end, as for a matcher's rows)
        barred = -math.inf if ends_R is None else torch.where(ends_R[stop_r], x_RV[stop_r, stop_t], -math.inf)
        x_RV[stop_r, stop_t] = barred
    if any(r != 1.0 for r in rep) or any(freq) or any(pres):
        arange_R = torch.arange(R, device=dev)
        n_out = len(tokens) - sum(map(len, prompts))
        out_t = torch.cat([tokens[:n_out], input_ids[last_src]])
        out_r = torch.cat([arange_R.repeat_interleave(out_n_R, output_size=n_out),
                           arange_R[:len(last_src)]])  # decode rows come first in `rows`
        prompt_r = arange_R.repeat_interleave(prompt_n_R, output_size=len(tokens) - n_out)
        x_RV = _penalize(x_RV, rep_R, freq_R, pres_R, out_r, out_t, prompt_r, tokens[n_out:])
    if any(m > -math.inf for m in log_min_p):
        # min_p, after temperature: p_i < min_p * p_max  <=>  x_i < x_max + T log(min_p)
        threshold_R = x_RV.max(dim=-1).values + temp_R * log_min_p_R
        x_RV = x_RV.masked_fill(x_RV < threshold_R[:, None], -math.inf)
    out_SV = logits_SV.float()
    if out_SV is logits_SV:
        out_SV = out_SV.clone()
    out_SV[rows_R] = x_RV
    return out_SV, for_logprobs_SV


def _run_ends_pending(q: Sequence, settled) -> bool:
    """Whether q's structured_outputs_after run ends with its pending token, if that token is the
    run's last: the tokens before it (settled, the newest excluded) end as the run's others."""
    head = q.params.structured_outputs_after[:-1]
    return not head or list(settled[len(settled) - len(head):]) == head


def _first_mask(q: Sequence, words: int, device: torch.device) -> torch.Tensor:
    """q.held_matcher's mask before any token (`words` words, as fill_masks makes them), made and
    uploaded once: each step of its thinking asks whether its pending token ends the run."""
    if q.first_mask is None:
        mask = torch.empty(1, words, dtype=torch.int32)
        fill_masks([q.held_matcher], mask)
        q.first_mask = upload(mask, device)[0]
    return q.first_mask


def _allowed_only(x_CV: torch.Tensor, masks_CW: torch.Tensor) -> torch.Tensor:
    """x_CV with the tokens its row's bitmask leaves out at -inf (token t: bit t % 32 of word t // 32)."""
    C, V = x_CV.shape
    bits_CW32 = (masks_CW[:, :, None] >> torch.arange(32, device=x_CV.device, dtype=torch.int32)) & 1
    return x_CV.masked_fill(bits_CW32.view(C, -1)[:, :V] == 0, -math.inf)


def _penalize(x_RV: torch.Tensor, rep_R: torch.Tensor, freq_R: torch.Tensor, pres_R: torch.Tensor,
              out_r: torch.Tensor, out_t: torch.Tensor, prompt_r: torch.Tensor, prompt_t: torch.Tensor) -> torch.Tensor:
    """Repetition penalty over the prompt's and output's tokens, then frequency and presence
    penalties over the output's (counted from its (row, token) pairs)."""
    R, V = x_RV.shape
    counts_RV = torch.zeros(R, V, dtype=torch.float32, device=x_RV.device)
    counts_RV.index_put_((out_r, out_t), torch.ones_like(out_t, dtype=torch.float32), accumulate=True)
    seen_RV = counts_RV > 0
    repeated_RV = seen_RV.clone()
    repeated_RV[prompt_r, prompt_t] = True
    rep_R1 = rep_R[:, None]
    x_RV = torch.where(repeated_RV, torch.where(x_RV > 0, x_RV / rep_R1, x_RV * rep_R1), x_RV)
    return x_RV - freq_R[:, None] * counts_RV - pres_R[:, None] * seen_RV
