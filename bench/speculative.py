"""`pdserve bench speculative`: what n-gram speculative decoding gains, side by side in one run.

Two engines of the same model and options, one speculating, decode the same requests in
alternating rounds: prompts whose answer repeats them (text to copy out or correct), prompts
whose answer does not (stories, explanations), at each batch size. For each it prints the tokens a
second of the steps that only decode (the prefill is the same either way) with and without
speculation, their ratio, the tokens a draft gains, the share of draft tokens kept, and whether
the two engines' tokens were the same (they are, with batch-invariant kernels).
A model without a tokenizer gets token-id prompts that repeat a motif, or none."""

from __future__ import annotations

import statistics
import sys

from bench.engine import step_times
from bench.report import print_json, print_table
from common.engine import Engine
from common.sampling_params import SamplingParams

DEFAULT_CONFIG = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
PASSAGES = [  # what a small chat model copies out, or nearly: edits, quotes
    "Copy the following paragraph word for word.\n\nWater boils at one hundred degrees Celsius at sea level, and "
    "freezes at zero degrees. Ice floats on water because it is less dense, and lakes freeze from the top down, "
    "which lets fish live through the winter.",
    "Fix the spelling in this sentence and write it out in full: The cat sat on the mat and lookd out of the windo "
    "at the birds in the gardn.",
    "Copy the following paragraph word for word.\n\nThe train leaves the station at nine in the morning and "
    "arrives in the city at noon. Passengers may buy tickets on the train, but tickets bought at the station are "
    "cheaper.",
    "Fix the grammar in this sentence and write it out in full: She go to the market every days and buy three "
    "apple and two bread for her familys.",
]
QUESTIONS = ["Write a short story about a dragon.", "Explain how a bicycle works.", "Describe a day at the beach.",
             "Write a poem about the sea.", "Explain why the sky is blue.", "Describe your favourite meal."]


def _prompts(engine: Engine, task: str, n: int) -> list[list[int]]:
    tok = engine.tokenizer
    if tok is None:  # token ids: a motif repeated (copy), or a walk that never repeats (free)
        V = engine.model_config.vocab_size
        if task == "copy":
            return [[(7 * i + j) % (V - 1) + 1 for j in range(5)] * 12 for i in range(n)]
        return [[(97 * i + 13 * j * j) % (V - 1) + 1 for j in range(60)] for i in range(n)]
    texts = PASSAGES if task == "copy" else QUESTIONS
    return [tok.encode_turn(texts[i % len(texts)]) for i in range(n)]


def run_speculative_bench(engine_kwargs: dict, batch_sizes: list[int], max_tokens: int, rounds: int,
                          temperature: float, seed: int) -> dict:
    spec = engine_kwargs.get("speculative_config") or DEFAULT_CONFIG
    size = max(batch_sizes + [engine_kwargs.get("max_num_seqs") or 1])
    base = {**engine_kwargs, "speculative_config": None, "max_num_seqs": size}
    engines = {"off": Engine(**base), "on": Engine(**{**base, "speculative_config": spec})}
    params = SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens)
    for engine in engines.values():  # warm-up: first steps allocate and compile
        engine.generate(_prompts(engine, "copy", 1), SamplingParams(max_tokens=8))
    rows, points = [], []
    for task in ("copy", "free"):
        for batch in batch_sizes:
            prompts = _prompts(engines["off"], task, batch)
            secs = {"off": [], "on": []}
            tokens, steps = {}, {}
            drafter = engines["on"].drafter
            before = drafter.counters()
            for r in range(rounds):
                for mode, engine in engines.items():
                    # the steps that only decode: the prefill's is the same with speculation or without
                    times, tokens[mode] = step_times(engine, prompts, params,
                                                     lambda batch: all(s.is_decode or s.draft for s in batch))
                    secs[mode].append(sum(times))
                    steps[mode] = len(times)
                print(f"{task} batch {batch}: round {r + 1}/{rounds}", file=sys.stderr, flush=True)
            drafts, drafted, accepted = (a - b for a, b in zip(drafter.counters(), before))
            n = sum(map(len, tokens["on"]))
            decoded = sum(len(t) - 1 for t in tokens["on"])  # past each prefill's token
            tps = {m: decoded / statistics.median(s) for m, s in secs.items()}
            point = {"task": task, "batch": batch, "tokens": n, "decode_tok_s_off": tps["off"], "decode_tok_s_on": tps["on"],
                     "speedup": tps["on"] / tps["off"], "decode_steps_off": steps["off"], "decode_steps_on": steps["on"],
                     "tokens_per_draft": 1 + accepted / drafts if drafts else None,
                     "acceptance": accepted / drafted if drafted else None,
                     "same_tokens": tokens["on"] == tokens["off"]}
            points.append(point)
            rows.append([task, batch, n, round(tps["off"], 1), round(tps["on"], 1), round(point["speedup"], 2),
                         f"{steps['off']} -> {steps['on']}",
                         None if drafts == 0 else round(point["tokens_per_draft"], 2),
                         None if drafted == 0 else f"{100 * point['acceptance']:.0f}%", point["same_tokens"]])
    cfg = engines["on"].config
    mode = "batch-invariant" if engines["on"].batch_invariant else "default kernels"
    print_table(f"speculative decoding {cfg.speculative.as_dict()}: {cfg.model} on {cfg.device}, {mode}, "
                f"temperature {temperature}, {max_tokens} tokens (medians over {rounds} alternating rounds)",
                ["task", "batch", "tokens", "decode tok/s off", "on", "on/off", "decode steps", "tokens/draft",
                 "kept", "same tokens"], rows)
    result = {"bench": "speculative", "model": cfg.model, "device": cfg.device, "batch_invariant":
              engines["on"].batch_invariant, "speculative_config": cfg.speculative.as_dict(),
              "max_tokens": max_tokens, "temperature": temperature, "rounds": rounds, "points": points}
    print_json(result)
    return result
