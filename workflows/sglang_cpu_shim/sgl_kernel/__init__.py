"""Not sgl-kernel: the eight speculative-decoding ops SGLang 0.5.23 imports from the Intel
CPU build of sgl-kernel when `SGLANG_USE_CPU_ENGINE=1` (see ../README.md).

Each is written from the contract of the Triton kernel beside its call site in SGLang
(named in each docstring): the same in-place writes on flat views of the same tensors.
Plain torch and Python loops: a CPU server here decodes one or a few sequences, and these
ops touch a handful of indices per request. Anything else imported from `sgl_kernel`
still raises ImportError, as it did without this package.
"""

from __future__ import annotations

import ctypes

import torch

__version__ = "0.0.0+eagle3-sglang-cpu-shim"


def _row_offsets(start: torch.Tensor, end: torch.Tensor) -> list[tuple[int, int, int]]:
    """(start, end, offset into the packed list) per request: the packed list holds each
    request's `end - start` entries one request after another."""
    out, offset = [], 0
    for s, e in zip(start.tolist(), end.tolist()):
        out.append((s, e, offset))
        offset += e - s
    return out


def assign_req_to_token_pool_cpu(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len: int
) -> None:
    """mem_cache/allocation.py `assign_req_to_token_pool`: request i's row of the
    req->token table, columns start..end, takes the next end-start packed cache slots."""
    for i, (s, e, off) in zip(req_pool_indices.tolist(), _row_offsets(start_offset, end_offset)):
        req_to_token[i, s:e] = out_cache_loc[off : off + e - s].to(req_to_token.dtype)


def assign_extend_cache_locs_cpu(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len: int
) -> None:
    """speculative/cache_locs.py `assign_extend_cache_locs`: the reverse gather, the
    table's columns start..end of each request packed into `out_cache_loc`."""
    for i, (s, e, off) in zip(req_pool_indices.tolist(), _row_offsets(start_offset, end_offset)):
        out_cache_loc[off : off + e - s] = req_to_token[i, s:e].to(out_cache_loc.dtype)


def assign_draft_cache_locs_contiguous_cpu(
    req_pool_indices, req_to_token, seq_lens, out_cache_loc, pool_len: int, topk: int, num_cols: int
) -> None:
    """speculative/cache_locs.py `assign_draft_cache_locs_contiguous`: request b's
    `topk * num_cols` slots after its committed length, in the table's order."""
    width = topk * num_cols
    for b, (i, n) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        out_cache_loc[b * width : (b + 1) * width] = req_to_token[i, n : n + width].to(out_cache_loc.dtype)


def fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride: int) -> None:
    """speculative/eagle.py `fill_bonus_tokens`: the last accepted token of each request
    (accept_lens counts the bonus token)."""
    flat = accept_tokens.reshape(-1)
    for b, n in enumerate(accept_lens.tolist()):
        bonus_tokens[b] = flat[accept_stride * b + n - 1]


def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc) -> None:
    """speculative/eagle.py `fill_accept_out_cache_loc`: the cache slots of the accepted
    draft positions (accept_index != -1), packed in order."""
    index = accept_index.reshape(-1)
    kept = index[index != -1]
    accept_out_cache_loc[: kept.numel()] = out_cache_loc[kept]


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc) -> None:
    """kvcache/cache_move.py `copy_all_layer_kv_cache_tiled`: in every KV buffer (given by
    its data pointer and its bytes per slot), slot src[j] is copied to slot tgt[j]; safe
    when the two overlap (all sources are read before any target is written)."""
    if tgt_loc.numel() == 0:
        return
    tgt, src = tgt_loc.long(), src_loc.long()
    rows = int(max(tgt.max(), src.max())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        raw = (ctypes.c_uint8 * (rows * stride)).from_address(int(ptr))
        slots = torch.frombuffer(raw, dtype=torch.uint8).view(rows, stride)
        slots[tgt] = slots[src].clone()


def _parent_position(selected: list[int], parents: list[int], index: int, topk: int) -> int | None:
    """Where the parent of selected candidate `index` sits among the draft tokens: 0 for
    the root (the verified token), p + 1 for selected candidate p, None if not selected."""
    parent_tb = selected[index] // topk
    if parent_tb == 0:
        return 0
    parent_token = parents[parent_tb]
    for p, s in enumerate(selected):
        if s == parent_token:
            return p + 1
    return None


def build_tree_kernel_efficient_cpu(
    parent_list,
    selected_index,
    verified_seq_len,
    tree_mask,
    positions,
    retrieve_index,
    retrieve_next_token,
    retrieve_next_sibling,
    topk: int,
    depth: int,
    draft_token_num: int,
    tree_mask_mode: int,
) -> None:
    """speculative/spec_tree.py `sgl_build_tree_kernel_efficient_triton`: from the chosen
    candidates (`selected_index`, into the flattened draft steps) and their parents, the
    verify tree's retrieval links (first child, next sibling), each token's position and
    the attention mask rows (FULL_MASK: [draft, prefix + draft] per request, the prefix
    left as the caller filled it; QLEN_ONLY: [draft, draft])."""
    D = draft_token_num
    mask = tree_mask.view(-1)
    index, next_token, next_sibling = (t.view(-1) for t in (retrieve_index, retrieve_next_token, retrieve_next_sibling))
    pos = positions.view(-1)
    parents2d = parent_list.view(1, -1) if parent_list.dim() == 1 else parent_list
    seq_lens = verified_seq_len.tolist()
    prefix_sum = 0
    for b, seq_len in enumerate(seq_lens):
        selected = selected_index[b].tolist()
        parents = parents2d[b].tolist()
        pos[b * D] = seq_len
        for i in range(D - 1, 0, -1):  # children in reverse, so each list ends up in order
            index[b * D + i] = b * D + i
            parent = _parent_position(selected, parents, i - 1, topk)
            if parent is not None:
                first = int(next_token[b * D + parent])
                next_token[b * D + parent] = i
                if first != -1:
                    next_sibling[b * D + i] = first
        index[b * D] = b * D
        for x in range(D):
            if tree_mask_mode == 0:  # FULL_MASK
                row = D * D * b + prefix_sum * D + (seq_len + D) * x + seq_len
            else:
                row = D * D * b + D * x
            mask[row] = True  # the root: every draft token sees the verified token
            mask[row + 1 : row + D] = False
            if x == 0:
                continue
            cur, level = x - 1, 0
            for _ in range(depth):  # walk up to the root, marking each ancestor
                level += 1
                mask[row + 1 + cur] = True
                parent = _parent_position(selected, parents, cur, topk)
                if not parent:  # the root (0), or a parent that was not selected
                    break
                cur = parent - 1
            pos[b * D + x] = level + seq_len
        prefix_sum += seq_len


def verify_tree_greedy_cpu(
    predicts,
    accept_index,
    accept_token_num,
    candidates,
    retrive_index,
    retrive_next_token,
    retrive_next_sibling,
    target_predict,
) -> None:
    """speculative/spec_tree.py `verify_tree_greedy_kernel_triton`: walk each request's tree
    from the root, following the child whose token is the target's greedy choice at its
    parent; the accepted path's flat indices go to accept_index, the target's choices to
    predicts, and the count of accepted draft tokens to accept_token_num."""
    bs, D = candidates.shape
    steps = accept_index.shape[1]
    target = target_predict.reshape(-1)
    for b in range(bs):
        last = int(retrive_index[b, 0])
        accept_index[b, 0] = last
        accepted, cur = 0, 0
        for _ in range(1, steps):
            cur = int(retrive_next_token[b, cur])
            want = int(target[last])
            while cur != -1 and int(candidates[b, cur]) != want:
                cur = int(retrive_next_sibling[b, cur])
            if cur == -1:
                break
            predicts.view(-1)[last] = want
            accepted += 1
            last = int(retrive_index[b, cur])
            accept_index[b, accepted] = last
        accept_token_num[b] = accepted
        predicts.view(-1)[last] = target[last]
