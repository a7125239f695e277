"""``GET /metrics``: the engine's metrics and the server's counters in Prometheus text format.

A custom collector reads one `EngineMetrics` snapshot per scrape (cheap: no MLX work), so
the figures are never stale and nothing has to be updated on the hot path. Latency
percentiles are exported as gauges with a ``quantile`` label (the engine keeps P50/P95/P99
over a window of recent samples; a Prometheus Summary would also need their sum).
Process memory comes from prometheus_client's own process collector.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

from app.disk_state import disk_reason
from app.server.state import ServerState

QUANTILES = {"p50": "0.5", "p95": "0.95", "p99": "0.99"}
# engine latency window -> (metric name, help)
LATENCIES = {
    "ttft_s": ("kvchat_ttft_seconds", "time to first token (queue + prefill)"),
    "itl_s": ("kvchat_itl_seconds", "inter-token latency while decoding"),
    "prefill_tps": ("kvchat_prefill_tokens_per_second", "prefill speed per request"),
    "decode_tps": ("kvchat_decode_tokens_per_second", "decode speed per request"),
    "release_ms": ("kvchat_release_latency_ms",
                   "cancel or finish decided -> blocks back in the pool"),
    "cancel_release_ms": ("kvchat_cancel_release_latency_ms", "cancel (a client gone, the "
                          "drain deadline) -> blocks back in the pool"),
}


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


class EngineCollector:
    """Yields the metric families of one snapshot of the engine and the server."""

    def __init__(self, state: ServerState):
        self.state = state

    def collect(self):
        state = self.state
        m = state.engine.metrics()
        info = InfoMetricFamily("kvchat_model", "the served model and its KV format")
        info.add_metric([], {"model": state.model_id, "kv_format": m.kv_format,
                             "fingerprint": state.engine.loaded.fingerprint[:16]})
        yield info
        blocks = GaugeMetricFamily("kvchat_kv_blocks", "KV pool blocks by state",
                                   labels=["state"])
        for name in ("free", "used", "cached", "shared"):
            blocks.add_metric([name], getattr(m, f"blocks_{name}"))
        yield blocks
        yield _gauge("kvchat_kv_blocks_total", "blocks in the KV pool", m.blocks_total)
        yield _gauge("kvchat_kv_used_bytes", "bytes of blocks in use", m.used_bytes)
        yield _gauge("kvchat_kv_peak_bytes", "most bytes of blocks ever in use", m.peak_bytes)
        yield _gauge("kvchat_kv_budget_bytes", "bytes of the KV pool", m.budget_bytes)
        yield _gauge("kvchat_kv_bytes_per_token", "KV bytes per cached token", m.bytes_per_token)
        yield _gauge("kvchat_active_sequences", "sequences holding blocks", m.active_sequences)
        yield _counter("kvchat_evictions", "cached blocks evicted for reuse", m.evictions)
        yield _gauge("kvchat_prefix_hit_rate", "prompt tokens served from the prefix cache / "
                     "prompt tokens", m.hit_rate)
        yield _counter("kvchat_prefix_cached_tokens", "prompt tokens served from the prefix "
                       "cache", m.cached_tokens_total)
        yield _counter("kvchat_prompt_tokens", "prompt tokens admitted", m.prompt_tokens_total)
        yield _gauge("kvchat_release_latency_last_ms", "the last release's latency",
                     m.release_latency_ms)
        queues = GaugeMetricFamily("kvchat_requests", "requests by scheduler queue",
                                   labels=["state"])
        for name in ("waiting", "running", "swapped"):
            queues.add_metric([name], getattr(m, name))
        yield queues
        yield _counter("kvchat_preemptions", "running sequences preempted", m.preemptions)
        yield _counter("kvchat_rejections", "requests the engine refused at submit",
                       m.rejections)
        yield _counter("kvchat_spec_proposed", "draft tokens verified (speculative decoding)",
                       m.spec_proposed)
        yield _counter("kvchat_spec_accepted", "draft tokens accepted", m.spec_accepted)
        finished = CounterMetricFamily("kvchat_requests_finished", "requests by how they "
                                       "ended", labels=["reason"])
        for reason, n in sorted(m.finished.items()):
            finished.add_metric([reason], n)
        yield finished
        yield _counter("kvchat_engine_steps", "engine steps run", m.steps)
        yield from _forwards(m)
        yield from _latencies(m)
        yield from _disk(m)
        yield from _server(state)


def _forwards(m):
    seconds = CounterMetricFamily("kvchat_forward_seconds", "time in forwards by kind",
                                  labels=["kind"])
    tokens = CounterMetricFamily("kvchat_forward_tokens", "tokens through forwards by kind",
                                 labels=["kind"])
    for kind, clock in (("prefill", m.prefill_forward), ("decode", m.decode_forward),
                        ("mixed", m.mixed_forward)):
        seconds.add_metric([kind], clock.seconds)
        tokens.add_metric([kind], clock.tokens)
    yield seconds
    yield tokens


def _latencies(m):
    for key, (name, doc) in LATENCIES.items():
        family = GaugeMetricFamily(name, f"{doc}: P50/P95/P99 over recent requests",
                                   labels=["quantile"])
        pct = m.latency.get(key)
        for attr, q in QUANTILES.items():
            family.add_metric([q], getattr(pct, attr) if pct is not None else 0.0)
        yield family
        yield _gauge(f"{name}_samples", f"samples behind {name}",
                     pct.count if pct is not None else 0)


def _disk(m):
    state = InfoMetricFamily("kvchat_disk_cache", "the disk prefix cache: on, read-only "
                             "(served, not written) or off, and why")
    state.add_metric([], {"state": m.disk_state or "off", "reason": disk_reason(m) or ""})
    yield state
    yield _gauge("kvchat_disk_entries", "entries in the disk prefix store", m.disk_entries)
    yield _gauge("kvchat_disk_bytes", "bytes in the disk prefix store", m.disk_bytes)
    yield _counter("kvchat_disk_hits", "prefix blocks restored from disk", m.disk_hits)
    yield _counter("kvchat_disk_write_errors", "disk prefix writes that failed",
                   m.disk_write_errors)


def _server(state: ServerState):
    c = state.counters
    responses = CounterMetricFamily("kvchat_http_responses", "HTTP responses by route and "
                                    "status", labels=["route", "status"])
    for (route, status), n in sorted(c.responses.items()):
        responses.add_metric([route, str(status)], n)
    yield responses
    yield _counter("kvchat_client_disconnects", "requests cancelled because the client left",
                   c.disconnects)
    yield _counter("kvchat_drain_cancels", "requests cancelled at a SIGTERM drain deadline",
                   c.drain_cancels)
    yield _gauge("kvchat_inflight_requests", "requests being answered", state.pump.num_live)
    yield _gauge("kvchat_draining", "1 while shutting down", int(state.draining))


def make_registry(state: ServerState) -> CollectorRegistry:
    """A registry of this server alone (not the process-global default one)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(state))
    ProcessCollector(registry=registry)  # process_resident_memory_bytes, cpu, fds
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
