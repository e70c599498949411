"""Prometheus metrics of the tool executor (default registry, served at /metrics)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

# Trivial calls take ~2-10 ms end to end, heavy ones up to the 60 s maximum timeout.
_LATENCY_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)

CALLS = Counter("tool_executor_calls_total", "finished calls by status and pool kind", ["status", "kind"])
CALL_SECONDS = Histogram("tool_executor_call_seconds", "execution time of a call (fork to reap)", ["kind"], buckets=_LATENCY_BUCKETS)
QUEUE_SECONDS = Histogram("tool_executor_queue_seconds", "time a call waited for a free slot", ["kind"], buckets=_LATENCY_BUCKETS)
BUSY_SLOTS = Gauge("tool_executor_busy_slots", "calls handed to pool parents: running, or held by a parent to start next (up to slots + prefetch)", ["kind"])
TOTAL_SLOTS = Gauge("tool_executor_slots", "calls the pool parents can run at once", ["kind"])
QUEUE_DEPTH = Gauge("tool_executor_queue_depth", "calls waiting for a slot", ["kind"])
BATCH_BACKLOG = Gauge("tool_executor_batch_backlog", "batch items admitted and not yet finished")
REJECTED = Counter("tool_executor_rejected_total", "requests turned away by backpressure", ["endpoint"])
WORKER_RESTARTS = Counter("tool_executor_worker_restarts_total", "pool parents restarted after dying", ["kind"])
SESSIONS = Gauge("tool_executor_sessions", "live sessions")
