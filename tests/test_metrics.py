"""Stage metrics reach Ray's Prometheus endpoint, from the driver and from a stage's actor."""

from __future__ import annotations

import re
import sys
import time
import urllib.request

import pytest

from workflows.core import stage_metrics
from workflows.core.cluster import ensure_ray
from workflows.core.config import ClusterSection
from workflows.core.stage_metrics import StageMetrics

SAMPLE = re.compile(r"^(ray_eagle3_stage_\w+)\{(.*)\} (\S+)$")


def scrape(port: int) -> dict[tuple[str, str, str, str], float]:
    """(metric, stage, unit, worker) -> value, from the node's Prometheus text."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    values = {}
    for line in text.splitlines():
        if m := SAMPLE.match(line):
            tags = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            values[(m.group(1), tags["stage"], tags["unit"], tags["worker"])] = float(m.group(3))
    return values


class CaptureLikeActor:
    """Stands in for a stage's actor: reports progress through StageMetrics."""

    def report(self) -> float:
        tokens = StageMetrics("capture", "tokens", worker="actor0", total=300)
        tokens.started -= 2.0  # as if it had started two seconds ago: 120 tokens make ~60 a second
        tokens.advance(100)
        tokens.advance(20)
        return tokens.done


def test_advance_counts_and_rates(monkeypatch):
    """Without Ray the metrics do nothing, but advance still keeps the count and the rate."""
    seen = []
    monkeypatch.setattr(StageMetrics, "_set", lambda self, name, value: seen.append((name, value)))
    m = StageMetrics("generate", "conversations", total=10)
    m.started -= 2.0  # as if the loop had started two seconds ago
    m.advance(3)
    m.advance(1)
    assert seen[0] == ("total", 10) and seen[3] == ("progress", 4)
    assert seen[4][0] == "throughput" and 1.9 < seen[4][1] <= 2.0  # 4 units in ~2 s


@pytest.mark.slow
def test_stage_metrics_are_exported_while_a_stage_runs(monkeypatch):
    import ray
    import ray.cloudpickle

    monkeypatch.setattr(stage_metrics, "_METRICS", None)  # gauges of this Ray, not of an earlier one
    # No dashboard: each node's agent exports the metrics without it.
    ensure_ray(ClusterSection(num_cpus=1, dashboard=False))
    port = ray._private.worker.global_worker.node.metrics_export_port
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
    actor = ray.remote(num_cpus=0)(CaptureLikeActor).remote()  # kept alive while we scrape
    assert ray.get(actor.report.remote()) == 120
    StageMetrics("generate", "conversations", total=48).advance(12)

    want = {
        ("ray_eagle3_stage_progress", "capture", "tokens", "actor0"): 120.0,
        ("ray_eagle3_stage_total", "capture", "tokens", "actor0"): 300.0,
        ("ray_eagle3_stage_progress", "generate", "conversations", "driver"): 12.0,
        ("ray_eagle3_stage_total", "generate", "conversations", "driver"): 48.0,
    }
    rate = ("ray_eagle3_stage_throughput", "capture", "tokens", "actor0")  # 120 tokens over ~2 s

    def arrived(values: dict) -> bool:  # the last values: an export can carry one gauge's before another's
        return {k: values.get(k) for k in want} == want and 59.0 < values.get(rate, 0.0) <= 60.0

    deadline, values = time.monotonic() + 60, {}
    while time.monotonic() < deadline and not arrived(values):  # exported every few seconds
        time.sleep(1)
        values = scrape(port)
    assert arrived(values), {k: values.get(k) for k in (*want, rate)}
    ray.kill(actor)
