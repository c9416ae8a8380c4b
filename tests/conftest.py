import os

# Tests run on CPU with few threads, W&B offline, DeepSpeed told there is no GPU.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest


def _prepared(preset: str, tmp_path_factory):
    """The target preset conf/target/<preset>.yaml, prepared under the test cache."""
    from pathlib import Path

    import yaml

    from eagle3.schema import from_dict
    from eagle3.target_spec import TargetSpec
    from workflows.core.targets import prepare_target

    conf = Path(__file__).resolve().parents[1] / "conf" / "target" / f"{preset}.yaml"
    spec = from_dict(TargetSpec, yaml.safe_load(conf.read_text()), "target")
    # <cache>/targets/<name>, the layout workflows.full uses for cache_dir=<cache>.
    # EAGLE3_TEST_CACHE reuses a prepared target across sessions (local iteration only).
    cache = (
        Path(os.environ["EAGLE3_TEST_CACHE"])
        if os.environ.get("EAGLE3_TEST_CACHE")
        else tmp_path_factory.mktemp("cache")
    )
    return prepare_target(spec, cache / "targets", log=lambda _m: None)


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    """The `tiny` preset, prepared once per test session (a ~15 s build)."""
    return _prepared("tiny", tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_kimi_target(tmp_path_factory):
    """The `tiny_kimi` preset (a DeepseekV3 MoE with MLA in the kimi_k25 wrapper's layout),
    prepared once per test session (a build of about a minute on 2 cores)."""
    return _prepared("tiny_kimi", tmp_path_factory)


@pytest.fixture
def device():
    """CUDA when there is one, else the CPU: tests marked `gpu` run everywhere (CI runs
    every test and may have no GPU), on the real device where there is one."""
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="session")
def memorised(tiny_target, tmp_path_factory):
    """A draft of the tiny target that has learnt its answers to 8 prompts (acceptance near
    the chain's cap), exported for SGLang and vLLM, with the reference decoder's figures
    (tests.helpers.memorising_draft; ~30 s)."""
    from tests.helpers import memorising_draft

    return memorising_draft(tiny_target, tmp_path_factory.mktemp("memorised"))


@pytest.fixture(scope="session")
def corpus(tiny_target, tmp_path_factory):
    """A generated corpus (12 conversations of the tiny target, tests.helpers.cfg_for), for
    the capture tests, which copy it (tests.helpers.run_dir_with_corpus); once per session,
    however many modules use it."""
    from tests.helpers import cfg_for
    from workflows.generate import stage as generate

    run_dir = tmp_path_factory.mktemp("corpus")
    generate.run(cfg_for(tiny_target, run_dir), tiny_target)
    return run_dir


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray per test session (starting it takes seconds on 2 cores)."""
    import ray

    if not ray.is_initialized():
        ray.init(
            address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", logging_level="warning"
        )
    yield ray


@pytest.fixture(scope="session")
def memorised_blocks(tiny_target, tmp_path_factory):
    """A DFlash block draft of the tiny target that has learnt its answers to 8 prompts,
    exported for vLLM, with the reference decoder's figures (tests.helpers.memorising_block_draft)."""
    from tests.helpers import memorising_block_draft

    return memorising_block_draft(tiny_target, tmp_path_factory.mktemp("memorised_blocks"))
