"""Prometheus metrics for the server: requests, tokens, target forwards, accepted draft tokens
and acceptance per draft depth, queue state."""

from __future__ import annotations

import threading

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics,
                               generate_latest)
from prometheus_client.core import GaugeMetricFamily

from ..decoding.engine import Metrics

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServerMetrics:
    def __init__(self, draft_depth: int = 0):
        """``draft_depth``: the deepest level the engine's trees can reach; the per-depth series
        exist from the start for depths 1..draft_depth (a scrape before any drafted cycle, or
        while cost-aware drafting backs off, still shows them)."""
        disable_created_metrics()  # no *_created series (process-wide): they only add noise to scrapes
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("jakiro_requests", "HTTP requests to the generation endpoints",
                                ["endpoint", "status"], registry=r)
        self.cancelled = Counter("jakiro_requests_cancelled", "requests whose client went away", registry=r)
        self.prompt_tokens = Counter("jakiro_prompt_tokens", "prompt tokens processed", registry=r)
        self.cached_tokens = Counter("jakiro_prompt_tokens_cached",
                                     "prompt tokens taken from the prompt cache instead of prefilled", registry=r)
        self.generated = Counter("jakiro_generated_tokens", "tokens generated", registry=r)
        self.forwards = Counter("jakiro_target_forwards", "target verification forwards", registry=r)
        self.accepted = Counter("jakiro_accepted_tokens",
                                "draft tokens accepted by verification (bonus tokens excluded)", registry=r)
        self.latency = Histogram("jakiro_request_seconds", "generation time per finished request",
                                 buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120), registry=r)
        self.first_token_s = Histogram("jakiro_time_to_first_token_seconds",
                                       "from a request's arrival to its first generated tokens",
                                       buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30), registry=r)
        self.inter_token_s = Histogram("jakiro_inter_token_seconds",
                                       "between one commit of a request's tokens and its next",
                                       buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2), registry=r)
        self.batch_size = Histogram("jakiro_batch_size", "requests decoded together per step",
                                    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32), registry=r)
        self._lock = threading.Lock()
        self._total = Metrics()  # every finished request since start
        self._total.depth_tried = [0] * draft_depth
        self._total.depth_accepted = [0] * draft_depth
        r.register(_Derived(self))

    def first_token(self, seconds: float) -> None:
        self.first_token_s.observe(seconds)

    def inter_token(self, seconds: float) -> None:
        self.inter_token_s.observe(seconds)

    def batch_step(self, size: int) -> None:
        self.batch_size.observe(size)

    def track_queue(self, scheduler) -> None:
        Gauge("jakiro_queue_waiting", "requests waiting for the engine",
              registry=self.registry).set_function(lambda: scheduler.waiting)
        Gauge("jakiro_requests_running", "requests being decoded",
              registry=self.registry).set_function(lambda: scheduler.running)
        Gauge("jakiro_parallel_slots", "requests the engine decodes together at most",
              registry=self.registry).set_function(lambda: scheduler.parallel)
        Gauge("jakiro_engine_busy", "1 while the engine decodes a request",
              registry=self.registry).set_function(lambda: 1.0 if scheduler.busy else 0.0)

    def record(self, result) -> None:
        m = result.metrics
        self.prompt_tokens.inc(m.prompt_tokens)
        self.cached_tokens.inc(m.cached_tokens)
        self.generated.inc(m.new_tokens)
        self.forwards.inc(m.target_forwards)
        self.accepted.inc(max(0, m.committed - m.target_forwards))
        self.latency.observe(m.total_s)
        with self._lock:
            self._total.merge(m)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Derived:
    """Per-depth draft acceptance and the running tau, computed at scrape time."""

    def __init__(self, metrics: ServerMetrics):
        self.m = metrics

    def collect(self):
        with self.m._lock:
            total = self.m._total
            tried, acc, tau = list(total.depth_tried), list(total.depth_accepted), total.tau
        t = GaugeMetricFamily("jakiro_draft_depth_tried", "decode cycles whose accepted path reached "
                              "this draft depth's candidates", labels=["depth"])
        a = GaugeMetricFamily("jakiro_draft_depth_accepted", "... and accepted a token there", labels=["depth"])
        rate = GaugeMetricFamily("jakiro_acceptance_rate", "accepted / tried per draft depth (NaN before "
                                 "a cycle tried that depth)", labels=["depth"])
        for d, (n, k) in enumerate(zip(tried, acc)):
            t.add_metric([str(d + 1)], n)
            a.add_metric([str(d + 1)], k)
            rate.add_metric([str(d + 1)], k / n if n else float("nan"))
        yield t
        yield a
        yield rate
        yield GaugeMetricFamily("jakiro_tau", "tokens committed per target forward since start",
                                value=tau)
