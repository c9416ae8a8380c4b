"""What a capture will cost before it runs: store bytes, free space, and a projection of
shards, driver memory and wall time (`capture.estimate_only`, and the check before a run)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

from eagle3.schema import ConfigError
from eagle3.target_spec import TargetSpec
from storage.states import STATE_DTYPES, state_bytes_per_token
from storage.zarr_io import is_remote
from workflows.core.config import CaptureSection, DataSection
from workflows.core.layout import RunLayout
from workflows.core.shard_plan import SPLITS, CorpusSamples


def bytes_per_token(n_aux: int, hidden_size: int, state_dtype: str = "bfloat16") -> int:
    """aux + final states (bf16; or int8 plus one float32 scale per row slice) + input id
    (int32) + loss mask (uint8)."""
    return state_bytes_per_token(n_aux, hidden_size, state_dtype) + 4 + 1


def estimate(target: TargetSpec, capture: CaptureSection, tokens: int, capture_ids: list[int]) -> dict:
    """Store bytes for `tokens` corpus tokens of `target`'s states at `capture_ids` (the
    store's: FullConfig.store_capture_ids), in the capture's scheme and beside every other."""
    n_aux, h, scheme = len(capture_ids), target.hidden_size, capture.state_dtype
    per_token = bytes_per_token(n_aux, h, scheme)
    # Every scheme's figures beside the configured one's, to choose between them.
    by_scheme = {
        s: {"bytes_per_token": (b := bytes_per_token(n_aux, h, s)), "projected": human_bytes(b * tokens)}
        for s in STATE_DTYPES
    }
    return {
        "target": target.name,
        "num_layers": target.num_layers,
        "hidden_size": h,
        "capture_layer_ids": list(capture_ids),
        "states_per_token": f"{n_aux} aux + final",
        "state_dtype": scheme,
        "bytes_per_token": per_token,
        "tokens": tokens,
        "projected_bytes": per_token * tokens,
        "projected": f"{human_bytes(per_token * tokens)} ({per_token * tokens / 2**40:.3g} TiB)",
        "by_state_dtype": by_scheme,
    }


def longest_sample(bytes_per_token: int, data: DataSection, capture: CaptureSection, max_seq_len: int) -> dict:
    """What one sample of data.max_length tokens costs: its bytes in the store (and in flight
    when streaming), the forward that captures it (a sample past capture.micro_batch_tokens
    goes alone, whole: the engine must hold its activations), and what training reads of it
    (train.max_seq_len; longer is truncated and counted)."""
    n = data.max_length
    return {
        "tokens": n,
        "store_bytes": bytes_per_token * n,
        "store": human_bytes(bytes_per_token * n),
        "capture_forward_tokens": max(n, capture.micro_batch_tokens),
        "alone_in_its_capture_forward": n > capture.micro_batch_tokens,
        "trained_tokens": min(n, max_seq_len),
    }


def human_bytes(n: float) -> str:
    """Bytes in the decimal unit that shows them with three significant digits (400 KB, 1.27 TB)."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"


def check_space(dest: str, needed: int, ignore: bool) -> dict:
    """Refuse to start when the destination's filesystem has less free space than needed."""
    if is_remote(dest):
        return {"free_bytes": None, "note": "object store: free space not checked"}
    probe = Path(dest).resolve()
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if needed > free and not ignore:
        raise ConfigError(
            f"capture.store={dest}: the capture needs ~{human_bytes(needed)} but {probe} has {human_bytes(free)} "
            "free; free space, choose another capture.store, or set capture.ignore_space=true"
        )
    return {"free_bytes": free, "needed_bytes": needed, "enough": needed <= free}


MANIFEST_ROW_BYTES = 300  # one committed shard's row (its commit-log JSON; manifest.parquet is smaller)
DRIVER_BYTES_PER_SHARD = 250  # what the capture driver keeps per shard: (name, n_tokens), a Results entry
PY_BYTES_PER_TOKEN = 36  # a token as a Python int in a list (the driver reads one generate file at a time)


def corpus_figures(layout: RunLayout) -> dict | None:
    """Samples, tokens and answer tokens of the finished generate stage here; None without one."""
    if layout.done_key("generate") is None:
        return None
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    samples = tokens = answers = 0
    for f in CorpusSamples(layout).files:
        t = pq.read_table(layout.corpus_shard_file(f), columns=["input_ids", "answer_tokens"])
        samples += t.num_rows
        tokens += int(pc.sum(pc.list_value_length(t["input_ids"])).as_py() or 0)
        answers += int(pc.sum(t["answer_tokens"]).as_py() or 0)
    return {"samples": samples, "tokens": tokens, "answer_tokens": answers}


def measured_capture_tokens_per_s(layout: RunLayout) -> float | None:
    """Mean tokens/s of one actor in this run folder's last capture (capture/summary.json)."""
    path = layout.capture_summary_file
    if not path.exists():
        return None
    rates = [a["tokens_per_s"] for a in json.loads(path.read_text()).get("per_actor", {}).values()]
    return sum(rates) / len(rates) if rates else None


def projection(
    capture: CaptureSection, data: DataSection, tokens: int, corpus: dict | None, measured_tps: float | None
) -> dict:
    """Projected wall time of generate and capture, shard count, manifest size and driver
    memory for `tokens` corpus tokens; each figure names what it rests on."""
    c, d = capture, data
    per_sample = corpus["tokens"] / corpus["samples"] if corpus and corpus["samples"] else d.max_length
    answer_fraction = corpus["answer_tokens"] / corpus["tokens"] if corpus and corpus["tokens"] else 1.0
    shards = math.ceil(tokens / per_sample / c.shard_samples) + len(SPLITS) - 1  # a partial shard per split
    capture_tps = c.estimate_capture_tokens_per_s or measured_tps
    generate_tps = c.estimate_generate_tokens_per_s

    def hours(work: float, rate: float | None, engines: int):
        return None if rate is None else round(work / (rate * engines) / 3600, 2)

    return {
        "tokens_per_sample": round(per_sample, 1),
        "tokens_per_sample_from": "corpus" if corpus else "data.max_length (no corpus: an upper bound)",
        "shards": shards,
        "manifest_bytes": shards * MANIFEST_ROW_BYTES,
        "driver_bytes": shards * DRIVER_BYTES_PER_SHARD + int(d.shard_size * per_sample * PY_BYTES_PER_TOKEN),
        "capture_tokens_per_s_per_actor": capture_tps,
        "capture_tokens_per_s_from": "config"
        if c.estimate_capture_tokens_per_s
        else ("capture/summary.json" if measured_tps else "unknown: set capture.estimate_capture_tokens_per_s"),
        "capture_hours": hours(tokens, capture_tps, c.actors),
        "generate_answer_tokens": int(tokens * answer_fraction),
        "answer_fraction_from": "corpus" if corpus else "none (every token counted as generated: an upper bound)",
        "generate_tokens_per_s_per_engine": generate_tps,
        "generate_hours": hours(tokens * answer_fraction, generate_tps, d.num_engines),
    }
