"""`pdserve bench handoff`: how much a long prompt's KV handoff adds to its prefill, with layer-wise
streaming and without.

Two 1P1D clusters run side by side, one streaming (the default) and one with --no-kv-stream, and
requests go to each in turn, one at a time, so that the machine's drift hits both alike. Each is a
fresh prompt of --tokens tokens (no prefix-cache hit) with max_tokens=2. The workers report, per
request, prefill_s (the prefill worker, from receiving the work to sampling the first token) and
handoff_s (from then until the decode worker starts the request: the KV left to move, the header,
the acknowledgement of nothing), and kv_stream_host_s (the host time the prefill worker's layer
hooks spent sending the streamed layers: on a GPU, where the host queues the forward ahead of the
device, how much of the streamed prefill's extra time is the host's). The figure that matters is
prefill start to decode start over the prefill alone: (prefill_s + handoff_s) / prefill_s of the
non-streaming cluster, whose prefill runs with no transfer beside it. Both clusters are given
--devices alike; on a GPU they split it, half each.
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path

from bench.report import cluster_logs, print_json, print_table
from common.model_spec import model_config
from common.cli_options import engine_kwargs_from
from common.config import EngineConfig
from common.errors import InvalidArgument
from router.client import Client
from router.launcher import Cluster

MODES = {"streamed": [], "after prefill": ["--no-kv-stream"]}


def transports_used(client: Client, wait_s: float = 3.0) -> list[str]:
    """The KV transports a cluster's prefill workers sent by, as their heartbeats report them (one
    comes every 0.2 s): what `auto` chose."""
    deadline = time.monotonic() + wait_s
    while True:
        sent = {t for w in client.status().workers for t, n in w.get("kv_sent", {}).items() if n}
        if sent or time.monotonic() > deadline:
            return sorted(sent)
        time.sleep(0.1)


def run_handoff_bench(model: str, tokens: int, requests: int, transport: str, seed: int = 0,
                      worker_args: list[str] = (), devices: list[str] = ("cpu",)) -> dict:
    cfg = model_config(model)
    if not 1 <= tokens < cfg.max_position_embeddings:
        raise InvalidArgument(f"tokens={tokens}; allowed: 1..{cfg.max_position_embeddings - 1} ({model}'s context)")
    if requests < 1:
        raise InvalidArgument(f"requests={requests}; allowed: >= 1")
    # the workers' KV dtype: their --dtype (the last one, as click reads it), else the engine's default
    engine = EngineConfig(**{**engine_kwargs_from(worker_args), "model": model, "device": devices[0]})
    rng = random.Random(seed)
    prompts = [[rng.randrange(cfg.vocab_size) for _ in range(tokens)] for _ in range(2 * requests + 2)]
    samples: dict[str, list[tuple[float, float, float]]] = {mode: [] for mode in MODES}
    with cluster_logs() as logs:
        clusters = {}
        try:
            for mode, extra in MODES.items():
                clusters[mode] = c = Cluster(model, 1, 1, 0, list(devices), "127.0.0.1", 0, 0,
                                             Path(logs) / mode.replace(" ", "-"), "least_loaded",
                                             ["--kv-transport", transport, *worker_args, *extra], threads=None,
                                             restart=False, device_share=1 / len(MODES))  # side by side
                c.start()
            clients = {mode: Client(c.address, timeout=600) for mode, c in clusters.items()}
            for i in range(requests + 1):  # the first is a warm-up
                for mode, client in sorted(clients.items(), reverse=i % 2 == 1):  # who goes first alternates
                    r = client.generate(prompts.pop(), max_tokens=2, temperature=0, ignore_eos=True)
                    if i:
                        samples[mode].append((r.timings["prefill_s"], r.timings["handoff_s"],
                                              r.timings.get("kv_stream_host_s", 0.0)))
            used = {mode: transports_used(client) for mode, client in clients.items()}
            for client in clients.values():
                client.close()
        finally:
            for c in clusters.values():
                c.stop()
    alone = statistics.median(p for p, _, _ in samples["after prefill"])
    rows, result = [], {"bench": "handoff", "model": model, "tokens": tokens, "requests": requests,
                        "transport": transport, "transports_used": used, "devices": list(devices),
                        "dtype": engine.dtype,
                        "kv_bytes": tokens * cfg.kv_values_per_token * engine.torch_dtype.itemsize}
    for mode, triples in samples.items():
        prefill = statistics.median(p for p, _, _ in triples)
        handoff = statistics.median(h for _, h, _ in triples)
        total = statistics.median(p + h for p, h, _ in triples)
        hooks = statistics.median(s for _, _, s in triples)
        key = "stream" if mode == "streamed" else "after"
        result.update({f"{key}_prefill_ms": round(prefill * 1e3, 2), f"{key}_handoff_ms": round(handoff * 1e3, 2),
                       f"{key}_to_decode_ms": round(total * 1e3, 2), f"{key}_vs_prefill_alone": round(total / alone, 3),
                       f"{key}_streaming_host_ms": round(hooks * 1e3, 2)})
        rows.append([mode, prefill * 1e3, f"{hooks * 1e3:.2f}", handoff * 1e3, total * 1e3, f"{total / alone:.3f}x"])
    names = ", ".join(sorted({t for ts in used.values() for t in ts})) or "unreported"
    print_table(f"pdserve bench handoff: {model}, {tokens}-token prompts, {transport} KV transport (used: {names}), "
                f"{result['kv_bytes'] / 2**20:.2f} MiB of {engine.dtype} KV each, p50 of {requests}, "
                "taken in turn (ms)",
                ["KV sent", "prefill", "its streaming's host time", "handoff", "prefill start to decode start",
                 "vs prefill alone"], rows)
    print_json(result)
    return result
