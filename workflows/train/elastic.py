"""Elastic resume: a checkpoint saved by W workers resumed by W' != W.

Two things in a checkpoint depend on the world size; each gets a form that does not:

* The optimizer. DeepSpeed's ZeRO (stage >= 1) files hold each rank's partition of the fp32
  master weights and Adam's moments, and DeepSpeed 0.19 refuses to load them into another
  data-parallel size. Every checkpoint therefore also holds `optimizer_full.safetensors`:
  each parameter's full fp32 master weight, `exp_avg` and `exp_avg_sq`, gathered through
  DeepSpeed's own accessors (deepspeed.utils.safe_get_full_*; a collective over the ranks)
  and written by rank 0, with Adam's step count. A resume at another size loads the module
  weights from DeepSpeed's files and puts these back, each rank taking its new partition
  (safe_set_full_*). The draft is small beside the target, so the copy costs little.
  Without ZeRO and in fp32 (stage 0), DeepSpeed's optimizer state is already whole and its
  own load does it.
* The data position: see workflows.train.data (`elastic_position`).

What stays different: the noise generator of a rank that did not exist before starts from
its seed, and the gradient of a step averages over W' workers' batches instead of W's, so a
resized run's losses follow the uninterrupted run's within noise, not bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3.schema import ConfigError

FULL_OPTIMIZER = "optimizer_full.safetensors"
MOMENTS = ("exp_avg", "exp_avg_sq")


def partitioned(module: torch.nn.Module) -> bool:
    """Whether DeepSpeed holds this module's optimizer state in partitions (ZeRO >= 1, or its
    bf16 optimizer): then only the consolidated copy resumes at another world size."""
    return any(hasattr(p, "_hp_mapping") for p in module.parameters())


def adam_step(optimizer: torch.optim.Optimizer) -> int:
    for state in optimizer.state.values():
        if "step" in state:
            return int(state["step"])
    return 0


def save_full_optimizer(module: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path, rank: int) -> None:
    """Every rank calls this (the gathers are collectives); rank 0 writes the file."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    tensors = {}
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        tensors[f"{name}:fp32"] = safe_get_full_fp32_param(p)
        for key in MOMENTS:
            tensors[f"{name}:{key}"] = safe_get_full_optimizer_state(p, key)
    if rank == 0:
        save_file(
            {k: v.detach().float().contiguous().cpu() for k, v in tensors.items()},
            str(folder / FULL_OPTIMIZER),
            metadata={"step": str(adam_step(optimizer))},
        )


def load_full_optimizer(engine, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Put a consolidated optimizer state back into this rank's (new) partition. The module's
    weights must already be loaded (DeepSpeed's `load_module_only`)."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    file = folder / FULL_OPTIMIZER
    if not file.exists():
        raise ConfigError(
            f"{folder}: no {FULL_OPTIMIZER}, so this checkpoint resumes only with the train.num_workers it "
            "was saved with (it predates elastic resume)"
        )
    with safe_open(str(file), "pt") as f:
        step = int(f.metadata()["step"])
        # Adam's state does not exist before its first step: make it, then let DeepSpeed map
        # each parameter's fragments onto it, so that the full values can be set.
        for group in optimizer.param_groups:
            for flat in group["params"]:
                optimizer.state[flat] = {
                    "step": torch.tensor(float(step)),
                    **{key: torch.zeros_like(flat) for key in MOMENTS},
                }
        engine.optimizer._lazy_init_hp_params_optimizer_state()  # DeepSpeed's own first-step link
        for name, p in engine.module.named_parameters():
            if not p.requires_grad:
                continue
            safe_set_full_fp32_param(p, f.get_tensor(f"{name}:fp32").to(p.device))
            for key in MOMENTS:
                safe_set_full_optimizer_state(p, f.get_tensor(f"{name}:{key}").to(p.device), key)
