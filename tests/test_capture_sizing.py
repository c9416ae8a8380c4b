"""What a capture will cost before it runs (workflows.capture.sizing): store bytes per
scheme, the free-space refusal in readable units, and the projection of shards, driver
memory and wall time that `capture.estimate_only` prints."""

from __future__ import annotations

import json

import pytest

from eagle3.schema import ConfigError
from workflows.capture import sizing as capture_sizing
from workflows.capture import stage as capture
from workflows.core.config import compose


def test_estimate_and_space_refusal(tiny_target, tmp_path, capsys):
    kimi = compose(["target=kimi_k25_int4"])
    est = capture_sizing.estimate(kimi.target, kimi.capture, 88_000_000, kimi.store_capture_ids)
    assert est["bytes_per_token"] == 2 * 4 * 7168 + 5 == 57349
    assert est["projected_bytes"] == 57349 * 88_000_000  # ~5.05 TB (4.59 TiB)
    assert est["projected"].startswith("5.05 TB (4.59 TiB)")
    assert est["state_dtype"] == "bfloat16" and est["by_state_dtype"] == {
        "bfloat16": {"bytes_per_token": 57349, "projected": "5.05 TB"},
        "int8": {"bytes_per_token": 4 * (7168 + 4) + 5, "projected": "2.52 TB"},  # + a float32 scale a row slice
    }
    int8_cfg = compose(["target=kimi_k25_int4", "capture.state_dtype=int8"])
    int8 = capture_sizing.estimate(int8_cfg.target, int8_cfg.capture, 88_000_000, int8_cfg.store_capture_ids)
    assert int8["bytes_per_token"] == 28693 and int8["projected"].startswith("2.52 TB")
    with pytest.raises(ConfigError, match="capture.store=.*needs ~5.05 TB.*capture.ignore_space=true"):
        capture_sizing.check_space(str(tmp_path / "store"), est["projected_bytes"], ignore=False)
    assert capture_sizing.check_space(str(tmp_path / "store"), est["projected_bytes"], ignore=True)["free_bytes"] > 0


@pytest.mark.parametrize(
    "needed, free, said",
    [
        (300_000, 120_000, "needs ~300 KB but .* has 120 KB free"),
        (4_200_000, 999, "needs ~4.2 MB but .* has 999 B free"),
        (7_340_000_000, 1_500_000_000, "needs ~7.34 GB but .* has 1.5 GB"),
    ],
)
def test_the_space_refusal_speaks_in_the_unit_that_shows_the_sizes(tmp_path, monkeypatch, needed, free, said):
    usage = type("usage", (), {"free": free, "total": 10 * free, "used": 9 * free})
    monkeypatch.setattr(capture_sizing.shutil, "disk_usage", lambda _path: usage)
    with pytest.raises(ConfigError, match=said):
        capture_sizing.check_space(str(tmp_path / "store"), needed, ignore=False)


def test_estimate_projects_wall_time_shards_manifest_and_driver_memory(tiny_target, tmp_path, capsys):
    kimi = compose(
        [
            "target=kimi_k25_int4",
            "capture.estimate_capture_tokens_per_s=5000",
            "capture.actors=8",
            "capture.estimate_generate_tokens_per_s=2000",
            "data.num_engines=8",
            "capture.shard_samples=64",
            "data.shard_size=32",
        ]
    )
    corpus = {"samples": 88_000, "tokens": 88_000_000, "answer_tokens": 44_000_000}
    p = capture_sizing.projection(kimi.capture, kimi.data, 88_000_000, corpus, measured_tps=None)
    assert p["shards"] == 1375 + 1 and p["manifest_bytes"] == 1376 * capture_sizing.MANIFEST_ROW_BYTES
    assert (
        p["driver_bytes"]
        == 1376 * capture_sizing.DRIVER_BYTES_PER_SHARD + 32 * 1000 * capture_sizing.PY_BYTES_PER_TOKEN
    )
    assert p["capture_hours"] == round(88e6 / (5000 * 8) / 3600, 2) == 0.61
    assert p["capture_tokens_per_s_from"] == "config"
    assert p["generate_answer_tokens"] == 44_000_000 and p["generate_hours"] == 0.76
    # Without a configured rate, the last capture's measured per-actor rate; without either, unknown.
    plain = compose(["target=kimi_k25_int4", "capture.shard_samples=64"])
    measured = capture_sizing.projection(plain.capture, plain.data, 88_000_000, corpus, measured_tps=4000.0)
    assert measured["capture_hours"] == round(88e6 / 4000 / 3600, 2) and measured["generate_hours"] is None
    assert measured["capture_tokens_per_s_from"] == "capture/summary.json"
    # The command: no corpus here, so tokens come from capture.estimate_tokens.
    cfg = compose(
        [
            "target=tiny",
            f"cache_dir={tiny_target.parent.parent}",
            f"run_dir={tmp_path}",
            "capture.estimate_only=true",
            "capture.estimate_tokens=1000000",
        ]
    )
    capture.capture_main(cfg)
    printed = json.loads(capsys.readouterr().out)
    assert printed["tokens"] == 1_000_000 and printed["projection"]["capture_hours"] is None
    assert printed["bytes_per_token"] == 517 and printed["by_state_dtype"]["int8"]["bytes_per_token"] == 277
    assert printed["projection"]["tokens_per_sample_from"].startswith("data.max_length")
    with pytest.raises(ConfigError, match="set capture.estimate_tokens"):
        capture.capture_main(
            compose(
                [
                    "target=tiny",
                    f"cache_dir={tiny_target.parent.parent}",
                    f"run_dir={tmp_path}",
                    "capture.estimate_only=true",
                ]
            )
        )


def test_the_spot_check_is_skipped_for_a_target_above_the_drivers_memory(tiny_target, tmp_path, monkeypatch, capsys):
    """The memory guard with figures: a Kimi-K2.5-sized target (1.03T parameters, bf16) on a
    128 GiB driver is skipped, a 135M float32 one is checked; the stage logs the skip in one
    line and records its reason."""
    from workflows.capture import spot_check

    assert spot_check.reference_bytes(135_000_000, "float32") == int(135e6 * 4 * 1.25) + (1 << 30)
    assert spot_check.skip_reason(135_000_000, "float32", 16 << 30) is None
    said = (
        "an HF reference of the target (1,030B parameters in bfloat16) needs ~2.58 TB in the driver, "
        "which has 137 GB available"
    )
    assert spot_check.skip_reason(1_030_000_000_000, "bfloat16", 128 << 30) == said
    assert 0 < spot_check.checkpoint_parameters(tiny_target) < 50_000_000
    monkeypatch.setattr(capture, "available_memory", lambda: 64 << 20)  # a 64 MB driver
    from tests.helpers import cfg_for

    cfg = cfg_for(tiny_target, tmp_path)
    record = capture.run_spot_check(cfg, tiny_target, str(tmp_path / "store"))  # no store needed: skipped
    assert record["ran"] is False and record["reason"].endswith("which has 67.1 MB available")
    (line,) = [x for x in capsys.readouterr().out.splitlines() if "spot check" in x]
    assert "capture: spot check skipped: an HF reference of the target" in line
    # A target transformers cannot load has no second implementation here: skipped the same way.
    from types import SimpleNamespace

    import workflows.core.engines as engines

    def refuse(spec):
        raise ValueError("unknown quantization method 'mystery'")

    monkeypatch.setattr(engines, "HFEngine", refuse)
    reader = SimpleNamespace(provenance={"capture_layer_ids": [0, 2, 4]}, shards=[{"shard": "s", "n_samples": 1}])
    record = spot_check.spot_check(
        reader, tiny_target, {"dtype": "float32", "target_path": str(tiny_target)}, 2, "int8"
    )
    assert record == {
        "ran": False,
        "reason": "HF transformers cannot load the target as a reference (ValueError: unknown quantization "
        "method 'mystery')",
    }
