"""`pdserve bench structured`: what holding outputs to a grammar costs the engine, side by side in
one run. The same chat prompts are decoded free and under each kind of structured output, in
alternating rounds, and the median step in which every request decoded is compared with the free
one's (a grammar ends some outputs early: time per token would count a shrinking batch).

The cost is the host's: a mask per request and step (llguidance), its upload, an eager sampler
over it, and under async scheduling a sampling that waits for the step before's tokens.
The masks' own time is measured apart, the outputs replayed through fresh matchers, as the share
of a free step it adds."""

from __future__ import annotations

import statistics
import sys
import time

import torch

from bench.engine import step_times
from bench.report import print_json, print_table
from common.engine import Engine
from common.errors import InvalidArgument
from common.sampling_params import SamplingParams
from common.structured_output import fill_masks

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "colour", "sizes"],
          "properties": {"name": {"type": "string"}, "colour": {"enum": ["red", "green", "blue"]},
                         "sizes": {"type": "array", "items": {"type": "integer"}}}}
KINDS = {"free": None, "regex": {"regex": "[a-z]+( [a-z]+)*"}, "json": {"json": SCHEMA},
         "json_object": {"json_object": True}}


def _prompts(engine: Engine, n: int) -> list[list[int]]:
    tok = engine.tokenizer
    if tok is None:
        raise InvalidArgument(f"--model {engine.config.model}: structured outputs need a model with a tokenizer")
    texts = [f"Describe product number {i} in JSON, with its name, colour and sizes." for i in range(n)]
    return [tok.encode_turn(t) for t in texts]


def _mask_times(engine: Engine, spec: dict, outputs: list[list[int]]) -> list[float]:
    """The host's time to compute every request's mask, at each position all of them reached:
    the outputs replayed through fresh matchers."""
    matchers = [engine.grammars.matcher(spec) for _ in outputs]
    masks = torch.empty(len(outputs), -(-engine.model_config.vocab_size // 32), dtype=torch.int32)
    times = []
    for pos in range(min(map(len, outputs))):
        t0 = time.perf_counter()
        fill_masks(matchers, masks)
        times.append(time.perf_counter() - t0)
        for m, out in zip(matchers, outputs):
            m.consume_token(out[pos])
    return times


def run_structured_bench(engine_kwargs: dict, batch: int, max_tokens: int, rounds: int, seed: int) -> dict:
    engine = Engine(**{**engine_kwargs, "max_num_seqs": max(batch, engine_kwargs.get("max_num_seqs", 1))})
    prompts = _prompts(engine, batch)
    params = {kind: SamplingParams(temperature=0.8, seed=seed, max_tokens=max_tokens, ignore_eos=True,
                                   structured_outputs=spec) for kind, spec in KINDS.items()}
    for p in params.values():  # warm-up: the grammar vocabulary is built once, on first use
        engine.generate(prompts[:1], p)
    steps, masks, tokens = {kind: [] for kind in KINDS}, {kind: [] for kind in KINDS}, {}
    for r in range(rounds):
        for kind, p in params.items():
            # the steps in which every request decoded
            full, outputs = step_times(engine, prompts, p,
                                       lambda batch: len(batch) == len(prompts) and all(s.is_decode for s in batch))
            steps[kind] += full
            tokens[kind] = sum(map(len, outputs))
            if KINDS[kind] is not None:
                masks[kind] += _mask_times(engine, KINDS[kind], outputs)
        print(f"round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
    ms = {k: 1e3 * statistics.median(v) if v else None for k, v in steps.items()}
    mask_ms = {k: 1e3 * statistics.median(v) if v else None for k, v in masks.items()}
    free = ms["free"]

    def ratio(x):
        return None if x is None or not free else x / free

    def r(x, n=2):
        return None if x is None else round(x, n)

    rows = [[k, tokens[k], len(steps[k]), r(ms[k]), r(ratio(ms[k])), r(mask_ms[k], 3),
             r(mask_ms[k] and 100 * ratio(mask_ms[k]))] for k in KINDS]
    cfg = engine.config
    print_table(f"structured outputs: decode steps of all {batch} requests, {cfg.model} on {cfg.device} "
                f"(medians over {rounds} alternating rounds; masks: the outputs replayed, all requests' per step)",
                ["kind", "tokens", "full steps", "ms/step", "vs free", "mask ms/step", "mask % of free step"], rows)
    result = {"bench": "structured", "model": cfg.model, "device": cfg.device, "batch": batch,
              "max_tokens": max_tokens, "rounds": rounds,
              "kinds": {k: {"tokens": tokens[k], "full_steps": len(steps[k]), "ms_per_step": ms[k],
                            "vs_free": ratio(ms[k]), "mask_ms_per_step": mask_ms[k],
                            "mask_vs_free_step": ratio(mask_ms[k])} for k in KINDS}}
    print_json(result)
    return result
