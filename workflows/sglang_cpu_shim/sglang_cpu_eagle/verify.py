"""The target's verify pass with torch_native attention on a CPU (see __init__).

Each request's attention is one `scaled_dot_product_attention` over keys gathered from
SGLang's KV pool by slot index, with an explicit boolean mask: slow, plain and easy to
check, which is what a CPU test server needs. This module imports nothing of SGLang's
torch_native backend: it patches that module while the module loads.
"""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from torch.nn.functional import scaled_dot_product_attention


def attend(q, k_cache, v_cache, slots, mask, layer) -> torch.Tensor:
    """q [n, heads, d] over the cached keys/values at `slots` (LongTensor [m]); mask [n, m]
    bool, True where a query may attend (None: everywhere). -> [n, heads, d_v]"""
    k = k_cache[slots].to(q.dtype).movedim(0, 1)  # [kv_heads, m, d]
    v = v_cache[slots].to(q.dtype).movedim(0, 1)
    out = scaled_dot_product_attention(
        q.movedim(0, 1).unsqueeze(0),
        k.unsqueeze(0),
        v.unsqueeze(0),
        attn_mask=None if mask is None else mask[None, None],
        scale=layer.scaling,
        enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num,
    )
    return out.squeeze(0).movedim(0, 1)


def write_kv(backend, layer, forward_batch, k, v) -> None:
    if backend.use_sliding_window_kv_pool:  # its window layers write a second pool, not handled here
        raise NotImplementedError("sglang_cpu_shim: EAGLE on a CPU does not serve sliding-window targets")
    if k is not None and v is not None:
        backend.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, None), k, v)


def verify_forward(backend, q, k, v, layer, forward_batch, save_kv_cache=True) -> torch.Tensor:
    """The target's verify pass: request b's `D` draft tokens (the verified token first,
    then the tree) attend to its committed prefix, all of it, and to the draft tokens its
    tree mask row allows. The mask is SGLang's CPU layout (QLEN_ONLY: [D, D] per request)
    or the GPU one (FULL_MASK: [D, prefix + D] per request), told apart by its size."""
    if save_kv_cache:
        write_kv(backend, layer, forward_batch, k, v)
    spec = forward_batch.spec_info
    D = spec.draft_token_num
    seq_lens = forward_batch.seq_lens.tolist()
    full = spec.custom_mask.numel() != len(seq_lens) * D * D
    q_ = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
    out = q.new_empty((q_.shape[0], layer.tp_q_head_num, layer.v_head_dim))
    k_cache = backend.token_to_kv_pool.get_key_buffer(layer.layer_id)
    v_cache = backend.token_to_kv_pool.get_value_buffer(layer.layer_id)
    req_to_token = backend.req_to_token_pool.req_to_token
    offset = 0
    for b, (req, n) in enumerate(zip(forward_batch.req_pool_indices.tolist(), seq_lens)):
        rows = slice(b * D, (b + 1) * D)
        slots = torch.cat([req_to_token[req, :n].long(), forward_batch.out_cache_loc[rows].long()])
        width = n + D if full else D
        tree = spec.custom_mask[offset : offset + D * width].view(D, width).bool()
        offset += D * width
        mask = tree if full else torch.cat([tree.new_ones(D, n), tree], dim=1)
        out[rows] = attend(q_[rows], k_cache, v_cache, slots, mask, layer)
    return out.view(q_.shape[0], -1)


def patch_torch_native_backend(module) -> None:
    """TorchNativeAttnBackend.forward_extend takes the verify branch for the target's
    verify pass (every other forward mode as before)."""
    backend = module.TorchNativeAttnBackend
    extend = backend.forward_extend

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        if forward_batch.forward_mode.is_target_verify():
            return verify_forward(self, q, k, v, layer, forward_batch, save_kv_cache)
        return extend(self, q, k, v, layer, forward_batch, save_kv_cache)

    backend.forward_extend = forward_extend
