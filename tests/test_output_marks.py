"""Settings marked NOT_OUTPUT (eagle3.schema) change how a stage runs, never what it writes:
every hash and done-key is made of the other settings. Walked field by field over the
schema, so a new setting is covered the day it is added."""

from __future__ import annotations

import dataclasses

from eagle3.schema import affects_output, output_dict
from workflows.core.config import compose
from workflows.core.layout import shared_hashes


def changed(value):
    """Another value of the same kind (the hashes read values, not their validity)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return value + "-other"
    if isinstance(value, list):
        return [*value, 7]
    if isinstance(value, dict):
        return {**value, "other": 1}
    return 3  # None


def leaf_fields(section):
    for f in dataclasses.fields(section):
        if not dataclasses.is_dataclass(getattr(section, f.name)):
            yield f


# Section -> the shared stage hashes reading it (workflows.core.layout.shared_hashes).
READERS = {"data": {"generate", "capture", "vocab"}, "capture": {"capture"}, "target": {"generate", "capture", "vocab"}}


def test_every_setting_moves_the_shared_hashes_exactly_when_it_affects_output():
    cfg = compose(["target=tiny", "shared_dir=/tmp/shared"])
    base = shared_hashes(cfg)
    marked = []
    for name, readers in READERS.items():
        section = getattr(cfg, name)
        for f in leaf_fields(section):
            if f.name == "capture_layer_ids":  # read through target.capture_ids, by capture only
                continue
            other = dataclasses.replace(
                cfg, **{name: dataclasses.replace(section, **{f.name: changed(getattr(section, f.name))})}
            )
            moved = {stage for stage, h in shared_hashes(other).items() if h != base[stage]}
            if affects_output(f):  # its own stage's hash moves, and every stage downstream of it
                assert moved == readers, f"{name}.{f.name} changes the output but moves only {moved}"
            else:
                marked.append(f"{name}.{f.name}")
                assert moved == set(), f"{name}.{f.name} is marked NOT_OUTPUT yet moves {moved}"
    # The settings users raise on a running deployment are among them (issue: a raised
    # timeout re-captured the shared store).
    assert {
        "capture.engine_timeout_s",
        "capture.max_actor_restarts",
        "capture.micro_batch_tokens",
        "capture.actors",
        "data.num_engines",
        "target.env",
    } <= set(marked)


def test_output_dict_leaves_out_exactly_the_marked_fields_at_every_depth():
    cfg = compose(["target=tiny"])

    def walk(section, got, where):
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            assert (f.name in got) == affects_output(f), f"{where}.{f.name}"
            if f.name in got and dataclasses.is_dataclass(value):
                walk(value, got[f.name], f"{where}.{f.name}")

    for name in ("data", "capture", "target", "train", "draft", "evaluate"):
        walk(getattr(cfg, name), output_dict(getattr(cfg, name)), name)
    assert "log_every" not in output_dict(cfg.train) and "resume" not in output_dict(cfg.train)
    assert output_dict(cfg.train)["ttt"] == dataclasses.asdict(cfg.train.ttt)
