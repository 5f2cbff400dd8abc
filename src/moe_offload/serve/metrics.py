"""`GET /metrics`: the server's figures in the Prometheus text format, from its own registry (one per server,
nothing process-global), every name starting `moe_offload_`.

Serving figures: requests by status, prompt and completion tokens, time to first token and inter-token
latency histograms, sequences running and waiting. Our own: bytes read from the host tier and from the disk
per decoded token and in all, disk reads, device and host cache hits and misses, and the plan's bytes per
tier. The bytes come from the runtime's own counters: `Meter` is a forward hook on the model (it runs after
the runtime's, on the decoding thread) that moves each call's counted bytes into running totals and
empties the counters, so a server that runs for days keeps no per-call lists.
"""

from __future__ import annotations

import threading

from ..run.runtime import runtime_of

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class Meter:
    """Running totals of the runtime's counters: host-link and disk bytes, split by decode and prefill calls."""

    def __init__(self, model):
        self.runtime = runtime_of(model)
        self.lock = threading.Lock()
        self.decode_steps = self.decode_tokens = 0        # decode calls, and the sequences' tokens in them
        self.decode_host = self.decode_disk = 0           # bytes those calls read
        self.host_total = self.disk_total = 0             # bytes every call read (prefill too)
        self.calls = 0
        self.handle = model.register_forward_hook(self._after, with_kwargs=True)

    def _after(self, module, args, kwargs, output) -> None:
        rt = self.runtime
        if not rt.counter.calls:   # the runtime's own hook did not end this call (it raised): nothing counted
            return
        (tokens, host), decode = rt.counter.calls[-1], rt.counter.decode[-1]
        disk = rt.disk_counter.calls[-1][1]
        ids = kwargs.get("input_ids", args[0] if args else None)
        cu = kwargs.get("cu_seq_lens_q")
        sequences = int(cu.numel() - 1) if cu is not None else (int(ids.shape[0]) if ids is not None else 1)
        with self.lock:
            self.calls += 1
            self.host_total += host
            self.disk_total += disk
            if decode and tokens == 1:
                self.decode_steps += 1
                self.decode_tokens += sequences
                self.decode_host += host
                self.decode_disk += disk
        rt.counter.reset()
        rt.disk_counter.reset()

    def per_token(self) -> tuple[float, float]:
        """(host-link, disk) bytes per decoded token over every decode step so far."""
        with self.lock:
            n = max(self.decode_tokens, 1)
            return self.decode_host / n, self.decode_disk / n

    def close(self) -> None:
        self.handle.remove()


class Metrics:
    """The registry and the instruments the request path feeds."""

    def __init__(self, meter: Meter, plan, *, served_name: str, kv_bytes: int, status):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        self.meter, self.plan, self.status = meter, plan, status
        self.requests = Counter("moe_offload_requests", "Requests answered, by HTTP status (or cancelled)",
                                ["status"], registry=self.registry)
        self.tokens = Counter("moe_offload_tokens", "Tokens in prompts and in completions", ["kind"],
                              registry=self.registry)
        self.ttft = Histogram("moe_offload_time_to_first_token_seconds", "Request arrival at the engine to its "
                              "first generated token", buckets=TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("moe_offload_inter_token_latency_seconds", "Time between consecutive tokens of a "
                             "request", buckets=ITL_BUCKETS, registry=self.registry)
        self.registry.register(_Live(self, served_name, kv_bytes))

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def next_tokens(self, seconds: float, n: int) -> None:
        for _ in range(n):   # n tokens in one delivery: each counted at the step's mean gap
            self.itl.observe(seconds / n)

    def answered(self, status: str, prompt_tokens: int = 0, completion_tokens: int = 0) -> None:
        self.requests.labels(status=status).inc()
        if prompt_tokens:
            self.tokens.labels(kind="prompt").inc(prompt_tokens)
        if completion_tokens:
            self.tokens.labels(kind="completion").inc(completion_tokens)

    def text(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _Live:
    """The figures read at scrape time from the engine and the runtime (gauges and monotone counters)."""

    def __init__(self, metrics: Metrics, served_name: str, kv_bytes: int):
        self.m, self.name, self.kv_bytes = metrics, served_name, kv_bytes

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        m, meter, rt = self.m, self.m.meter, self.m.meter.runtime
        running, waiting = m.status()
        yield GaugeMetricFamily("moe_offload_sequences_running", "Sequences in the decoding batch", value=running)
        yield GaugeMetricFamily("moe_offload_sequences_waiting", "Requests waiting for a slot", value=waiting)
        host, disk = meter.per_token()
        yield GaugeMetricFamily("moe_offload_link_bytes_per_token", "Bytes of offloaded weights read per decoded "
                                "token (host link + disk), over the decode steps so far", value=host + disk)
        yield GaugeMetricFamily("moe_offload_host_link_bytes_per_token", "Of which over the host link", value=host)
        yield GaugeMetricFamily("moe_offload_disk_read_bytes_per_token", "Of which read from the disk", value=disk)
        with meter.lock:
            totals = {"host": meter.host_total, "disk": meter.disk_total}
            steps, calls = meter.decode_steps, meter.calls
        link = CounterMetricFamily("moe_offload_link_bytes", "Bytes of offloaded weights read, every forward "
                                   "(prefill too), by tier", labels=["tier"])
        for tier, value in totals.items():
            link.add_metric([tier], value)
        yield link
        yield CounterMetricFamily("moe_offload_disk_read_bytes", "Bytes the disk tier read from the checkpoint",
                                  value=rt.disk.bytes_read if rt.disk is not None else 0)
        yield CounterMetricFamily("moe_offload_disk_reads", "Reads the disk tier issued",
                                  value=rt.disk.read_calls if rt.disk is not None else 0)
        yield CounterMetricFamily("moe_offload_decode_steps", "Forward calls that decoded one token per sequence",
                                  value=steps)
        yield CounterMetricFamily("moe_offload_forward_calls", "Forward calls of the model", value=calls)
        hits = CounterMetricFamily("moe_offload_cache_hits", "Expert cache hits, by level", labels=["level"])
        misses = CounterMetricFamily("moe_offload_cache_misses", "Expert cache misses, by level", labels=["level"])
        for level, cache in (("device", rt.cache), ("host", rt.host_cache)):
            if cache is not None:
                hits.add_metric([level], cache.policy.hits)
                misses.add_metric([level], cache.policy.misses)
        yield hits
        yield misses
        plan = GaugeMetricFamily("moe_offload_plan_bytes", "Weight bytes the plan put in each tier", labels=["tier"])
        for tier in ("device", "host", "disk"):
            plan.add_metric([tier], sum(t.bytes for t in m.plan.tensors if t.tier == tier))
        yield plan
        yield GaugeMetricFamily("moe_offload_kv_cache_bytes", "Bytes of the paged KV cache", value=self.kv_bytes)
        info = GaugeMetricFamily("moe_offload_model_info", "The served model and how it runs",
                                 labels=["model", "backend", "mechanism"])
        info.add_metric([self.name, rt.backend, rt.mechanism.split(":")[0]], 1)
        yield info
