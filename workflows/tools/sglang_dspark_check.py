"""Read a DSpark export in SGLang's layout (<run>/export/sglang) with SGLang's own DSPARK
code, on CPU, and say what SGLang makes of it.

    PYTHONPATH=.:workflows/sglang_cpu_shim \\
        python -m workflows.tools.sglang_dspark_check <export> [more ...]

SGLang 0.5.23 serves DSPARK on CUDA, NPU or XPU only, so this is what a CPU can check of
it. SGLang's loader skips names it does not know without a word, and its heads read our
tensors by its own rules, so this runs SGLang's functions on our files and reports:
- config: speculative/dspark_components/dspark_config.parse_dspark_draft_config (the ids,
  the mask, the Markov head, and gamma: the tokens one block drafts);
- weights: models/dspark.Qwen3DSparkModel built from config.json with its confidence head
  (adaptive verification: SGLANG_RAGGED_VERIFY_MODE=compact unless set), load_weights run
  on our tensors, every parameter compared (q/k/v and gate/up fused by SGLang), and the
  tensors of ours it never loaded;
- heads: SGLang's Markov bias and confidence on probe tokens and states, against the
  draft's own heads (eagle3.dspark.model) holding the same tensors.
Prints one JSON line per export; exit status 1 on a mismatch. Run it in its own process (it
initialises torch.distributed) with `workflows/sglang_cpu_shim` on PYTHONPATH.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from eagle3.dspark.model import ConfidenceHead, MarkovHead
from workflows.core.draft_files import EXPORT_CONFIG, EXPORT_WEIGHTS
from workflows.tools.sglang_dflash_check import load_and_compare
from workflows.tools.sglang_load_check import init_sglang_cpu

PROBES = 8  # probe tokens and states for the heads


def read_config(config) -> dict:
    from sglang.srt.speculative.dspark_components.dspark_config import parse_dspark_draft_config

    parsed = parse_dspark_draft_config(draft_hf_config=config)
    return {
        "gamma": parsed.gamma,
        "target_layer_ids": parsed.target_layer_ids,
        "mask_token_id": parsed.mask_token_id,
        "markov_rank": parsed.markov_rank,
        "markov_head_type": parsed.markov_head_type,
    }


def heads_difference(model, ours: dict[str, torch.Tensor], config) -> float:
    """Largest |SGLang - ours| over the Markov bias and the confidence logit of PROBES tokens
    and states (the confidence head reads the normed state, as SGLang's draft returns it)."""
    g = torch.Generator().manual_seed(0)
    prev = torch.randint(0, int(config.vocab_size), (PROBES,), generator=g)
    normed = torch.randn(PROBES, int(config.hidden_size), generator=g)
    markov = MarkovHead(int(config.vocab_size), ours["markov_head.markov_w2.weight"].shape[0], int(config.markov_rank))
    markov.load_state_dict({k.removeprefix("markov_head."): v for k, v in ours.items() if k.startswith("markov_head.")})
    with torch.no_grad():
        embedded = model.markov_head.get_prev_embeddings(prev)
        diffs = [(model.markov_head.project_bias(embedded) - markov.bias(markov.embed(prev))).abs().max()]
        if model.confidence_head is not None:
            head = ConfidenceHead(ours["confidence_head.proj.weight"].shape[1])
            head.load_state_dict(
                {"proj.weight": ours["confidence_head.proj.weight"], "proj.bias": ours["confidence_head.proj.bias"]}
            )
            features = torch.cat([normed, markov.embed(prev)], -1) if config.confidence_head_with_markov else normed
            diffs.append((model.confidence_head(normed, embedded) - head(features)).abs().max())
    return float(max(diffs))


def check(export_dir: Path) -> dict:
    from sglang.srt.models.dspark import Qwen3DSparkModel
    from transformers import Qwen3Config

    config = Qwen3Config(**json.loads((export_dir / EXPORT_CONFIG).read_text()))
    ours = load_file(str(export_dir / EXPORT_WEIGHTS))
    model = Qwen3DSparkModel(config)
    loaded = load_and_compare(model, ours)
    problems = loaded["problems"]
    difference = heads_difference(model, ours, config)
    if difference > 1e-5:
        problems.append(f"SGLang's heads differ from the draft's by {difference:.3g}")
    return {
        "config": read_config(config),
        "confidence_head": model.confidence_head is not None,
        "checked": loaded["checked"],
        "heads_max_abs_diff": difference,
        "problems": problems,
        "ok": not problems,
    }


if __name__ == "__main__":
    os.environ.setdefault("SGLANG_RAGGED_VERIFY_MODE", "compact")  # builds the confidence head
    init_sglang_cpu()
    reports = [check(Path(arg)) for arg in sys.argv[1:]]
    for report in reports:
        print("SGLANG_DSPARK_CHECK " + json.dumps(report))
    sys.exit(0 if all(r["ok"] for r in reports) else 1)
