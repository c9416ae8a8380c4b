"""A train stage on a Ray that grows and shrinks (ray.cluster_utils: a head of one CPU, and a
second one-CPU node that joins and later leaves), for tests/test_train_scale.py's elastic
scaling test:

    python -m tests.elastic_cluster <record.json> <hydra overrides...>

With `train.min_workers=1 train.num_workers=2` the group starts on the head's one worker.
Once the step-8 checkpoint is in, the second node joins: Ray Train grows the group to 2,
from the latest checkpoint. Once Ray has recorded that group's first checkpoint (two ranks'
loop states), the second node is removed (its raylet and the worker on it killed): the group
shrinks to 1 and goes on from the latest checkpoint. The stage runs to its end in this
process. <record.json> gets, for the test, every checkpoint's positions by step (read as
each appears: Ray keeps only the latest ones) and the ledger's (rank, worker) keys at the
join and at the loss, which tell the three groups' batches apart.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from unittest import mock


def ledger_keys(train_dir: Path) -> list[list]:
    keys = set()
    for file in (train_dir / "trained").glob("rank*.jsonl"):
        for line in file.read_text().splitlines():
            if line.endswith("}"):
                keys.add((int(file.stem.removeprefix("rank")), json.loads(line)["worker"]))
    return sorted(keys)


def main() -> None:
    import ray
    from ray.cluster_utils import Cluster

    from workflows import full
    from workflows.core.config import compose
    from workflows.train.checkpoint import latest_ray_checkpoint, ray_run_dir

    def steps_of(folder: Path) -> int:
        return json.loads((folder / "loop_rank0.json").read_text())["step"]

    record_file, overrides = Path(sys.argv[1]), sys.argv[2:]
    cfg = compose(overrides)
    train_dir = Path(cfg.run_dir) / "train"
    # The lost node is seen within a second or two (Ray's health checks, every 0.5 s), and a
    # start that waits for it anyway gives up after 10 s (RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S,
    # set by the test) and retries on what is left, rather than after Ray's 30 s and 60 s.
    checks = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500, "health_check_failure_threshold": 2}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "_system_config": checks})
    ray.init(address=cluster.address)  # the stage joins this Ray (workflows.core.cluster)
    record: dict = {"checkpoints": {}, "events": []}
    done = threading.Event()

    def checkpoints() -> dict[int, list]:
        """Every complete checkpoint seen so far: step -> each rank's position."""
        for folder in sorted(ray_run_dir(train_dir).glob("checkpoint_*")):
            files = sorted(folder.glob("loop_rank*.json"))
            states = []
            try:
                states = [json.loads(f.read_text()) for f in files]
            except (OSError, json.JSONDecodeError):  # being written or removed: next round
                continue
            # Ray gathers the ranks' files into the folder one after the other: keep the fullest read
            if states and len(states) > len(record["checkpoints"].get(str(states[0]["step"]), [])):
                record["checkpoints"][str(states[0]["step"])] = [s["position"] for s in states]
        return {int(k): v for k, v in record["checkpoints"].items()}

    def steps() -> list[int]:
        metrics = train_dir / "metrics.jsonl"
        return [json.loads(x)["step"] for x in metrics.read_text().splitlines() if x] if metrics.exists() else []

    def drive() -> None:
        second = None
        while not done.is_set():
            seen, logged = checkpoints(), steps()
            if second is None and 8 in seen and logged and logged[-1] >= 9:
                # A node started here registers a SIGTERM handler, which only the main thread
                # may do (it runs the stage); this process is killed whole by the test anyway.
                with mock.patch("ray._private.utils.set_sigterm_handler"):
                    second = cluster.add_node(num_cpus=1)
                record["events"].append({"event": "joined", "keys": ledger_keys(train_dir)})
            elif second is not None and len(record["events"]) == 1:
                # the grown group's checkpoint, recorded by Ray (complete): the one it goes on from
                latest = latest_ray_checkpoint(train_dir)
                if latest is not None and (latest / "loop_rank1.json").exists() and logged[-1] > steps_of(latest):
                    cluster.remove_node(second)
                    record["events"].append({"event": "left", "keys": ledger_keys(train_dir)})
            record_file.write_text(json.dumps(record))
            time.sleep(0.05)

    thread = threading.Thread(target=drive, daemon=True)
    thread.start()
    try:
        full.run(cfg)
    finally:
        done.set()
        thread.join(timeout=5)
        checkpoints()
        record_file.write_text(json.dumps(record))
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
