"""`verify`: check every committed shard and report problems by shard and sample.

python -m storage.verify <store url>        exit status 1 when a problem is found
"""

from __future__ import annotations

import json
import sys

import numpy as np

from storage.store import HiddenStateStore, sample_ids_hash
from storage.zarr_io import nonfinite_rows


def verify(url: str, storage_options: dict | None = None) -> dict:
    store = HiddenStateStore.open(url, storage_options)
    prov = store.provenance
    h = prov["hidden_size"]
    aux_w = len(prov["capture_layer_ids"]) * h
    vocab = (prov.get("target") or {}).get("vocab_size")
    problems: list[dict] = []
    seen: dict[str, str] = {}
    tokens = samples = 0

    def bad(shard, problem, sample=None):
        problems.append({"shard": shard, "sample": sample, "problem": problem})

    for row in store.manifest():
        name = row["shard"]
        try:
            g = store.open_shard(name)
            attrs = dict(g.attrs)
            arrays = {k: g[k][...] for k in ("input_ids", "loss_mask", "offsets", "aux", "final")}
        except Exception as exc:  # missing/corrupt chunk, metadata, codec error
            bad(name, f"unreadable: {type(exc).__name__}: {exc}")
            continue
        if not attrs.get("complete"):
            bad(name, "committed but its writer never marked it complete")
        ids = list(attrs.get("sample_ids", []))
        if attrs.get("final_is_normed") != prov.get("final_is_normed"):
            bad(name, f"final_is_normed={attrs.get('final_is_normed')} differs from the store's")
        if sample_ids_hash(ids) != row["sample_ids_sha256"]:
            bad(name, "sample ids differ from the manifest's hash")
        t = len(arrays["input_ids"])
        off = arrays["offsets"]
        if t != row["n_tokens"]:
            bad(name, f"{t} tokens but the manifest says {row['n_tokens']}")
        if off.shape != (len(ids) + 1,) or off[0] != 0 or off[-1] != t or np.any(np.diff(off) <= 0):
            bad(name, f"offsets {off.tolist()[:8]}... do not split {t} tokens into {len(ids)} non-empty samples")
            continue
        for key, shape in (("loss_mask", (t,)), ("aux", (t, aux_w)), ("final", (t, h))):
            if arrays[key].shape != shape:
                bad(name, f"{key} shape {arrays[key].shape} != {shape}")
        if any(p["shard"] == name for p in problems):
            continue

        def sample_of(rows, ids=ids, off=off):
            return sorted({ids[int(i)] for i in np.searchsorted(off, rows, side="right") - 1})

        for key in ("aux", "final"):
            for sid in sample_of(nonfinite_rows(arrays[key])):
                bad(name, f"NaN/Inf in {key}", sid)
        if np.any(arrays["loss_mask"] > 1):
            for sid in sample_of(np.flatnonzero(arrays["loss_mask"] > 1)):
                bad(name, "loss_mask value other than 0/1", sid)
        if vocab and (np.any(arrays["input_ids"] < 0) or np.any(arrays["input_ids"] >= vocab)):
            for sid in sample_of(np.flatnonzero((arrays["input_ids"] < 0) | (arrays["input_ids"] >= vocab))):
                bad(name, f"token id outside 0..{vocab - 1}", sid)
        for sid in ids:
            if sid in seen:
                bad(name, f"duplicate sample (also in shard {seen[sid]})", sid)
            seen[sid] = name
        tokens += t
        samples += len(ids)
    return {
        "ok": not problems,
        "shards": len(store.manifest()),
        "samples": samples,
        "tokens": tokens,
        "problems": problems,
    }


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m storage.verify <store path or URL>", file=sys.stderr)
        return 2
    report = verify(argv[0])
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
