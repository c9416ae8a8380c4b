"""Capture throughput vs the same engine's bare forward on the same batches, in one run.

    python -m bench.bench_capture [--backend hf|sglang] [--final-state auto|runner|tail] [--target PATH]
        [--samples 64] [--length 256] [--device cpu|cuda] [--state-dtype bfloat16 [int8]]

HF: the bare forward is the target's plain `model(...)` over the capture engine's own
micro-batches. SGLang: the same sequences as a plain prefill through the capture worker's
own engine (no state returned), against the capture (states returned and written to the
store); `--final-state` picks how the capture worker gets them (`runner`, the default:
SGLang's model runner, for both the bare prefill and the capture; `tail`: SGLang's Engine).
The capture adds the state capture, the bf16 conversion and the Zarr writes, which
`capture_and_write` overlaps with the next shard's compute. Prints both
tokens/s and the ratio capture/bare (aim >= 0.90), and where the fastest capture's time
went, each over the bare forward: `compute_over_bare` (the forward with the states'
extraction and copy off the device) and `write_over_bare` (the store's writes, on the writer
thread). Default target: the `tiny` preset
(prepared into .cache on first use); pass --target for a bigger checkpoint.

`--state-dtype bfloat16 int8` captures the same shards once per scheme (`capture.state_dtype`:
int8 quantised where the engine left the states, storage.states), interleaved with the bare
forward and each scheme first in turn, and adds each scheme's tokens/s and
`int8_over_bfloat16` (issue 28's aim: >= 0.95).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path
from typing import Sequence

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=None, help="prepared HF checkpoint folder (default: the tiny preset)")
    ap.add_argument("--layer-ids", type=int, nargs="+", default=None)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--shard-samples", type=int, default=16)
    ap.add_argument("--micro-batch-tokens", type=int, default=4096)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--backend", choices=["hf", "sglang"], default="hf")
    ap.add_argument("--final-state", choices=["auto", "runner", "tail"], default="auto", help="sglang only")
    ap.add_argument("--device", default="cpu", help="cuda: the HF model on the GPU, SGLang's GPU settings")
    ap.add_argument("--state-dtype", nargs="+", default=["bfloat16"], choices=["bfloat16", "int8"])
    args = ap.parse_args()
    target = Path(args.target) if args.target else tiny_target()
    print(
        measure(
            target,
            samples=args.samples,
            length=args.length,
            device=args.device,
            dtype=args.dtype,
            repeats=args.repeats,
            layer_ids=args.layer_ids,
            micro_batch_tokens=args.micro_batch_tokens,
            shard_samples=args.shard_samples,
            backend=args.backend,
            final_state=args.final_state,
            state_dtypes=args.state_dtype,
        )
    )


def measure(
    target: Path,
    samples: int,
    length: int,
    device: str,
    dtype: str,
    repeats: int = 2,
    layer_ids: list[int] | None = None,
    micro_batch_tokens: int = 4096,
    shard_samples: int = 16,
    backend: str = "hf",
    final_state: str = "auto",
    state_dtypes: Sequence[str] = ("bfloat16",),
) -> dict:
    """Capture into a store (once per scheme in `state_dtypes`) and the bare forward,
    interleaved `repeats` times: the best of each."""
    from storage.store import HiddenStateStore
    from workflows.capture.writer import ShardPlan, capture_and_write
    from workflows.core.engine_spec import EngineSpec
    from workflows.core.engines import make_engine
    from workflows.core.provenance import read_hf_config

    _, text = read_hf_config(target)
    n_layers, hidden = text["num_hidden_layers"], text["hidden_size"]
    ids = layer_ids or ([1, n_layers // 2 - 1, n_layers - 4] if n_layers >= 8 else [0, 2, 4])
    engine = make_engine(
        backend,
        EngineSpec(
            str(target),
            dtype=dtype,
            capture_ids=ids,
            micro_batch_tokens=micro_batch_tokens,
            final_state=final_state,
            device=device,
            max_total_tokens=None if device == "cuda" else 4096,
        ),
    )
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, text["vocab_size"], (length - (i % 7) * 3,), generator=g).tolist() for i in range(samples)]
    plans = [
        ShardPlan(
            f"{k:06d}",
            [f"s{i}" for i in range(k, min(k + shard_samples, len(seqs)))],
            seqs[k : k + shard_samples],
            [[1] * len(s) for s in seqs[k : k + shard_samples]],
        )
        for k in range(0, len(seqs), shard_samples)
    ]
    tokens = sum(len(s) for s in seqs)
    engine.bare_forward(seqs[:shard_samples])  # warm-up (and SGLang's engine start)
    bare_s, cap_s = [], {s: [] for s in state_dtypes}
    parts = []  # (wall, states computed and copied off the device, written) of each first-scheme run
    tmp = Path(tempfile.mkdtemp(prefix="bench_capture_"))
    try:
        for r in range(repeats):  # interleaved, so machine noise hits all alike
            t = time.perf_counter()
            for p in plans:
                engine.bare_forward(p.input_ids)
            if device == "cuda":  # the bare forward queues kernels; the capture's copies wait for them
                torch.cuda.synchronize()
            bare_s.append(time.perf_counter() - t)
            for scheme in state_dtypes[r % len(state_dtypes) :] + state_dtypes[: r % len(state_dtypes)]:
                prov = {
                    "hidden_size": hidden,
                    "capture_layer_ids": ids,
                    "final_is_normed": True,
                    "target": {},
                    "state_dtype": scheme,
                }
                store = HiddenStateStore.create_or_open(str(tmp / f"store{r}-{scheme}"), prov)
                t = time.perf_counter()
                rows = capture_and_write(engine, store, plans, chunk_bytes=1 << 20, state_dtype=scheme)
                store.commit(rows)
                cap_s[scheme].append(time.perf_counter() - t)
                if scheme == state_dtypes[0]:
                    parts.append(
                        (
                            cap_s[scheme][-1],
                            sum(r["compute_seconds"] for r in rows),
                            sum(r["write_seconds"] for r in rows),
                        )
                    )
                shutil.rmtree(tmp / f"store{r}-{scheme}", ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    bare, cap = tokens / min(bare_s), tokens / min(cap_s[state_dtypes[0]])
    engine.close()
    by_scheme = {f"capture_{s}_tok_per_s": round(tokens / min(cap_s[s])) for s in state_dtypes}
    if {"bfloat16", "int8"} <= set(state_dtypes):
        by_scheme["int8_over_bfloat16"] = round(min(cap_s["bfloat16"]) / min(cap_s["int8"]), 3)
    return {
        "backend": backend,
        "final_state": getattr(engine, "final_method", None),
        "target": str(target),
        "layers": n_layers,
        "hidden": hidden,
        "tokens": tokens,
        "device": device,
        "bare_forward_tok_per_s": round(bare),
        "capture_tok_per_s": round(cap),
        "ratio": round(cap / bare, 3),
        # Of the fastest capture: the forward with the states' extraction and copy off the
        # device, and the store's writes (on a writer thread, overlapping the next shard's
        # compute), each against the bare forward: which of the two makes capture slow.
        "compute_over_bare": round(min(parts)[1] / min(bare_s), 3),
        "write_over_bare": round(min(parts)[2] / min(bare_s), 3),
        **(by_scheme if len(state_dtypes) > 1 else {}),
        "threads": torch.get_num_threads(),
    }


def tiny_target() -> Path:
    import yaml

    from eagle3.schema import from_dict
    from eagle3.target_spec import TargetSpec
    from workflows.core.targets import prepare_target

    root = Path(__file__).resolve().parents[1]
    spec = from_dict(TargetSpec, yaml.safe_load((root / "conf/target/tiny.yaml").read_text()), "target")
    return prepare_target(spec, root / ".cache" / "targets")


if __name__ == "__main__":
    main()
