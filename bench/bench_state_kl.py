"""How far an 8-bit store moves the soft labels: the target's next-token distribution
recomputed from each store's final state, on the held-out samples of both.

    python -m bench.bench_state_kl --a <overrides of the bf16 run> --b <overrides of the int8 run>

Both runs must have captured the same corpus (e.g. one `shared_dir`, stores differing in
`capture.state_dtype` only). For each held-out sample present in both stores, over every
position: KL(p_a || p_b) of the full-vocabulary distributions (nats, mean per token, and its
99th percentile), how often the argmax agrees, and the total-variation distance sum |p_a -
p_b| / 2, which bounds how much the acceptance rate sum_v min(p, q) of any draft q can move.
"""

from __future__ import annotations

import argparse
import json

import torch


def distributions(overrides: list[str]):
    from workflows.core.config import compose
    from workflows.core.layout import RunLayout
    from workflows.core.target_weights import read_target_head
    from workflows.core.targets import prepare_for

    cfg = compose(overrides)
    layout = RunLayout.of(cfg)
    layout.require_done("capture")
    reader = layout.open_store()
    head = read_target_head(prepare_for(cfg, log=lambda *_: None), bool(reader.provenance.get("final_is_normed", True)))
    held = set(reader.shard_names("heldout"))
    ids = sorted(i for i, (shard, _) in reader.index.items() if shard in held)
    return reader, head, ids, cfg.capture.state_dtype


def log_probs(head, final: torch.Tensor) -> torch.Tensor:
    x = final.float()
    if head.final_norm is not None:
        x = head.final_norm(x)
    return torch.log_softmax(x @ head.weight.float().T, dim=-1)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", nargs="*", required=True, help="Hydra overrides of the reference run (bf16 store)")
    ap.add_argument("--b", nargs="*", required=True, help="Hydra overrides of the compared run (8-bit store)")
    args = ap.parse_args(argv)
    ra, head, ids_a, dtype_a = distributions(args.a)
    rb, _, ids_b, dtype_b = distributions(args.b)
    common = sorted(set(ids_a) & set(ids_b))
    if not common:
        raise SystemExit("the two stores share no held-out sample: capture the same corpus (one shared_dir)")
    kls, agree, tvs = [], 0, []
    with torch.no_grad():
        for i in common:
            sa, sb = ra.sample(i), rb.sample(i)
            if not torch.equal(torch.as_tensor(sa["input_ids"]), torch.as_tensor(sb["input_ids"])):
                raise SystemExit(f"sample {i}: the stores hold different tokens; they must capture one corpus")
            la, lb = log_probs(head, torch.as_tensor(sa["final"])), log_probs(head, torch.as_tensor(sb["final"]))
            kls.append((la.exp() * (la - lb)).sum(-1))
            tvs.append((la.exp() - lb.exp()).abs().sum(-1) / 2)
            agree += int((la.argmax(-1) == lb.argmax(-1)).sum())
    kl, tv = torch.cat(kls), torch.cat(tvs)
    out = {
        "a": dtype_a,
        "b": dtype_b,
        "samples": len(common),
        "tokens": kl.numel(),
        "kl_mean_nats": float(kl.mean()),
        "kl_p99_nats": float(kl.quantile(0.99)),
        "total_variation_mean": float(tv.mean()),
        "argmax_agreement": agree / kl.numel(),
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
