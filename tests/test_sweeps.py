"""Sweeps: shared corpus and store across runs, the W&B sweep file, the cluster presets."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from workflows import full
from workflows.capture import stage as capture_stage
from workflows.core import config as config_module
from workflows.core import markers
from workflows.core.config import PROJECT_ROOT, compose
from workflows.core.layout import RunLayout
from workflows.core.markers import DONE
from workflows.generate import stage as generate_stage

SWEEP_FILE = PROJECT_ROOT / "conf" / "sweep" / "ttt_noise_lr.yaml"


def tiny_trial(tiny_target, tmp_path, *extra):
    """One sweep trial on the tiny target: its own run folder, the shared folder of the sweep."""
    name = "".join(c if c.isalnum() else "_" for c in "_".join(extra)) or "base"
    return compose(
        [
            "target=tiny",
            f"cache_dir={tiny_target.parent.parent}",
            f"run_dir={tmp_path / name}",
            f"shared_dir={tmp_path / 'shared'}",
            "mixture=bundled",
            "data.limit=6",
            "data.max_new_tokens=8",
            "data.heldout_fraction=0.25",
            "data.dtype=float32",
            "capture.dtype=float32",
            "stages=[target,generate,capture]",
            *extra,
        ]
    )


# ------------------------------------------------------------------ shared stage outputs


def test_shared_folders_follow_what_determines_each_stage(tmp_path):
    def layout(*extra):
        return RunLayout.of(
            compose(["target=tiny", f"run_dir={tmp_path / 'run'}", f"shared_dir={tmp_path / 's'}", *extra])
        )

    base = layout()
    assert set(base.shared) == {"generate", "capture", "vocab"}
    assert base.stage_dir("generate").parent == tmp_path / "s" / "generate"
    assert base.store_url == str(base.stage_dir("capture") / "store")
    assert base.corpus_shards == base.stage_dir("generate") / "shards"  # every path follows stage_dir
    assert base.stage_dir("train") == tmp_path / "run" / "train"  # a run's own stages stay in its folder

    # A train setting or the capture engines' count changes nothing shared.
    for extra in (["train.ttt.length=5", "train.optim.lr=1e-3"], ["capture.actors=3", "data.num_engines=2"]):
        assert layout(*extra).shared == base.shared, extra
    # Capture layers: same corpus and vocabulary, another store.
    other = layout("target.capture_layer_ids=[0, 1, 4]")
    assert other.stage_dir("generate") == base.stage_dir("generate")
    assert other.stage_dir("vocab") == base.stage_dir("vocab")
    assert other.stage_dir("capture") != base.stage_dir("capture") and other.store_url != base.store_url
    # A data setting: everything downstream of the corpus moves.
    moved = layout("data.max_new_tokens=64")
    assert all(moved.shared[s] != base.shared[s] for s in ("generate", "capture", "vocab"))
    # An explicit store URL holds each store under its hash.
    url = layout("capture.store=s3://bucket/stores").store_url
    assert url == f"s3://bucket/stores/{base.stage_dir('capture').name}"


def test_sharing_is_off_for_a_single_run_and_on_for_sweep_jobs(tmp_path, monkeypatch):
    single = compose(["target=tiny", f"run_dir={tmp_path}"])
    assert single.shared_dir is None and RunLayout.of(single).stage_dir("capture") == tmp_path / "capture"
    assert RunLayout.of(single).store_url == str(tmp_path / "store")

    monkeypatch.setattr(config_module, "_multirun_job_dir", lambda: "train.ttt.length=5")
    job = compose(["target=tiny", f"run_dir={tmp_path}", "train.ttt.length=5"])
    assert job.run_dir == str(tmp_path / "multirun" / "train.ttt.length=5")
    assert job.shared_dir == str(tmp_path / "shared")
    assert compose(["target=tiny", f"run_dir={tmp_path}", "shared_dir=off"]).shared_dir is None

    monkeypatch.setattr(config_module, "_multirun_job_dir", lambda: None)
    monkeypatch.setenv("WANDB_SWEEP_ID", "abc123")  # what `wandb agent` sets for each trial
    monkeypatch.setenv("WANDB_RUN_ID", "run42")
    trial = compose(["target=tiny", f"run_dir={tmp_path}"])
    assert trial.run_dir == str(tmp_path / "sweep-abc123" / "run42")
    assert trial.shared_dir == str(tmp_path / "shared")


@pytest.mark.slow
def test_trials_reuse_one_corpus_and_store(tiny_target, tmp_path, monkeypatch):
    captures, logs = [], []
    real_capture = capture_stage._capture_with_ray

    def counting_capture(*args, **kwargs):
        captures.append(1)
        return real_capture(*args, **kwargs)

    monkeypatch.setattr(capture_stage, "_capture_with_ray", counting_capture)
    monkeypatch.setattr(capture_stage, "log", logs.append)
    monkeypatch.setattr(generate_stage, "log", logs.append)
    monkeypatch.setattr(markers, "log", logs.append)  # run_stage's "reusing" line

    first = tiny_trial(tiny_target, tmp_path, "train.ttt.length=5")
    full.run(first)
    layout = RunLayout.of(first)
    store_done = Path(layout.store_url) / "zarr.json"
    marker = layout.stage_dir("capture") / DONE
    assert captures == [1] and marker.is_file() and store_done.is_file()
    stamps = (marker.stat().st_mtime_ns, store_done.stat().st_mtime_ns)

    # Differs in a train setting only: the same corpus and store, reused, nothing rewritten.
    logs.clear()
    second = tiny_trial(tiny_target, tmp_path, "train.ttt.length=6")
    assert second.run_path != first.run_path
    full.run(second)
    assert captures == [1]
    assert f"capture: reusing {layout.store_url}" in logs
    assert f"generate: reusing {layout.stage_dir('generate')}" in logs
    assert (marker.stat().st_mtime_ns, store_done.stat().st_mtime_ns) == stamps

    # Differs in a capture setting: the corpus is reused, the states go to another store.
    logs.clear()
    third = tiny_trial(tiny_target, tmp_path, "target.capture_layer_ids=[0, 1, 4]")
    full.run(third)
    other = RunLayout.of(third)
    assert captures == [1, 1] and other.store_url != layout.store_url
    assert f"generate: reusing {layout.stage_dir('generate')}" in logs
    assert other.open_store().provenance["capture_layer_ids"] == [0, 1, 4]
    assert layout.open_store().provenance["capture_layer_ids"] == [0, 2, 4]
    assert (marker.stat().st_mtime_ns, store_done.stat().st_mtime_ns) == stamps


# ------------------------------------------------------------------------ the W&B sweep


def agent_overrides(sweep: dict, values: dict) -> list[str]:
    """The overrides `wandb agent` passes for one trial: W&B's own `${args_no_hyphens}`
    formatting (`key=value`, a list as `key=[1, 14, 26]`) expanded into the sweep's command
    the way the agent does, minus the leading `python -m workflows.full`."""
    from wandb.sdk.launch.sweeps.utils import create_sweep_command_args

    formats = create_sweep_command_args({"args": {k: {"value": v} for k, v in values.items()}})
    argv = []
    for word in sweep["command"]:
        argv += formats[word[2:-1]] if word.startswith("${") and word[2:-1] in formats else [word]
    assert argv[:4] == ["${env}", "python", "-m", "workflows.full"]
    return argv[4:]


def parameter_samples(spec: dict) -> list:
    """Every listed value of a parameter, or both ends of its distribution."""
    return list(spec["values"]) if "values" in spec else [spec["min"], spec["max"]]


def test_sweep_trials_compose(tmp_path):
    sweep = yaml.safe_load(SWEEP_FILE.read_text())
    params = sweep["parameters"]
    assert set(params) == {"train.ttt.length", "train.ttt.noise.std", "train.optim.lr", "target.capture_layer_ids"}
    samples = {k: parameter_samples(v) for k, v in params.items()}
    # Enough trials that every sampled value of every parameter is used once.
    for i in range(max(len(v) for v in samples.values())):
        values = {k: v[i % len(v)] for k, v in samples.items()}
        overrides = agent_overrides(sweep, values)
        ids = values["target.capture_layer_ids"]
        assert f"target.capture_layer_ids=[{', '.join(map(str, ids))}]" in overrides  # W&B's list format
        cfg = compose([*overrides, f"run_dir={tmp_path}"])
        assert cfg.train.ttt.length == values["train.ttt.length"]
        assert cfg.train.ttt.noise.std == pytest.approx(values["train.ttt.noise.std"])
        assert cfg.train.optim.lr == pytest.approx(values["train.optim.lr"])
        assert cfg.target.capture_layer_ids == ids
        assert cfg.tracking.wandb is True and cfg.tracking.mode == "online"
    # A sampled learning rate W&B writes in exponent form parses as the same number.
    assert compose(agent_overrides(sweep, {"train.optim.lr": 3.5e-05})).train.optim.lr == pytest.approx(3.5e-05)


def test_sweep_metric_is_what_training_logs(tmp_path, monkeypatch):
    """The sweep's metric is a key the train stage logs to W&B at an evaluation step."""
    import sys
    import types

    from workflows.train import tracking

    logged = []
    run = types.SimpleNamespace(log=lambda data, step: logged.append(data), summary={}, finish=lambda: None)
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **kw: run, Settings=dict))
    cfg = compose(["target=tiny", f"run_dir={tmp_path}", "tracking.wandb=true"])
    tracker = tracking.Tracker(cfg, tmp_path)
    tracker(
        {
            "step": 9,
            "loss": 1.0,
            "lr": 1e-3,
            "grad_norm": 0.5,
            "step_acc": [0.5, 0.25],
            "eval": {"k": 4, "acceptance_walk": 1.75, "acceptance_per_position_average": 1.9, "step_acc": [0.5, 0.25]},
        }
    )
    tracker.close({})
    metric = yaml.safe_load(SWEEP_FILE.read_text())["metric"]
    assert metric["goal"] == "maximize" and logged[0][metric["name"]] == 1.75


# --------------------------------------------------------------------- cluster presets


def test_cluster_presets_compose():
    local = compose(["cluster=local"]).cluster
    assert (local.address, local.num_cpus, local.dashboard, local.dashboard_host, local.dashboard_port) == (
        None,
        None,
        True,
        "127.0.0.1",
        None,
    )
    assert compose(["cluster=existing"]).cluster.address == "auto"
    existing = compose(["cluster=existing", "cluster.address=ray://head:10001"]).cluster
    assert existing.address == "ray://head:10001" and existing.dashboard is True  # the rest: schema defaults


PROBE = """
import json, os, sys, ray
from workflows.core.cluster import ensure_ray
from workflows.core.config import ClusterSection

ensure_ray(ClusterSection(address=sys.argv[1], code="upload"))

@ray.remote
def where():
    import eagle3.modeling
    return {"module": eagle3.modeling.__file__, "cwd": os.getcwd(), "listing": sorted(os.listdir(".")),
            "node": ray.get_runtime_context().get_node_id()}

print("PROBE " + json.dumps({**ray.get(where.remote()), "cluster_cpus": ray.cluster_resources().get("CPU")}))
ray.shutdown()
"""


def test_a_job_joins_an_existing_cluster_and_ships_its_code(tmp_path):
    """cluster=existing: a Ray head started apart (`ray start --head`, as on a cluster's head
    node) is joined by address, not replaced by a local Ray; with cluster.code=upload its
    workers import the project from the copy Ray shipped with the job (nodes without the
    checkout, ray:// clients), which leaves out run folders, caches and environments."""
    import json
    import os
    import subprocess
    import sys
    import time

    from tests.helpers import free_port, kill_run

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_AUTH_MODE")}
    env["OMP_NUM_THREADS"] = "1"
    port = free_port()
    ray_cli = str(Path(sys.executable).with_name("ray"))
    head = subprocess.Popen(
        [
            ray_cli,
            "start",
            "--head",
            "--block",
            f"--port={port}",
            "--num-cpus=3",
            "--include-dashboard=false",
            "--disable-usage-stats",
        ],
        cwd=tmp_path,
        env=env,
        stdout=open(tmp_path / "head.log", "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        # Run from elsewhere, with the project importable only for the driver itself.
        probe = f"import sys; sys.path.insert(0, {str(PROJECT_ROOT)!r})\n" + PROBE
        deadline, line, proc = time.monotonic() + 180, None, None
        while line is None and time.monotonic() < deadline:  # the head takes a few seconds to come up
            assert head.poll() is None, (tmp_path / "head.log").read_text()[-3000:]
            # The head has token authentication on: a job joining by address says so.
            proc = subprocess.run(
                [sys.executable, "-c", probe, f"127.0.0.1:{port}"],
                cwd=tmp_path,
                env={**env, "RAY_AUTH_MODE": "token"},
                capture_output=True,
                text=True,
                timeout=240,
            )
            line = next((x for x in proc.stdout.splitlines() if x.startswith("PROBE ")), None)
        assert line is not None, proc.stderr[-3000:]
    finally:
        if head.poll() is None:
            kill_run(head)
    got = json.loads(line.split(" ", 1)[1])
    assert got["cluster_cpus"] == 3  # the head's resources: the job did not start its own Ray
    assert not got["module"].startswith(str(PROJECT_ROOT)) and got["module"].startswith(got["cwd"])
    assert {"eagle3", "workflows", "storage", "conf"} <= set(got["listing"])
    assert not {".venv", ".git", ".cache", "runs"} & set(got["listing"])
    assert compose(["cluster=existing", "cluster.code=upload"]).cluster.code == "upload"


def test_a_refused_join_names_the_address_and_the_token_setting(monkeypatch):
    """Ray's own refusal (ConnectionError after its retries, e.g. InvalidAuthToken) becomes
    one line naming the address and what to set."""
    import ray

    from workflows.core.cluster import ensure_ray
    from workflows.core.config import ClusterSection

    def refuse(**kwargs):
        raise ConnectionError(f"Failed to connect to Ray cluster at {kwargs['address']}")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", refuse)
    with pytest.raises(
        config_module.ConfigError, match=r"cluster.address=10.0.0.5:6379: could not join .*RAY_AUTH_MODE=token"
    ):
        ensure_ray(ClusterSection(address="10.0.0.5:6379"))
