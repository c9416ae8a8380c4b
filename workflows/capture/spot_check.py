"""The capture's spot check: a few stored samples recomputed by a second implementation.

After the store is written and verified, the driver loads the target with HF transformers
on its CPU (workflows.core.engines.HFEngine, in the capture's dtype), recomputes the states
of `capture.spot_check_samples` samples (spread over the committed shards) and compares them
with what the store holds: every captured layer (the union of the drafters' layers,
capture.families) and the final state. A difference past the tolerance ends the stage with
one line naming the shard, the sample, the layer and the figures; the capture is not marked
done. Silent wrongness (a wrong layer captured, a layer-id rule misread, states packed in the
wrong slots, a writer or codec bug) then cannot reach training unseen.

The figure: per token, max |stored - reference| over the layer's H values divided by
max |reference| over the same values (the token's own scale: an int8 store quantises exactly
that slice, and bf16 rounds each element relative to itself), averaged over the sample's
tokens (`rel_diff`; the worst token's figures are reported beside it). The average, not the
worst token: in bf16 a MoE target's routing flips on a few tokens, while a wrong layer is
wrong on every token. The tolerance comes from the dtypes: the store's rounding (bf16: 2**-8;
int8: half a step, 1/254, plus the bf16 read-back, 2**-8) plus the engines' arithmetic
(float32: 1e-3, kernel order; bf16/fp16: 2**-5, two bf16 stacks' rounding over the layers).
bench/bench_spot_check.py (SGLang bf16 against HF bf16): tiny_kimi averages <= 0.015 (worst
token 0.30) where its neighbouring ids 3 and 4 differ by 0.059, the tiny Llama <= 0.013
against >= 0.27; a layer scaled by 1.5 shows 0.5. In a deep bf16 target neighbouring layers
can be closer still: the layers each engine reports capturing (`engine_captured_layer_ids`,
workflows.capture.stage) guard the ids there.

The guard: the check loads the whole target in the driver. It runs only when that fits:
parameters (from the checkpoint's safetensors headers) x the dtype's bytes x 1.25, plus
1 GiB of working memory, within the memory this machine has available; otherwise it is
skipped with one log line and the reason in the capture summary (a 1T-parameter Kimi-K2.5
needs ~2.6 TB); so is a target that transformers cannot load (its reason recorded the same
way). With capture.backend=hf the reference is the same code in a fresh process:
it still checks the actors' packing, the writer, the codec and the reader, not HF's hooks.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

from workflows.core.errors import StageFailure

STORE_TOLERANCE = {"bfloat16": 2.0**-8, "int8": 1 / 254 + 2.0**-8}
ENGINE_TOLERANCE = {"float32": 1e-3, "bfloat16": 2.0**-5, "float16": 2.0**-5}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
LOAD_OVERHEAD = 1.25  # the load's transient copies and the allocator's slack
WORKING_BYTES = 1 << 30  # activations of a few samples, the tokenizer, Python


def tolerance(state_dtype: str, engine_dtype: str) -> float:
    """The largest per-token relative difference an honest capture can show."""
    return STORE_TOLERANCE[state_dtype] + ENGINE_TOLERANCE.get(engine_dtype, ENGINE_TOLERANCE["bfloat16"])


def checkpoint_parameters(folder: str | Path) -> int:
    """Parameters of a local safetensors checkpoint, from its files' headers (no tensor read)."""
    total = 0
    for f in sorted(Path(folder).glob("*.safetensors")):
        with open(f, "rb") as handle:
            (size,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(size))
        for name, entry in header.items():
            if name != "__metadata__":
                n = 1
                for d in entry["shape"]:
                    n *= int(d)
                total += n
    return total


def reference_bytes(parameters: int, dtype: str) -> int:
    """Driver memory an HF reference of this size and dtype needs."""
    return int(parameters * DTYPE_BYTES.get(dtype, 4) * LOAD_OVERHEAD) + WORKING_BYTES


def available_memory() -> int:
    """Bytes this machine can still give a process (MemAvailable; else free pages)."""
    import os

    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def skip_reason(parameters: int, dtype: str, available: int) -> str | None:
    """Why the spot check cannot run in this driver (None: it fits)."""
    from workflows.capture.sizing import human_bytes

    needed = reference_bytes(parameters, dtype)
    if needed <= available:
        return None
    return (
        f"an HF reference of the target ({parameters / 1e9:,.4g}B parameters in {dtype}) needs ~"
        f"{human_bytes(needed)} in the driver, which has {human_bytes(available)} available"
    )


def pick(reader, n: int) -> list[tuple[str, int]]:
    """(shard, position) of `n` samples spread over the committed shards: the first sample of
    evenly spaced shards; past one per shard, the next positions of every shard in turn."""
    shards = reader.shards
    if n <= len(shards):
        return [(shards[(j * len(shards)) // n]["shard"], 0) for j in range(n)]
    chosen: list[tuple[str, int]] = []
    for k in range(max(int(r["n_samples"]) for r in shards)):
        chosen += [(r["shard"], k) for r in shards if k < int(r["n_samples"])]
    return chosen[:n]


def compare(stored, reference, layer: str) -> dict:
    """One layer's [T, H] states against the reference: the per-token relative difference
    averaged over the tokens (`rel_diff`, what the tolerance bounds) and the worst token's."""
    import torch

    s, r = stored.float(), reference.float()
    diff, scale = (s - r).abs().amax(dim=1), r.abs().amax(dim=1)
    rel = diff / scale.clamp_min(1e-30)
    rel = torch.where(scale == 0, diff.clamp_max(1.0) * (diff > 0), rel)  # an all-zero reference row
    t = int(rel.nan_to_num(float("inf")).argmax())
    return {
        "layer": layer,
        "rel_diff": float(rel.mean()),
        "token": t,
        "token_rel_diff": float(rel[t]),
        "max_abs_diff": float(diff[t]),
        "scale": float(scale[t]),
    }


def spot_check(reader, target_path, engine_spec: dict, samples: int, state_dtype: str) -> dict:
    """Recompute `samples` stored samples with HF in this process and compare every layer.
    Returns the record for the capture summary; raises StageFailure on a difference past the
    tolerance, naming shard, sample, layer and figures."""
    from workflows.core.engine_spec import EngineSpec
    from workflows.core.engines import HFEngine
    from workflows.core.log import log

    started = time.perf_counter()
    ids = list(reader.provenance["capture_layer_ids"])
    dtype = engine_spec["dtype"]
    tol = tolerance(state_dtype, dtype)
    where = pick(reader, samples)
    spec = {**engine_spec, "device": "cpu", "capture_ids": ids, "tp_size": 1}
    try:
        ref_engine = HFEngine(EngineSpec(**{k: v for k, v in spec.items() if k in EngineSpec.__dataclass_fields__}))
    except Exception as exc:  # no second implementation here (e.g. a quantisation transformers cannot load)
        reason = f"HF transformers cannot load the target as a reference ({type(exc).__name__}: {exc})"
        log(f"capture: spot check skipped: {reason}")
        return {"ran": False, "reason": reason}
    loaded = time.perf_counter()
    worst, figures = None, []
    for shard, k in where:
        got = reader.sample_at(shard, k)
        ((aux, final),) = ref_engine.states([got["input_ids"].tolist()])
        h = final.shape[-1]
        layers = [
            (f"id {i}", got["aux"][:, j * h : (j + 1) * h], aux[:, j * h : (j + 1) * h]) for j, i in enumerate(ids)
        ]
        for name, stored, ref in [*layers, ("final", got["final"], final)]:
            f = {"shard": shard, "sample": got["id"], **compare(stored, ref, name)}
            figures.append(f)
            if worst is None or not f["rel_diff"] <= worst["rel_diff"]:
                worst = f
    seconds = round(time.perf_counter() - started, 2)
    record = {
        "ran": True,
        "samples": len(where),
        "layers": [f"id {i}" for i in ids] + ["final"],
        "reference": f"HF transformers on the driver's CPU, {dtype}",
        "tolerance": tol,
        "rel_diff": worst["rel_diff"] if worst else 0.0,  # the worst layer's, of the worst sample
        "max_token_rel_diff": max((f["token_rel_diff"] for f in figures), default=0.0),  # reported only
        "worst": worst,
        "seconds": seconds,  # of which loading the HF reference:
        "load_seconds": round(loaded - started, 2),
    }
    bad = [f for f in figures if not f["rel_diff"] <= tol]  # NaN fails too
    if bad:
        b = bad[0]
        raise StageFailure(
            f"capture spot check: shard {b['shard']}, sample {b['sample']!r}, layer {b['layer']}: the store "
            f"differs from an HF recomputation by {b['rel_diff']:.3g} of the tokens' scale on average (worst "
            f"token {b['token']}: {b['token_rel_diff']:.3g}, |diff| {b['max_abs_diff']:.4g}, scale {b['scale']:.4g}); "
            f"tolerance {tol:.3g} for {state_dtype} states of a {dtype} engine; {len(bad)} of {len(figures)} layer "
            "checks differ; the capture is not marked done: the store holds other states than HF computes; find "
            "the cause, move capture.store away and recapture"
        )
    log(
        f"capture: spot check of {len(where)} sample(s) x {len(record['layers'])} layers against HF: relative "
        f"difference {record['rel_diff']:.3g} (tolerance {tol:.3g}), {seconds} s "
        f"({record['load_seconds']} s loading HF)"
    )
    return record
