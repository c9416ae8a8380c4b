"""`verify`: check every committed shard and report problems by shard and sample.

States are checked as stored: bf16 bits for NaN/Inf; an int8 store's scales for NaN/Inf
(a non-finite state makes its slice's scale non-finite) and sign, its values for -128
(outside the symmetric range the quantiser writes).

python -m storage.verify <store url>        exit status 1 when a problem is found
"""

from __future__ import annotations

import json
import sys

import numpy as np

from storage.states import STATE_ARRAYS, nonfinite_rows, state_shapes
from storage.store import HiddenStateStore, sample_ids_hash, state_dtype_of


def verify(url: str, storage_options: dict | None = None) -> dict:
    store = HiddenStateStore.open(url, storage_options)
    prov = store.provenance
    scheme = state_dtype_of(prov, f"store {store.url}")
    h, n_aux = prov["hidden_size"], len(prov["capture_layer_ids"])
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
            arrays = {k: g[k][...] for k in ("input_ids", "loss_mask", "offsets", *STATE_ARRAYS[scheme])}
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
        for key, shape in (("loss_mask", (t,)), *state_shapes(scheme, t, n_aux, h).items()):
            if arrays[key].shape != shape:
                bad(name, f"{key} shape {arrays[key].shape} != {shape}")
        for key, dtype in STATE_ARRAYS[scheme].items():
            if arrays[key].dtype != dtype:
                bad(name, f"{key} is {arrays[key].dtype}, not {np.dtype(dtype)} (state_dtype {scheme})")
        if any(p["shard"] == name for p in problems):
            continue

        def sample_of(rows, ids=ids, off=off):
            return sorted({ids[int(i)] for i in np.searchsorted(off, rows, side="right") - 1})

        for key in STATE_ARRAYS[scheme]:  # bf16 states; int8's scales (its values are finite)
            for sid in sample_of(nonfinite_rows(arrays[key])):
                bad(name, f"NaN/Inf in {key}", sid)
        if scheme == "int8":
            for key in ("aux_scale", "final_scale"):
                for sid in sample_of(np.flatnonzero((arrays[key] < 0).any(axis=1))):
                    bad(name, f"negative scale in {key}", sid)
            for key in ("aux", "final"):
                for sid in sample_of(np.flatnonzero((arrays[key] == -128).any(axis=1))):
                    bad(name, f"int8 value -128 in {key} (the quantiser writes -127..127)", sid)
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
