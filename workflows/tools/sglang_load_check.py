"""Load an SGLang export with SGLang's own `LlamaForCausalLMEagle3`, on CPU, and compare.

    PYTHONPATH=.:workflows/sglang_cpu_shim python -m workflows.tools.sglang_load_check <export/sglang> [more ...]

SGLang's `load_weights` skips tensors whose names it does not know without a word, so
"it loaded" proves nothing: this builds the class from our config.json (SGLang's test
helper publishes a one-rank CPU topology; the process group is gloo), runs its
load_weights, then checks every SGLang parameter against our tensors (q/k/v and gate/up
are fused by SGLang) and the draft->target map (`hot_token_id`). Prints one JSON line per
export; exit status 1 on any mismatch. Run it in its own process: it initialises
torch.distributed. Needs the `workflows/sglang_cpu_shim` folder on PYTHONPATH (see there).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from eagle3.vocab import target_ids_of
from workflows.core.draft_files import EXPORT_CONFIG, EXPORT_WEIGHTS

FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def init_sglang_cpu() -> None:
    """A one-rank gloo topology, once per process.

    Port 0: the one rank's TCP store binds whatever port the OS gives it. Asking the OS for a free port
    and handing its number on leaves a window in which another process (a Ray worker, a server under
    test) can take it: CI lost a run to exactly that (EADDRINUSE).
    """
    from sglang.srt.distributed import parallel_state
    from sglang.test.test_utils import publish_build_topology

    publish_build_topology(device="cpu", tp_size=1)
    parallel_state.init_distributed_environment(
        world_size=1, rank=0, local_rank=0, backend="gloo", distributed_init_method="tcp://127.0.0.1:0"
    )
    parallel_state.initialize_model_parallel(backend="gloo")


def build_sglang_draft(config: dict):
    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3
    from transformers import LlamaConfig

    return LlamaForCausalLMEagle3(LlamaConfig(**config))


def our_names(sglang_name: str) -> list[str]:
    """Our tensor names behind one SGLang parameter (fused ones are concatenated by rows)."""
    name = sglang_name.removeprefix("model.").replace("layers.0.", "midlayer.")
    for fused, parts in FUSED.items():
        if fused in name:
            return [name.replace(fused, p) for p in parts]
    return [name]


def compare(model, ours: dict[str, torch.Tensor], names_of) -> tuple[list[str], list[str], list[str], set[str]]:
    """Every parameter of SGLang's `model` (after its load_weights) against our tensors behind
    it (`names_of`: SGLang name -> ours): (problems, parameters checked, parameters without
    tensors of ours, our tensors used)."""
    problems, checked, not_ours, used = [], [], [], set()
    for name, param in model.named_parameters():
        names = names_of(name)
        if not all(n in ours for n in names):
            not_ours.append(name)
            continue
        want = torch.cat([ours[n] for n in names], dim=0)
        if tuple(want.shape) != tuple(param.shape):
            problems.append(f"{name}: SGLang shape {tuple(param.shape)} vs ours {tuple(want.shape)}")
        elif not torch.equal(param.detach().to(want.dtype), want):
            problems.append(f"{name}: values differ after SGLang's load_weights")
        else:
            checked.append(name)
            used.update(names)
    return problems, checked, not_ours, used


def check(export_dir: Path) -> dict:
    config = json.loads((export_dir / EXPORT_CONFIG).read_text())
    ours = load_file(str(export_dir / EXPORT_WEIGHTS))
    model = build_sglang_draft(config)
    model.load_weights(iter(ours.items()))
    # not_ours, e.g. embed_tokens: SGLang takes the target's.
    problems, checked, not_ours, used = compare(model, ours, our_names)
    used |= {"d2t", "t2d"}
    if model.hot_token_id is None or not torch.equal(model.hot_token_id.long(), target_ids_of(ours["d2t"])):
        problems.append("hot_token_id (SGLang's draft->target map from d2t) differs from arange + d2t")
    expected_fc_in = len(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]) * config.get(
        "target_hidden_size", config["hidden_size"]
    )
    if model.model.fc.weight.shape[1] != expected_fc_in:
        problems.append(f"fc input width {model.model.fc.weight.shape[1]} != {expected_fc_in}")
    # The rotary base SGLang built the draft's attention with (from config.json through
    # transformers' rope_parameters): a draft trained with one base and served with another
    # keeps its weights and loses its acceptance.
    rope_base = float(model.model.layers[0].self_attn.rotary_emb.base)
    if rope_base != float(config["rope_theta"]):
        problems.append(f"SGLang's rotary base {rope_base} != config.json rope_theta {config['rope_theta']}")
    unused = sorted(set(ours) - used)
    if unused:
        problems.append(f"tensors SGLang never loaded: {unused}")
    return {
        "ok": not problems,
        "problems": problems,
        "checked": sorted(checked),
        "not_ours": sorted(not_ours),
        "rope_base": rope_base,
    }


if __name__ == "__main__":
    init_sglang_cpu()
    reports = [check(Path(arg)) for arg in sys.argv[1:]]
    for report in reports:
        print("SGLANG_LOAD_CHECK " + json.dumps(report))
    sys.exit(0 if all(r["ok"] for r in reports) else 1)
