"""The one Ray start-up every stage uses, from the `cluster` config block.

`cluster.address` null starts (or joins this process's) local Ray bound to 127.0.0.1 (a
new one: never a cluster that `ray start` left recorded on the machine), with
the dashboard on `cluster.dashboard_host` (127.0.0.1) and port 8265, or the next free one
when another local Ray holds it; otherwise `ray.init(address=...)` joins an existing
cluster. A Ray already initialised in this process (a test session's, a notebook's) is
reused as it is, so no stage decides the dashboard or the address for another.
"""

from __future__ import annotations

import math
import os

from workflows.core.config import PROJECT_ROOT, ClusterSection, ConfigError

# Never uploaded with `cluster.code=upload`: outputs, caches, environments, VCS data.
UPLOAD_EXCLUDES = [
    ".git",
    ".venv",
    ".cache",
    "runs",
    "outputs",
    "multirun",
    "wandb",
    "**/__pycache__",
    "*.egg-info",
    ".pytest_cache",
    ".hypothesis",
]


def runtime_env(cluster: ClusterSection) -> dict:
    """How Ray's workers import the project (see ClusterSection.code)."""
    if cluster.code == "upload":
        return {"working_dir": str(PROJECT_ROOT), "excludes": list(UPLOAD_EXCLUDES)}
    pythonpath = os.pathsep.join(p for p in (str(PROJECT_ROOT), os.environ.get("PYTHONPATH")) if p)
    return {"env_vars": {"PYTHONPATH": pythonpath}}


# A local Ray for a stream of states (train.data_source=stream): Ray frees objects in batches
# once a second by default; a stream turns several blocks of states over a second, so prompt
# frees keep the object store at what is really in flight.
STREAM_SYSTEM_CONFIG = {"free_objects_period_milliseconds": 20}


def stream_cpus(cfg) -> float:
    """The CPUs a streaming train stage reserves: its training workers and their engine
    actors (`capture.actors` shared out over the workers, at least one each)."""
    t, c = cfg.train, cfg.capture
    actors = max(1, round(c.actors / t.num_workers))
    return t.num_workers * t.cpus_per_worker + t.num_workers * actors * c.cpus_per_actor


def ensure_ray(cluster: ClusterSection, system_config: dict | None = None, min_cpus: float = 0) -> None:
    """`system_config`: Ray's own settings for a local Ray started here (`_system_config`);
    `min_cpus`: the logical CPUs it must offer at least (a stream's trainers and engines
    share the cores; null `cluster.num_cpus` would otherwise offer one per core)."""
    import ray

    if ray.is_initialized():
        return
    common = dict(runtime_env=runtime_env(cluster), log_to_driver=True, configure_logging=True, logging_level="WARNING")
    if cluster.address:
        try:
            ray.init(address=cluster.address, **common)
        except ConnectionError as err:
            # `ray start --head` turns token authentication on, and Ray sends no token to an
            # address given explicitly unless told to (it would hand this machine's token to
            # whatever listens there), so the usual cause deserves a line of its own.
            raise ConfigError(
                f"cluster.address={cluster.address}: could not join the Ray cluster ({err}). If it "
                "uses token authentication (the default of `ray start --head`), set RAY_AUTH_MODE=token "
                "and provide its token (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)"
            ) from err
        return
    port = {} if cluster.dashboard_port is None else {"dashboard_port": cluster.dashboard_port}
    # address="local": a new Ray for this job. Without it Ray would join whatever cluster
    # `ray start` last recorded on this machine (/tmp/ray/ray_current_cluster), and refuse
    # num_cpus while at it, or fail on a stale record of one that has gone.
    ray.init(
        address="local",
        num_cpus=cluster.num_cpus or max(os.cpu_count() or 1, math.ceil(min_cpus)),
        include_dashboard=cluster.dashboard,
        dashboard_host=cluster.dashboard_host,
        _node_ip_address="127.0.0.1",
        **port,
        **common,
        **({"_system_config": system_config} if system_config else {}),
    )
