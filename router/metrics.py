"""The router's Prometheus metrics, served at GET /metrics by the HTTP front (router/http.py), in
the router process or, asked for them, by its API server processes (router/api_server.py).

Names follow vLLM's (`vllm:time_to_first_token_seconds` is `pdserve:time_to_first_token_seconds`,
with the same `model_name` label), so a vLLM dashboard's panels of request latency, tokens,
queues, KV use, preemptions and speculative decoding adapt by a change of prefix, and
`--metrics-prefix vllm` makes that change here: an autoscaler or gateway that reads
`vllm:num_requests_waiting` or `vllm:kv_cache_usage_perc` reads ours as they are (KV use is one
series a worker, labelled worker_id and role). vLLM's own internals (iteration tokens, cache
config) have none here. Metrics vLLM has no counterpart for (KV
handoff, migrations, per-worker state) use the same style. The router process's own (process_*,
python_gc_*) are there too, as prometheus_client's default registry has them.

Request metrics are observed by the router as requests move (it sees every token). Gauges are
read at scrape time from the router's state: nothing to keep in step. Per-worker figures come
with heartbeats; a worker's counters (prefix cache, KV bytes) count from its incarnation's start
(a new one each time it registers), so the router adds the increase since the previous heartbeat to
counters of its own, which never go down when a worker restarts.

Each Router has a registry of its own (tests run several routers in one process).
"""

from __future__ import annotations

import time

import prometheus_client
from prometheus_client import (GC_COLLECTOR, CollectorRegistry, Counter, GCCollector, Histogram, PlatformCollector,
                               ProcessCollector, generate_latest)
from prometheus_client.core import GaugeMetricFamily

from common import protocol as P
from router.openai_api import served_names

prometheus_client.disable_created_metrics()  # no *_created series: noise for dashboards (vLLM does the same)

# vLLM's buckets, with finer ones below its smallest (a small model on loopback is that fast)
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
               1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


FINISH_REASONS = ("stop", "length", "abort")  # request_success_total's, as vLLM's


def token_buckets(context: int) -> tuple[int, ...]:
    """vLLM's buckets for token counts: 1, 2, 5, 10, 20, 50, ... up to the served context."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > context:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class RouterMetrics:
    def __init__(self, router):
        self.router = router
        self.registry = CollectorRegistry()
        model = served_names(router.cfg.served_model_names, router.cfg.model)[0]  # as the HTTP API names it
        reg = dict(registry=self.registry)
        prefix = router.cfg.metrics_prefix

        def histogram(name, doc, buckets):
            return Histogram(f"{prefix}:{name}", doc, ["model_name"], buckets=buckets, **reg).labels(model)

        def counter(name, doc):
            return Counter(f"{prefix}:{name}", doc, ["model_name"], **reg).labels(model)

        self.ttft = histogram("time_to_first_token_seconds", "Arrival at the router to the first token", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Between deliveries of a request's tokens", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival at the router to the last token", E2E_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Waiting for a worker and in its queue", TTFT_BUCKETS)
        self.handoff = histogram("kv_handoff_seconds", "First token sampled by the prefill to decoding started",
                                 TTFT_BUCKETS)
        # vLLM's per-request histograms, as the router sees each request
        tokens = token_buckets(router.prompts.context)
        self.request_prompt = histogram("request_prompt_tokens", "Prompt tokens of each finished request", tokens)
        self.request_generation = histogram("request_generation_tokens", "Tokens generated for each finished request",
                                            tokens)
        self.tpot = histogram("request_time_per_output_token_seconds",
                              "Each request's mean time per output token after the first", ITL_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds", "Out of every queue to the first token",
                                      E2E_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "First token to the last", E2E_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds", "Out of every queue to the last token",
                                        E2E_BUCKETS)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled (counted at the first token)")
        self.generation_tokens = counter("generation_tokens", "Tokens delivered to clients")
        self.migrations = counter("request_migrations", "Decoding requests moved to other workers")
        self.redispatches = counter("request_redispatches", "Attempts given up and dispatched again")
        self.local_prefills = counter("local_prefills", "Prompts prefilled by their decode worker (no KV handoff)")
        self.worker_deaths = counter("worker_deaths", "Workers declared dead or replaced by a new incarnation")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in workers' prefix caches")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in workers' prefix caches")
        self.prefix_mispredicted = counter("prefix_cache_mispredicted_tokens",
                                           "prefix_affine: prompt tokens the router took for cached where it sent "
                                           "them and the worker did not find, or the other way round")
        self.preemptions = counter("num_preemptions", "Requests preempted by workers' schedulers (their blocks freed "
                                                      "for other decodes; recomputed once there is room)")
        self.kv_event_resyncs = counter("kv_event_resyncs", "Workers asked for their whole prefix cache, a KV event "
                                                            "having gone missing")
        # vLLM's spec_decode counters, summed over the workers that speculate
        self.spec_decode = [counter("spec_decode_num_drafts", "Speculative decodes that had a draft"),
                            counter("spec_decode_num_draft_tokens", "Draft tokens fed to speculative decodes"),
                            counter("spec_decode_num_accepted_tokens", "Draft tokens kept (the model sampled them)")]
        self._success = Counter(f"{prefix}:request_success", "Finished requests by finish reason",
                                ["model_name", "finished_reason"], **reg)
        self._errors = Counter(f"{prefix}:request_errors", "Requests ended by an error, by code",
                               ["model_name", "code"], **reg)
        self._kv_bytes = Counter(f"{prefix}:kv_transfer_bytes", "KV bytes sent from prefill to decode workers",
                                 ["model_name", "transport"], **reg)
        self._model = model
        for reason in FINISH_REASONS:  # each series there from the start, as vLLM's: rate() and absent() work at once
            self._success.labels(model, reason)
        self.registry.register(_StateCollector(router, model, prefix))
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        if GC_COLLECTOR is not None:  # (None where the interpreter has no gc statistics)
            GCCollector(registry=self.registry)

    # ------------------------------------------------------------------ events

    def on_tokens(self, req, now: float, count: int):
        if req.first_token_at is None:
            self.ttft.observe(now - req.arrival)
            self.prompt_tokens.inc(len(req.prompt_ids))
        else:
            self.itl.observe(now - req.last_token_at)
        self.generation_tokens.inc(count)

    def on_done(self, req, reason: str):
        # vLLM's label values: "abort" where our finish reason says "cancelled"
        self._success.labels(self._model, "abort" if reason == "cancelled" else reason).inc()
        self.e2e.observe(time.monotonic() - req.arrival)
        self.request_prompt.observe(len(req.prompt_ids))
        self.request_generation.observe(len(req.tokens))
        if req.first_token_at is not None:
            decode = req.last_token_at - req.first_token_at
            self.decode_time.observe(decode)
            if len(req.tokens) > 1:
                self.tpot.observe(decode / (len(req.tokens) - 1))
        if req.dispatched_at is not None:
            left_queue = req.dispatched_at + req.worker_timings.get("queue_s", 0.0)
            self.queue.observe(left_queue - req.arrival)
            if req.first_token_at is not None:
                self.prefill_time.observe(max(0.0, req.first_token_at - left_queue))
                self.inference_time.observe(max(0.0, req.last_token_at - left_queue))
        if "handoff_s" in req.worker_timings:
            self.handoff.observe(req.worker_timings["handoff_s"])

    def on_error(self, code: str):
        self._errors.labels(self._model, code).inc()

    def render(self) -> bytes:
        """Every metric in Prometheus' text format (prometheus_client.CONTENT_TYPE_LATEST)."""
        return generate_latest(self.registry)

    def on_retry(self, req):
        self.redispatches.inc()
        if req.tokens:
            self.migrations.inc()

    def on_heartbeat(self, w, msg: P.Heartbeat):
        """Add what the worker's own counters grew by since its last heartbeat."""
        last = w.counters
        self.prefix_queries.inc(max(0, msg.prefix_queries - last.get("prefix_queries", 0)))
        self.prefix_hits.inc(max(0, msg.prefix_hits - last.get("prefix_hits", 0)))
        for transport, sent in msg.kv_bytes.items():
            if isinstance(sent, int):
                grew = sent - last.get(("kv_bytes", transport), 0)
                if grew > 0:
                    self._kv_bytes.labels(self._model, str(transport)).inc(grew)
                last[("kv_bytes", transport)] = sent
        self.preemptions.inc(max(0, msg.preemptions - last.get("preemptions", 0)))
        last["prefix_queries"], last["prefix_hits"], last["preemptions"] = (msg.prefix_queries, msg.prefix_hits,
                                                                            msg.preemptions)
        for i, (metric, value) in enumerate(zip(self.spec_decode, msg.spec_decode)):
            if isinstance(value, int):
                metric.inc(max(0, value - last.get(("spec_decode", i), 0)))
                last[("spec_decode", i)] = value


class _StateCollector:
    """Gauges read from the router when scraped: its queue, and each worker as last heard from."""

    def __init__(self, router, model: str, prefix: str = "pdserve"):
        self.router, self.model, self.prefix = router, model, prefix

    def collect(self):
        """vLLM's meanings: running, in a batch a worker steps (prefill or decode, as its last
        heartbeat said); waiting, admitted and not in one (queued in the router or in a worker, or
        waiting for decode room or for its KV to arrive)."""
        router, model, prefix = self.router, self.model, self.prefix
        running = min(len(router.requests), sum(w.running for w in router.registry.workers.values() if w.alive))
        for name, doc, value in (("num_requests_running", "Requests in a worker's running batch", running),
                                 ("num_requests_waiting", "Requests admitted and not in a running batch",
                                  len(router.requests) - running)):
            g = GaugeMetricFamily(f"{prefix}:{name}", doc, labels=["model_name"])
            g.add_metric([model], value)
            yield g
        per_worker = [
            ("worker_alive", "1 while the worker heartbeats", lambda w: int(w.alive)),
            ("worker_kv_blocks_used", "KV blocks in use", lambda w: w.total_blocks - w.free_blocks),
            ("worker_kv_blocks_total", "KV blocks in the worker's pool", lambda w: w.total_blocks),
            ("kv_cache_usage_perc", "Fraction of the worker's KV blocks in use (vLLM's name)",
             lambda w: (w.total_blocks - w.free_blocks) / w.total_blocks),
            ("worker_num_requests_running", "Requests in the worker's running batch", lambda w: w.running),
            ("worker_num_requests_waiting", "Requests in the worker and not in its running batch: queued for a step, "
             "or prefilled and their KV kept for a decode worker", lambda w: w.queued + w.held),
        ]
        # one that stopped as it was told is no outage: a "worker down" alert must not fire on a scale-down
        workers = sorted((w for w in router.registry.workers.values() if not w.left), key=lambda w: w.worker_id)
        for name, doc, value in per_worker:
            g = GaugeMetricFamily(f"{prefix}:{name}", doc, labels=["model_name", "worker_id", "role"])
            for w in workers:
                g.add_metric([model, w.worker_id, w.role], value(w))
            yield g
