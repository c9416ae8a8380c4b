"""Read a DFlash export (<run>/export/vllm) with SGLang's own DFLASH code, on CPU, and say
what SGLang makes of it.

    PYTHONPATH=.:workflows/sglang_cpu_shim \\
        python -m workflows.tools.sglang_dflash_check <target_layers> <export> [more ...]

`--speculative-algorithm DFLASH` reads the same folder vLLM does, but "it loaded" proves
little: SGLang's DFlashDraftModel.load_weights skips names it does not know without a word,
and the config's ids and block size only matter as SGLang interprets them. So this runs
SGLang's own functions on our files and reports the result:
- config: dflash_utils.parse_dflash_draft_config, its ids resolved against the target's
  depth (`target_layers`, as the target worker does), and the capture points
  Qwen3ForCausalLM.set_dflash_layers_to_capture makes of them (SGLang captures *before* a
  layer, so id i becomes i + 1: the output of layer i, our numbering);
- weights: models/dflash.DFlashDraftModel built from config.json, load_weights run on our
  tensors, every parameter compared (q/k/v and gate/up fused by SGLang), and the tensors
  of ours it never loaded;
- the mask embedding: the worker's _resolve_mask_token_id and
  _maybe_merge_trained_mask_embedding run on a stand-in target embedding table.
Prints one JSON line per export; exit status 1 on a mismatch. Run it in its own process (it
initialises torch.distributed) with `workflows/sglang_cpu_shim` on PYTHONPATH.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load_file

from eagle3.dflash.export import MASK_EMBEDDING_FILE
from workflows.core.draft_files import EXPORT_CONFIG, EXPORT_WEIGHTS
from workflows.tools.sglang_load_check import FUSED, compare, init_sglang_cpu


def our_names(sglang_name: str) -> list[str]:
    """Our tensor names behind one SGLang parameter (fused ones are concatenated by rows)."""
    for fused, parts in FUSED.items():
        if fused in sglang_name:
            return [sglang_name.replace(fused, p) for p in parts]
    return [sglang_name]


def read_config(config, target_layers: int) -> dict:
    from sglang.srt.models.qwen3 import Qwen3ForCausalLM
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config

    parsed = parse_dflash_draft_config(draft_hf_config=config)
    ids = parsed.resolve_target_layer_ids(target_num_layers=target_layers, draft_num_layers=parsed.num_hidden_layers)
    # The hook is a method of the target class; a stand-in holds the attributes it sets.
    target = SimpleNamespace(pp_group=SimpleNamespace(is_last_rank=True), model=SimpleNamespace())
    Qwen3ForCausalLM.set_dflash_layers_to_capture(target, ids)
    return {
        # What the worker uses when --speculative-num-draft-tokens is not given.
        "block_size": parsed.resolve_block_size(default=16),
        "mask_token_id": parsed.mask_token_id,
        # The worker refuses the id when the target's tokenizer holds this name elsewhere.
        "mask_token": parsed.mask_token,
        "target_layer_ids": ids,
        "captured_before_layers": target.model.layers_to_capture,
    }


def check_weights(config, ours: dict[str, torch.Tensor]) -> dict:
    from sglang.srt.models.dflash import DFlashDraftModel

    return load_and_compare(DFlashDraftModel(config), ours)


def load_and_compare(model, ours: dict[str, torch.Tensor]) -> dict:
    """SGLang's block-draft `model` after its load_weights on our tensors: (problems,
    parameters checked, our tensors it never loaded)."""
    model.load_weights(iter(ours.items()))
    problems, checked, not_ours, used = compare(model, ours, our_names)
    problems += [f"{name}: SGLang's parameter has no tensor of ours" for name in not_ours]
    not_loaded = sorted(set(ours) - used)
    if not_loaded:
        # SGLang's block drafts have no head of their own: the worker drafts through the
        # target's lm_head over the whole vocabulary, so a trained head is not served.
        problems.append(f"tensors SGLang never loaded: {not_loaded}")
    return {"problems": problems, "checked": sorted(checked), "not_loaded": not_loaded}


def merge_mask_embedding(export_dir: Path, config, mask_token: str, mask_token_id: int) -> dict:
    """SGLang writes mask_embedding.pt into the target's own embedding table at the mask
    id (vLLM keeps it apart); run that on a random table and report which rows moved."""
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    table = torch.nn.Embedding(int(config.vocab_size), int(config.hidden_size))
    before = table.weight.detach().clone()
    runner = SimpleNamespace(model=table, model_config=SimpleNamespace(vocab_size=int(config.vocab_size)))
    worker = SimpleNamespace(
        target_worker=SimpleNamespace(model_runner=runner, tokenizer=None),
        _target_worker=SimpleNamespace(
            model_runner=SimpleNamespace(model=SimpleNamespace(get_input_embeddings=lambda: table))
        ),
        server_args=SimpleNamespace(speculative_draft_model_path=str(export_dir)),
        device="cpu",
    )
    worker._mask_token_id = DFlashWorkerV2._resolve_mask_token_id(
        worker, mask_token=mask_token, mask_token_id=mask_token_id
    )
    DFlashWorkerV2._maybe_merge_trained_mask_embedding(worker)
    changed = (table.weight.detach() != before).any(dim=1).nonzero().flatten().tolist()
    return {
        "resolved_mask_token_id": worker._mask_token_id,
        "rows_changed": changed,
        "row": table.weight[changed].detach(),
    }


def check(export_dir: Path, target_layers: int) -> dict:
    from transformers import Qwen3Config

    raw = json.loads((export_dir / EXPORT_CONFIG).read_text())
    config = Qwen3Config(**raw)  # what AutoConfig makes of model_type qwen3; extra keys stay attributes
    report = {
        "config": read_config(config, target_layers),
        **check_weights(config, load_file(str(export_dir / EXPORT_WEIGHTS))),
    }
    merged = merge_mask_embedding(export_dir, config, report["config"]["mask_token"], report["config"]["mask_token_id"])
    ours = torch.load(export_dir / MASK_EMBEDDING_FILE, weights_only=True)["embedding"]
    row = merged.pop("row")
    if row.shape[0] != 1 or not torch.equal(row[0].to(ours.dtype), ours):
        report["problems"].append(f"the target table's rows {merged['rows_changed']} changed, not the mask row to ours")
    report["mask"] = merged
    report["ok"] = not report["problems"]
    return report


if __name__ == "__main__":
    init_sglang_cpu()
    reports = [check(Path(arg), int(sys.argv[1])) for arg in sys.argv[2:]]
    for report in reports:
        print("SGLANG_DFLASH_CHECK " + json.dumps(report))
    sys.exit(0 if all(r["ok"] for r in reports) else 1)
