"""The spot check's figure for an honest engine and for a wrong layer, to size its tolerance.

    python -m bench.bench_spot_check --target PATH --layer-ids 1 3 4 6 [--backend sglang] [--dtype bfloat16]
        [--samples 12] [--length 96]

Captures random token sequences with `--backend` and with HF in the same dtype, and prints
the spot check's figures (workflows.capture.spot_check.compare: per token, max |diff| over
the layer's values / max |reference|) over every layer and sample: the average over tokens
(what the tolerance bounds) and the worst token, against `tolerance()` for a bf16 store of
that engine dtype; and, beside it, the same figures of each layer against its neighbour
(another layer's states: what the check must refuse).
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    import torch

    from workflows.capture.spot_check import compare, tolerance
    from workflows.core.engine_spec import EngineSpec
    from workflows.core.engines import make_engine

    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True, help="prepared HF checkpoint folder")
    ap.add_argument("--layer-ids", type=int, nargs="+", required=True)
    ap.add_argument("--backend", default="sglang", choices=("hf", "sglang"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--samples", type=int, default=12)
    ap.add_argument("--length", type=int, default=96)
    a = ap.parse_args()
    spec = EngineSpec(a.target, dtype=a.dtype, capture_ids=a.layer_ids)
    gen = torch.Generator().manual_seed(0)
    hf = make_engine("hf", spec)
    vocab = len(hf.tokenizer)
    seqs = [torch.randint(3, vocab, (a.length,), generator=gen).tolist() for _ in range(a.samples)]
    engine = make_engine(a.backend, spec)
    got, want = engine.states(seqs), hf.states(seqs)
    reported = getattr(engine, "captured_layer_ids", None)
    engine.close()
    honest, neighbour = [], []
    for (ga, gf), (ha, hf_) in zip(got, want):
        h = hf_.shape[-1]
        blocks = [(ga[:, j * h : (j + 1) * h], ha[:, j * h : (j + 1) * h]) for j in range(len(a.layer_ids))]
        honest += [compare(g, r, "") for g, r in [*blocks, (gf, hf_)]]
        neighbour += [compare(blocks[j][1], blocks[j - 1][1], "") for j in range(1, len(blocks))]

    def figures(rows):
        return {"average_max": max(r["rel_diff"] for r in rows), "worst_token": max(r["token_rel_diff"] for r in rows)}

    print(
        json.dumps(
            {
                "backend": a.backend,
                "dtype": a.dtype,
                "engine_captured_layer_ids": reported,
                "honest": figures(honest),
                "neighbouring_layers_average_min": min(r["rel_diff"] for r in neighbour),
                "tolerance_bf16_store": tolerance("bfloat16", a.dtype),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
