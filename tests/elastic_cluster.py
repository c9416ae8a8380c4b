"""A train stage on a two-node Ray (ray.cluster_utils: a head and one more node, one CPU
each, one training worker on each) that loses its second node mid-run, for
tests/test_train_scale.py's elastic scaling test:

    python -m tests.elastic_cluster <record.json> <hydra overrides...>

Once the step-8 checkpoint is in and step 9 logged, the second node is removed (its raylet
and the worker on it killed); the positions that checkpoint holds are written to
<record.json> for the test, which reads what each rank trained up to them. Then the stage
runs to its end (or fails) in this process, on what is left of the cluster.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path


def main() -> None:
    import ray
    from ray.cluster_utils import Cluster

    from workflows import full
    from workflows.core.config import compose
    from workflows.train.checkpoint import latest_ray_checkpoint

    record, overrides = Path(sys.argv[1]), sys.argv[2:]
    cfg = compose(overrides)
    train_dir = Path(cfg.run_dir) / "train"
    # The lost node is seen within a second or two (Ray's health checks, every 0.5 s), and a
    # start that waits for it anyway gives up after 10 s (RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S,
    # set by the test) and retries on what is left, rather than after Ray's 30 s and 60 s.
    checks = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500, "health_check_failure_threshold": 2}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "_system_config": checks})
    second = cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address)  # the stage joins this Ray (workflows.core.cluster)

    def lose_the_second_node() -> None:
        metrics = train_dir / "metrics.jsonl"
        while True:
            steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines()] if metrics.exists() else []
            latest = latest_ray_checkpoint(train_dir)
            if steps and steps[-1] >= 9 and latest is not None:
                break
            time.sleep(0.05)
        positions = [json.loads((latest / f"loop_rank{r}.json").read_text())["position"] for r in (0, 1)]
        record.write_text(json.dumps({"checkpoint": latest.name, "positions": positions}))
        cluster.remove_node(second)

    threading.Thread(target=lose_the_second_node, daemon=True).start()
    try:
        full.run(cfg)
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
