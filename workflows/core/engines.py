"""Target engines: one interface for every stage that runs the target.

An engine is built from an `EngineSpec` (workflows.core.engine_spec) by `make_engine(backend, spec)`
and offers

    tokenizer                                   the target's tokenizer
    generate(prompts, max_new_tokens, temperature, top_p) -> [(answer ids, "eos"|"length")]
    states(seqs) -> [(aux [T, n*H], final [T, H])]   hidden states at spec.capture_ids
    close()
    version() (static)                          recorded in the store's provenance

* `hf` (`HFEngine`, here): transformers on `spec.device` (the GPU its Ray actor holds,
  else the CPU); aux states by forward hooks (the last layer's raw residual stream), final
  = HF's last `hidden_states` entry, *after* the final norm (`final_is_normed`).
* `sglang` (`workflows.core.sglang.SGLangEngine`): an SGLang Engine; on CPU with the
  settings and the vllm shim that live in that module only.

generate (regeneration), capture (the store), train (online states) and evaluate
(held-out states) use them.
"""

from __future__ import annotations

from typing import Sequence

import torch

from eagle3.target_features import FINAL_IS_NORMED, capture_batch, capture_states, pad_right
from workflows.core.engine_spec import EngineSpec, micro_batches
from workflows.core.targets import load_target


def make_engine(backend: str, spec: EngineSpec):
    return engine_class(backend)(spec)


def engine_class(backend: str):
    if backend == "sglang":  # imported on demand: the SGLang engine is optional, and only it needs it
        from workflows.core.sglang import SGLangEngine

        return SGLangEngine
    if backend != "hf":
        raise ValueError(f"unknown engine backend {backend!r}; use 'hf' or 'sglang'")
    return HFEngine


class HFEngine:
    backend = "hf"
    final_is_normed = FINAL_IS_NORMED

    def __init__(self, spec: EngineSpec):
        if spec.threads:
            torch.set_num_threads(spec.threads)
        self.spec = spec
        # The ids its hooks sit on: LayerTap hooks decoder layer i for id i (-1: the embeddings),
        # so what HF captures is the request itself.
        self.captured_layer_ids = list(spec.capture_ids)
        self.device = torch.device(spec.device)
        self.model, self.tokenizer = load_target(
            spec.target_path, dtype=spec.dtype, trust_remote_code=spec.trust_remote_code
        )
        self.model.to(self.device)
        eos = self.model.generation_config.eos_token_id
        eos = eos if isinstance(eos, list) else [eos]
        self.eos = {e for e in [*eos, self.tokenizer.eos_token_id] if e is not None}
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else min(self.eos, default=0)

    @staticmethod
    def version() -> str:
        import transformers

        return f"transformers {transformers.__version__}"

    # ---------------------------------------------------------------------- generation
    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0
    ) -> list[tuple[list[int], str]]:
        """(answer ids without the stop token, finish) per prompt: finish is 'eos' or 'length'."""
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts], device=self.device)
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        sample = temperature > 0
        extra = {"temperature": temperature, "top_p": top_p} if sample else {"temperature": None, "top_p": None}
        out = self.model.generate(
            input_ids=ids,
            attention_mask=attention,
            max_new_tokens=max_new_tokens,
            do_sample=sample,
            eos_token_id=sorted(self.eos),
            pad_token_id=self.pad_id,
            top_k=None,
            **extra,
        )
        results = []
        for row in out[:, width:].tolist():
            stop = next((k for k, t in enumerate(row) if t in self.eos), None)
            results.append((row[:stop], "eos") if stop is not None else (row, "length"))
        return results

    # --------------------------------------------------------------------- hidden states
    def _padded(self, seqs, idx):
        ids, _, attn = pad_right([seqs[i] for i in idx], [[0] * len(seqs[i]) for i in idx], self.pad_id)
        return ids.to(self.device), attn.long().to(self.device)

    @torch.no_grad()
    def states(self, seqs: Sequence[Sequence[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out: list = [None] * len(seqs)
        for idx in micro_batches([len(s) for s in seqs], self.spec.micro_batch_tokens):
            aux, final = capture_states(self.model, *self._padded(seqs, idx), self.spec.capture_ids)
            for row, i in enumerate(idx):
                n = len(seqs[i])
                out[i] = (aux[row, :n], final[row, :n])
        return out

    @torch.no_grad()
    def bare_forward(self, seqs: Sequence[Sequence[int]]) -> None:
        """The same micro-batches through a plain forward (the capture benchmark's baseline)."""
        for idx in micro_batches([len(s) for s in seqs], self.spec.micro_batch_tokens):
            ids, attn = self._padded(seqs, idx)
            self.model(input_ids=ids, attention_mask=attn, use_cache=False)

    @torch.no_grad()
    def training_batches(self, groups: list[list[dict]], desc: str) -> list[dict]:
        """Training batches (eagle3.training's dict) for groups of corpus rows, computed here."""
        from tqdm import tqdm

        return [
            capture_batch(
                self.model,
                [r["input_ids"] for r in group],
                [r["loss_mask"] for r in group],
                self.spec.capture_ids,
                pad_id=self.pad_id,
                device=self.device,
            )
            for group in tqdm(groups, desc=desc, unit="batch")
        ]

    def close(self) -> None:
        pass
