"""The one Ray start-up every stage uses, from the `cluster` config block.

`cluster.address` null starts (or joins this process's) local Ray bound to 127.0.0.1, with
the dashboard on `cluster.dashboard_host` (127.0.0.1) and port 8265, or the next free one
when another local Ray holds it; otherwise `ray.init(address=...)` joins an existing
cluster. A Ray already initialised in this process (a test session's, a notebook's) is
reused as it is, so no stage decides the dashboard or the address for another.
"""
from __future__ import annotations

import os

from workflows.core.config import PROJECT_ROOT, ClusterSection


# Never uploaded with `cluster.code=upload`: outputs, caches, environments, VCS data.
UPLOAD_EXCLUDES = [".git", ".venv", ".cache", "runs", "outputs", "multirun", "wandb", "**/__pycache__",
                   "*.egg-info", ".pytest_cache", ".hypothesis"]


def runtime_env(cluster: ClusterSection) -> dict:
    """How Ray's workers import the project (see ClusterSection.code)."""
    if cluster.code == "upload":
        return {"working_dir": str(PROJECT_ROOT), "excludes": list(UPLOAD_EXCLUDES)}
    pythonpath = os.pathsep.join(p for p in (str(PROJECT_ROOT), os.environ.get("PYTHONPATH")) if p)
    return {"env_vars": {"PYTHONPATH": pythonpath}}


def ensure_ray(cluster: ClusterSection) -> None:
    import ray

    if ray.is_initialized():
        return
    common = dict(runtime_env=runtime_env(cluster), log_to_driver=True, configure_logging=True,
                  logging_level="WARNING")
    if cluster.address:
        ray.init(address=cluster.address, **common)
        return
    port = {} if cluster.dashboard_port is None else {"dashboard_port": cluster.dashboard_port}
    ray.init(num_cpus=cluster.num_cpus or os.cpu_count(), include_dashboard=cluster.dashboard,
             dashboard_host=cluster.dashboard_host, _node_ip_address="127.0.0.1", **port, **common)
