"""The shard plan: the committed corpus grouped into fixed shards of one split each (the
capture stage's store shards, and the units the streaming train source computes).

`plan_shards` groups samples in corpus order (names carry their ids' hash, so a rerun plans
the same shards); `plan_corpus` streams the refs into `capture/plan.parquet` one generate
file at a time, so that the driver never holds per-sample data; `select_plans` cuts out the
shards still to do, as the Parquet file Ray Data reads.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable

from storage.store import sample_ids_hash
from workflows.core.errors import InputError
from workflows.core.layout import RunLayout
from workflows.core.shard_states import ShardRef

SPLITS = ("train", "heldout")  # the corpus's splits; capture shard names start with one


class CorpusSamples:
    """The committed generate shards as a re-iterable stream of samples, one file at a time:
    id, split, input_ids, loss mask length, and where the sample is (file index, row)."""

    def __init__(self, layout: RunLayout):
        layout.require_done("generate")
        self.layout = layout
        self.files = sorted(int(m.name.split(".")[0]) for m in layout.corpus_shards.glob("*.done.json"))

    def __iter__(self):
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        for f in self.files:
            t = pq.read_table(self.layout.corpus_shard_file(f), columns=["id", "split", "input_ids", "loss_mask"])
            ids, splits, tokens = t["id"].to_pylist(), t["split"].to_pylist(), t["input_ids"].to_pylist()
            mask_lengths = pc.list_value_length(t["loss_mask"]).to_pylist()
            for r in range(t.num_rows):
                yield {
                    "id": ids[r],
                    "split": splits[r],
                    "input_ids": tokens[r],
                    "loss_mask_len": mask_lengths[r],
                    "file": f,
                    "row": r,
                }


def plan_shards(samples, shard_samples: int, emit: Callable[[ShardRef], None] | None = None) -> tuple[list, dict, str]:
    """Fixed groups of `shard_samples` samples of one split, in corpus order; names carry
    their ids' hash. `samples` is iterated once per split (a list, or CorpusSamples: one
    file in memory at a time). Returns (plans, skipped counts, corpus hash); with `emit`,
    each ShardRef goes to it and `plans` keeps only (name, n_tokens), so the driver holds
    no per-sample data."""
    skipped = {"empty_sample": 0}
    plans: list = []
    h = hashlib.sha256()  # the corpus as captured: ids, lengths and tokens, in plan order
    # Train and held-out samples go to separate shards named by their split, so that the
    # trainer streams only its split's shards (and evaluates from the held-out ones).
    for split in SPLITS:
        group: list[dict] = []
        index = 0

        def flush():
            nonlocal index
            ids = [str(r["id"]) for r in group]
            ref = ShardRef(
                name=f"{split}-{index:06d}-{sample_ids_hash(ids)[:8]}",
                sample_ids=ids,
                files=[r["file"] for r in group],
                rows=[r["row"] for r in group],
                n_tokens=sum(r["n"] for r in group),
            )
            if emit is None:
                plans.append(ref)
            else:
                emit(ref)
                plans.append((ref.name, ref.n_tokens))
            index += 1
            group.clear()

        for k, r in enumerate(samples):
            n_mask = r["loss_mask_len"] if "loss_mask_len" in r else len(r["loss_mask"])
            if split == SPLITS[0]:  # checked and counted on the first pass only
                if len(r["input_ids"]) != n_mask:
                    raise InputError(
                        f"corpus row {k} (id {r['id']!r}): field input_ids has {len(r['input_ids'])} "
                        f"tokens but loss_mask {n_mask}"
                    )
                skipped["empty_sample"] += not r["input_ids"]
            if not r["input_ids"] or r.get("split", "train") != split:
                continue
            h.update(f"{r['id']}:{len(r['input_ids'])}:{hash(tuple(r['input_ids']))}\n".encode())
            group.append({"id": r["id"], "n": len(r["input_ids"]), "file": r.get("file", -1), "row": r.get("row", -1)})
            if len(group) == shard_samples:
                flush()
        if group:
            flush()
    return plans, skipped, h.hexdigest()[:16]


PLAN_SCHEMA = (
    ("name", "string"),
    ("sample_ids", "list<string>"),
    ("files", "list<int64>"),
    ("rows", "list<int64>"),
    ("n_tokens", "int64"),
)


def _plan_schema():
    import pyarrow as pa

    kinds = {
        "string": pa.string(),
        "int64": pa.int64(),
        "list<string>": pa.list_(pa.string()),
        "list<int64>": pa.list_(pa.int64()),
    }
    return pa.schema([(name, kinds[kind]) for name, kind in PLAN_SCHEMA])


class PlanFile:
    """Shard refs streamed into a Parquet file as they are planned, a few hundred at a time."""

    def __init__(self, path: Path, rows_per_group: int = 256):
        import pyarrow.parquet as pq

        self.path, self.rows_per_group, self.buffer = path, rows_per_group, []
        self.writer = pq.ParquetWriter(path, _plan_schema())

    def __call__(self, ref: ShardRef) -> None:
        self.buffer.append(vars(ref))
        if len(self.buffer) >= self.rows_per_group:
            self.flush()

    def flush(self) -> None:
        import pyarrow as pa

        if self.buffer:
            self.writer.write_table(pa.Table.from_pylist(self.buffer, schema=_plan_schema()))
            self.buffer = []

    def close(self) -> None:
        self.flush()
        self.writer.close()


def plan_corpus(layout: RunLayout, shard_samples: int, out: Path) -> tuple[list[tuple[str, int]], dict, str, Path]:
    """Plan the committed corpus one generate shard at a time: the refs go to
    `<out>/plan.parquet`; the driver keeps (name, n_tokens) per shard and the corpus hash."""
    path = out / "plan.parquet"
    sink = PlanFile(path)
    try:
        plans, skipped, corpus_sha = plan_shards(CorpusSamples(layout), shard_samples, emit=sink)
    finally:
        sink.close()
    return plans, skipped, corpus_sha, path


def select_plans(plan_file: Path, names: set[str], dest: Path) -> Path:
    """The refs of `names` only (the shards still to do), as the Parquet file Ray Data reads."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    table = pq.read_table(plan_file)
    pq.write_table(table.filter(pc.is_in(table["name"], value_set=pa.array(sorted(names), pa.string()))), dest)
    return dest
