"""Every stage's progress and throughput as Ray metrics, tagged with the stage's name.

Ray exports them with its own metrics (Prometheus format, on each node's metrics port;
the dashboard's Metrics view graphs them when Prometheus/Grafana are set up, see
docs/operations.md): `eagle3_stage_progress` (units done: samples, tokens or steps, with `unit`),
`eagle3_stage_throughput` (units per second) and `eagle3_stage_total` (units planned).
Prometheus sees them with Ray's prefix: `ray_eagle3_stage_progress{stage="capture",...}`.
Metrics are a convenience: outside Ray, or if Ray's metrics cannot start, they do nothing.

    tokens = StageMetrics("capture", "tokens", total=n)   # where a stage starts its loop
    tokens.advance(k)                                     # k more units done: progress, units/s
"""

from __future__ import annotations

import time

_METRICS: dict | None = None


def _metrics() -> dict | None:
    global _METRICS
    if _METRICS is None:
        try:
            import ray
            from ray.util.metrics import Gauge

            if not ray.is_initialized():
                return None
            tags = ("stage", "unit", "worker")
            _METRICS = {
                "progress": Gauge("eagle3_stage_progress", "units done by the stage", tag_keys=tags),
                "throughput": Gauge("eagle3_stage_throughput", "units per second", tag_keys=tags),
                "total": Gauge("eagle3_stage_total", "units planned", tag_keys=tags),
            }
        except Exception:
            return None
    return _METRICS


class StageMetrics:
    def __init__(self, stage: str, unit: str, worker: str = "driver", total: float | None = None):
        self.tags = {"stage": stage, "unit": unit, "worker": worker}
        self.done, self.started = 0.0, time.perf_counter()  # for `advance`
        if total is not None:
            self._set("total", total)

    def _set(self, name: str, value: float) -> None:
        metrics = _metrics()
        if metrics is not None:
            metrics[name].set(float(value), tags=self.tags)

    def progress(self, done: float, total: float | None = None) -> None:
        self._set("progress", done)
        if total is not None:
            self._set("total", total)

    def throughput(self, per_second: float) -> None:
        self._set("throughput", per_second)

    def advance(self, units: float) -> None:
        """`units` more done: progress is the running count, throughput the count over the
        seconds since this object was made (the stage's loop started)."""
        self.done += units
        self._set("progress", self.done)
        self._set("throughput", self.done / max(time.perf_counter() - self.started, 1e-9))
