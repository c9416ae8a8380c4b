"""The draft's attention backends with torch_native attention on a CPU (see __init__)."""

from __future__ import annotations

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

from sglang_cpu_eagle.verify import attend, write_kv

BACKEND = "torch_native"


class DraftDecodeStep(TorchNativeAttnBackend):
    """Draft step i of a multi-step draft decode: each query (request b, frontier rank r)
    attends to the slots its parent multi-step backend listed for it."""

    def __init__(self, model_runner):
        super().__init__(model_runner)
        self.query_slots: list[torch.Tensor] = []

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        if save_kv_cache:
            write_kv(self, layer, forward_batch, k, v)
        q_ = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        k_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_cache = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        out = torch.stack(
            [attend(q_[j : j + 1], k_cache, v_cache, slots, None, layer)[0] for j, slots in enumerate(self.query_slots)]
        )
        return out.view(q_.shape[0], -1)


class TorchNativeMultiStepDraftBackend:
    """One DraftDecodeStep per draft step but the last (which only samples). SGLang lays
    out request b's draft slots after its committed length as [topk, num_steps]
    (assign_draft_cache_locs_contiguous); at step i, rank r's query sees the prefix and
    rank r's slots for steps 0..i: the nodes that held rank r in the earlier frontiers,
    as SGLang's GPU kernels arrange it."""

    def __init__(self, model_runner, topk: int, speculative_num_steps: int):
        self.topk, self.speculative_num_steps = topk, speculative_num_steps
        self.device = model_runner.device
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.attn_backends = [DraftDecodeStep(model_runner) for _ in range(speculative_num_steps - 1)]

    def init_forward_metadata(self, forward_batch) -> None:
        steps = self.speculative_num_steps
        for i, step in enumerate(self.attn_backends):
            step.query_slots = []
            for req, n in zip(forward_batch.req_pool_indices.tolist(), forward_batch.seq_lens.tolist()):
                row = self.req_to_token[req].long()
                for r in range(self.topk):
                    start = n + r * steps
                    step.query_slots.append(torch.cat([row[:n], row[start : start + i + 1]]))
            step.init_forward_metadata(forward_batch)


def _stamp(backend):
    backend.prefill_attention_backend_str = backend.decode_attention_backend_str = BACKEND
    for child in getattr(backend, "attn_backends", []):
        child.prefill_attention_backend_str = child.decode_attention_backend_str = BACKEND
    return backend


def _uses_torch_native(factory, attention_backends) -> bool:
    return (factory.draft_attn_backend or BACKEND) == BACKEND and BACKEND in attention_backends()


def patch_draft_utils(module) -> None:
    """DraftBackendFactory builds the torch_native draft backends above."""
    factory = module.DraftBackendFactory
    decode, extend = factory.create_decode_backend, factory.create_draft_extend_backend

    def create_decode_backend(self):
        if self.speculative_num_steps <= 1 or not _uses_torch_native(self, module.attention_backends):
            return decode(self)
        return _stamp(TorchNativeMultiStepDraftBackend(self.draft_model_runner, self.topk, self.speculative_num_steps))

    def create_draft_extend_backend(self):
        if not _uses_torch_native(self, module.attention_backends):
            return extend(self)
        return _stamp(TorchNativeAttnBackend(self.draft_model_runner))

    factory.create_decode_backend = create_decode_backend
    factory.create_draft_extend_backend = create_draft_extend_backend
