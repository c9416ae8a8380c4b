"""What an engine is built from (`EngineSpec`) and how its forwards are batched (`micro_batches`).

A leaf (the standard library only): the engines (workflows.core.engines, workflows.core.sglang),
the capture worker and SGLang's runner, the final-layer tail and the stages all import it, and
none of them has to import the module that picks an engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence


@dataclass
class EngineSpec:
    target_path: str
    dtype: str = "float32"
    trust_remote_code: bool = False  # only where the target preset asks for it by name
    threads: int = 0  # torch threads of this engine (0: torch's default)
    device: str = "cpu"  # hf: where the model runs; sglang: "cpu" selects SGLang's CPU settings
    capture_ids: list[int] = field(default_factory=list)  # capture ids (eagle3.layer_ids), for states()
    micro_batch_tokens: int = 4096  # padded tokens per forward in states()
    tp_size: int = 1  # sglang: tensor parallel ranks
    seed: int = 0
    max_total_tokens: int | None = 4096  # sglang: the KV pool (tokens); null: SGLang sizes it
    # sglang states(): how the final hidden state comes back ("runner", what "auto" picks: SGLang's
    # model runner returns it from the same forward; "tail"); workflows.core.sglang.
    final_state: str = "auto"
    timeout_s: float = 3600.0  # sglang states(): the capture worker's start, and each call


def micro_batches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Indices grouped by length (little padding), each group's padded size <= budget."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups, cur = [], []
    for i in order:
        if cur and lengths[i] * (len(cur) + 1) > token_budget:
            groups.append(cur)
            cur = []
        cur.append(i)
    if cur:
        groups.append(cur)
    return groups
