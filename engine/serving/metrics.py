"""`GET /metrics`: the /v1/stats figures in Prometheus text format (prometheus_client)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST


class _StatsCollector:
    def __init__(self, stats: dict) -> None:
        self.stats = stats

    def collect(self):
        s = self.stats
        model = s["model"]
        tp = GaugeMetricFamily(
            "moelab_throughput_tokens_per_second",
            "Tokens per second over a window",
            labels=["model", "phase", "window"],
        )
        for key, value in s["throughput"].items():
            phase, _, window = key.removesuffix("s").rpartition("_tok_s_")
            tp.add_metric([model, phase, window + "s"], value)
        yield tp
        req = s["requests"]
        yield _gauge("moelab_requests_running", "Requests decoding now", model, req["running"])
        yield _gauge("moelab_requests_queued", "Requests waiting", model, req["queued"])
        c = CounterMetricFamily("moelab_requests_completed", "Requests finished", labels=["model"])
        c.add_metric([model], req["completed"])
        yield c
        c = CounterMetricFamily(
            "moelab_requests_preempted", "Running requests preempted by recompute", labels=["model"]
        )
        c.add_metric([model], req["preempted"])
        yield c
        if req["ttft_mean_s"] is not None:
            yield _gauge(
                "moelab_ttft_mean_seconds", "Mean time to first token", model, req["ttft_mean_s"]
            )
        tokens = CounterMetricFamily("moelab_tokens", "Tokens processed", labels=["model", "phase"])
        tokens.add_metric([model, "decode"], s["tokens"]["decode_total"])
        tokens.add_metric([model, "prefill"], s["tokens"]["prefill_total"])
        yield tokens
        mem = GaugeMetricFamily(
            "moelab_device_memory_bytes", "Device memory by use", labels=["model", "device", "use"]
        )
        for dev in s["memory"]["device"]:
            for use, value in dev.items():
                if use != "index":
                    mem.add_metric([model, str(dev["index"]), use], value)
        yield mem
        yield _gauge(
            "moelab_expert_bank_bytes",
            "Host memory of the expert bank",
            model,
            s["memory"]["expert_bank"],
        )
        kv = GaugeMetricFamily("moelab_kv_tokens", "KV cache tokens", labels=["model", "kind"])
        for kind in ("tokens_total", "tokens_used", "tokens_peak", "max_context"):
            kv.add_metric([model, kind.removeprefix("tokens_")], s["kv"][kind])
        yield kv
        prefix = s["kv"].get("prefix_cache")
        if prefix:
            prompt = CounterMetricFamily(
                "moelab_prompt_tokens",
                "Prompt tokens admitted, by whether the prefix cache held their KV",
                labels=["model", "source"],
            )
            cached = prefix["cached_tokens"]
            prompt.add_metric([model, "cached"], cached)
            prompt.add_metric([model, "computed"], prefix["prompt_tokens"] - cached)
            yield prompt
        experts = s.get("experts")
        if experts:
            layer_counts = CounterMetricFamily(
                "moelab_expert_reads",
                "Decode expert reads per MoE layer by outcome",
                labels=["model", "layer", "outcome"],
            )
            for row in experts["layers"]:
                for outcome in ("hits", "fills", "cpu"):
                    layer_counts.add_metric([model, str(row["layer"]), outcome], row[outcome])
            yield layer_counts
            yield _gauge("moelab_expert_cache_slots", "Expert cache slots", model, experts["slots"])
            if experts["hit_rate_60s"] is not None:
                yield _gauge(
                    "moelab_expert_hit_rate_60s",
                    "Expert cache hit rate, last 60 s",
                    model,
                    experts["hit_rate_60s"],
                )
            miss_cost = experts.get("miss_cost") or {}
            if miss_cost.get("us_per_miss") is not None:
                yield _gauge(
                    "moelab_expert_miss_cost_seconds",
                    "What one more expert miss adds to a decode step, fitted from the engine's "
                    "own steps",
                    model,
                    miss_cost["us_per_miss"] / 1e6,
                )


def _gauge(name: str, doc: str, model: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=["model"])
    g.add_metric([model], value)
    return g


def render_metrics(stats: dict) -> tuple[bytes, str]:
    registry = CollectorRegistry()
    registry.register(_StatsCollector(stats))
    return generate_latest(registry), CONTENT_TYPE_LATEST
