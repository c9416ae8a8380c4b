"""Driver memory at scale: planning and dispatching a capture holds what a few corpus
files need, not the corpus. Two synthetic corpora 10x apart are planned in one run, and the
driver's peak Python allocation (tracemalloc) is compared with the old way (read the whole
corpus, plans with every token) measured on the same corpora."""

from __future__ import annotations

import random
import time
import tracemalloc

import pytest

from workflows.capture import stage as capture
from workflows.capture.writer import CorpusFiles
from workflows.core import shard_plan as capture_plan
from workflows.core.config import compose
from workflows.core.layout import RunLayout
from workflows.core.markers import mark_done
from workflows.generate.regenerate import commit_shard_files

SAMPLE_TOKENS = 128  # tokens per synthetic conversation
FILE_ROWS = 200  # conversations per generate shard, as data.shard_size fixes them
SHARD_SAMPLES = 8


def synthetic_corpus(tiny_target, run_dir, n: int) -> RunLayout:
    """A finished generate stage of `n` conversations (random tokens), written as the
    generate actors write it: <k>.parquet + <k>.done.json per FILE_ROWS rows, then DONE."""
    cfg = compose(
        [
            "target=tiny",
            f"cache_dir={tiny_target.parent.parent}",
            f"run_dir={run_dir}",
            f"capture.shard_samples={SHARD_SAMPLES}",
        ]
    )
    layout = RunLayout.of(cfg)
    layout.corpus_shards.mkdir(parents=True)
    rng = random.Random(n)
    for k in range(0, n, FILE_ROWS):
        rows = [
            {
                "id": f"s{i:07d}",
                "dataset": "synthetic",
                "split": "heldout" if i % 10 == 0 else "train",
                "shard": k // FILE_ROWS,
                "status": "ok",
                "error": None,
                "finish": "length",
                "truncated": False,
                "turns_cut": 0,
                "messages_json": "[]",
                "input_ids": [rng.randrange(256, 49152) for _ in range(SAMPLE_TOKENS)],
                "loss_mask": [1] * SAMPLE_TOKENS,
                "prompt_tokens": 0,
                "answer_tokens": SAMPLE_TOKENS,
            }
            for i in range(k, min(n, k + FILE_ROWS))
        ]
        commit_shard_files(layout.corpus_shards, k // FILE_ROWS, rows)
    mark_done(layout.stage_dir("generate"), {"synthetic": n})
    return layout


def peak_bytes(fn) -> tuple[int, object]:
    tracemalloc.start()
    try:
        result = fn()
        return tracemalloc.get_traced_memory()[1], result
    finally:
        tracemalloc.stop()


def cpu_seconds(fn) -> float:
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def fresh_dir(path):
    path.mkdir()
    return path


def dispatch(layout: RunLayout, out):
    """What the capture driver does before Ray Data starts: plan the corpus, select the
    shards to do (here all of them), hand Ray Data a file of shard refs."""
    plans, _, corpus_sha, plan_file = capture_plan.plan_corpus(layout, SHARD_SAMPLES, out)
    todo = capture_plan.select_plans(plan_file, {name for name, _ in plans}, out / "pending.parquet")
    return plans, corpus_sha, todo


def old_dispatch(layout: RunLayout):
    """The old way, for comparison: the whole corpus in the driver, plans carrying tokens."""
    rows = layout.read_corpus()
    return [
        {
            "name": f"{k}",
            "input_ids": [r["input_ids"] for r in rows[k : k + SHARD_SAMPLES]],
            "loss_mask": [r["loss_mask"] for r in rows[k : k + SHARD_SAMPLES]],
        }
        for k in range(0, len(rows), SHARD_SAMPLES)
    ]


@pytest.mark.slow
def test_capture_dispatch_memory_does_not_grow_with_the_corpus(tiny_target, tmp_path):
    import pyarrow.parquet as pq

    sizes = (400, 4000)  # conversations: 51k and 512k tokens
    new, old, seconds = {}, {}, {}
    for n in sizes:
        layout = synthetic_corpus(tiny_target, tmp_path / f"n{n}", n)
        out = layout.stage_dir("capture")
        out.mkdir(parents=True)
        new[n], (plans, corpus_sha, todo) = peak_bytes(lambda: dispatch(layout, out))
        # Timed again without tracemalloc, which slows allocation-heavy code: the process's own
        # CPU time, the least of three, so that other work on the machine (CI shares its two
        # cores) neither stretches one size's figure nor shrinks the other's.
        seconds[n] = min(
            cpu_seconds(lambda k=k: dispatch(layout, fresh_dir(out.parent / f"timed{k}"))) for k in range(3)
        )
        old[n], _ = peak_bytes(lambda: old_dispatch(layout))
        # The plan is right: every sample once, split by split, and an actor reads it back.
        table = pq.read_table(todo)
        assert table.column_names == ["name", "sample_ids", "files", "rows", "n_tokens"]  # no tokens
        assert table.num_rows == len(plans) == n * 9 // 10 // SHARD_SAMPLES + -(-(n // 10) // SHARD_SAMPLES)
        assert sum(len(ids) for ids in table["sample_ids"].to_pylist()) == n
        assert [name for name, _ in plans] == table["name"].to_pylist()
        assert sum(t for _, t in plans) == n * SAMPLE_TOKENS
        ref = capture.ShardRef(**table.slice(len(plans) - 1, 1).to_pylist()[0])  # the last held-out shard
        loaded = CorpusFiles(str(layout.corpus_shards)).load(ref)
        by_id = {r["id"]: r for r in layout.read_corpus() if r["id"] in ref.sample_ids}
        assert loaded.input_ids == [by_id[i]["input_ids"] for i in ref.sample_ids]
        # The same corpus planned from memory (the list API) gives the same hash and names.
        same, _, same_sha = capture_plan.plan_shards(layout.read_corpus(), SHARD_SAMPLES)
        assert same_sha == corpus_sha and [p.name for p in same] == [name for name, _ in plans]
    small, large = sizes
    print(
        f"driver peak: new {new[small]} -> {new[large]} B, old {old[small]} -> {old[large]} B; "
        f"dispatch {seconds[small]:.3f} -> {seconds[large]:.3f} s"
    )
    # Per-token driver time does not grow with the corpus (a quadratic step, such as a
    # manifest rewritten per shard, would make this ratio ~10).
    assert (seconds[large] / large) / (seconds[small] / small) < 2.0
    # The old way holds the corpus: ~10x for 10x the tokens (the measurement sees it) ...
    assert old[large] / old[small] > 7
    # ... the new one holds one generate file plus a few names per shard: nearly flat, and
    # at the large size a small fraction of the old.
    assert new[large] / new[small] < 1.6
    assert new[large] < old[large] / 10
