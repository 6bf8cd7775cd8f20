"""The logit adjustments a request may ask for (SamplingParams: logit_bias, min_tokens,
repetition, frequency and presence penalties, min_p), applied to its row of logits before the
sampler, in vLLM's order.

Each depends on the request's own tokens alone, never on the rest of its batch, so a request
adjusted this way still samples the same tokens alone or batched, on a prefill or decode worker,
after a preemption or a migration: the counts come from the sequence's tokens, split into prompt
and output where its prompt ends, wherever it runs.

Under async scheduling the newest token of a decode may still be sampled on the device when the
next step is prepared (PENDING on the host). That token is the decode's input, so its count is
taken from the step's input ids on the device, and the host counts the tokens before it.
"""

from __future__ import annotations

import array
import math

import torch

from common.config import upload
from common.sequence import Sequence


def adjusted_rows(seqs: list[Sequence]) -> list[int]:
    """The rows whose requests adjust their logits."""
    return [i for i, q in enumerate(seqs) if q.params.adjusts_logits]


def adjust(logits_SV: torch.Tensor, seqs: list[Sequence], rows: list[int], num_decode: int,
           input_ids: torch.Tensor) -> torch.Tensor:
    """A float32 copy of logits_SV (one row per sampling sequence, seqs[i] on row i), its `rows`
    adjusted. Rows below num_decode are decodes whose newest token is input_ids[row]."""
    V = logits_SV.shape[1]
    out_SV = logits_SV.to(torch.float32, copy=True)
    R = len(rows)
    # Host side: (row, token) pairs of each kind, then the per-row parameters; one copy each.
    out_r, out_t, prompt_r, prompt_t = array.array("q"), array.array("q"), array.array("q"), array.array("q")
    bias_r, bias_t, bias_v, stop_r, stop_t = array.array("q"), array.array("q"), [], array.array("q"), array.array("q")
    last_r, last_src = array.array("q"), array.array("q")
    floats = []
    for j, i in enumerate(rows):
        q, p = seqs[i], seqs[i].params
        outputs = q.token_ids[q.num_prompt_tokens:]
        if i < num_decode:  # its newest token: from the device, where it may still be pending on the host
            outputs = outputs[:-1]
            last_r.append(j)
            last_src.append(i)
        out_t.extend(outputs)
        out_r.extend([j] * len(outputs))
        if p.repetition_penalty != 1.0:
            prompt_t.extend(q.prompt_token_ids)
            prompt_r.extend([j] * q.num_prompt_tokens)
        bias_t.extend(p.logit_bias)
        bias_r.extend([j] * len(p.logit_bias))
        bias_v.extend(p.logit_bias.values())
        if len(q) - q.num_prompt_tokens < p.min_tokens:  # the token sampled now is output number len - prompt
            stops = [t for t in q.stop_ids if t < V]
            stop_t.extend(stops)
            stop_r.extend([j] * len(stops))
        min_p = p.min_p if not p.greedy else 0.0
        floats += [p.repetition_penalty, p.frequency_penalty, p.presence_penalty, p.temperature or 1.0,
                   math.log(min_p) if min_p > 0 else -math.inf]
    parts = (out_r, out_t, prompt_r, prompt_t, bias_r, bias_t, stop_r, stop_t, last_r, last_src)
    buf = array.array("q", rows)
    for part in parts:
        buf.extend(part)
    dev = logits_SV.device
    ints = upload(torch.frombuffer(buf, dtype=torch.int64).clone(), dev)
    rows_R, *views = ints.split([R] + [len(part) for part in parts])
    out_r, out_t, prompt_r, prompt_t, bias_r, bias_t, stop_r, stop_t, last_r, last_src = views
    fl = upload(torch.tensor(floats + bias_v, dtype=torch.float32), dev)
    rep_R, freq_R, pres_R, temp_R, log_min_p_R = fl[:5 * R].view(R, 5).unbind(1)
    x_RV = out_SV[rows_R]
    if len(bias_v):
        x_RV.index_put_((bias_r, bias_t), fl[5 * R:], accumulate=True)
    if len(stop_t):
        x_RV[stop_r, stop_t] = -math.inf
    if any(floats[k] != 1.0 or floats[k + 1] or floats[k + 2] for k in range(0, 5 * R, 5)):
        x_RV = _penalize(x_RV, rep_R, freq_R, pres_R, torch.cat([out_r, last_r]),
                         torch.cat([out_t, input_ids[last_src]]), prompt_r, prompt_t)
    if any(floats[k] > -math.inf for k in range(4, 5 * R, 5)):
        # min_p, after temperature: p_i < min_p * p_max  <=>  x_i < x_max + T log(min_p)
        threshold_R = x_RV.max(dim=-1).values + temp_R * log_min_p_R
        x_RV = x_RV.masked_fill(x_RV < threshold_R[:, None], -math.inf)
    out_SV[rows_R] = x_RV
    return out_SV


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
