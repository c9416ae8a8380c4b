"""python tests/sglang_kernel_parity.py <cases>: the CPU shim's eight ops against SGLang's own
kernels, on random inputs. Run by tests/test_sglang_cpu_shim.py with TRITON_INTERPRET=1,
so SGLang's Triton kernels (the ones its GPU path launches) execute on CPU tensors in
Triton's interpreter: the reference is SGLang's code itself, not a re-reading of it. The
drafts the tree ops see are built by SGLang's own drafting helpers (select_top_k_tokens,
organize_draft_results) from random scores. Prints one JSON line: cases compared per op.
The KV-slot copy (raw pointers, which the interpreter cannot follow) is checked against
plain indexing of the same buffers."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch

SHIM = Path(__file__).resolve().parents[1] / "workflows" / "sglang_cpu_shim" / "sgl_kernel" / "__init__.py"


def load_shim():
    spec = importlib.util.spec_from_file_location("shim_sgl_kernel", SHIM)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def equal(name, a, b):
    if not torch.equal(a, b):
        raise AssertionError(f"{name}: shim {a.tolist()} != SGLang {b.tolist()}")


def random_draft(g, bs, topk, steps, ndt, vocab=50):
    """One round of SGLang's drafting on random draft distributions."""
    from sglang.srt.speculative.eagle_utils import organize_draft_results
    from sglang.srt.speculative.spec_utils import select_top_k_tokens

    def step_topk(rows):
        p = torch.rand(rows, topk, generator=g).sort(dim=-1, descending=True).values
        return p / p.sum(-1, keepdim=True), torch.randint(0, vocab, (rows, topk), generator=g)

    topk_p, topk_index = step_topk(bs)
    hidden, scores, score_list, token_list, parents_list = torch.zeros(bs, 1), None, [], [], []
    for i in range(steps):
        _, hidden, scores, info = select_top_k_tokens(i, topk_p, topk_index, hidden, scores, topk)
        score_list.append(info[0]), token_list.append(info[1]), parents_list.append(info[2])
        topk_p, topk_index = step_topk(bs * topk)
    return organize_draft_results(score_list, token_list, parents_list, ndt)


def tree_case(shim, g, bs, topk, steps, ndt, mode):
    from sglang.kernels.ops.speculative import spec_tree

    parents, selected, drafts = random_draft(g, bs, topk, steps, ndt)
    seq_lens = torch.randint(1, 20, (bs,), generator=g)
    if mode == spec_tree.TreeMaskMode.FULL_MASK:
        mask_size = ndt * (int(seq_lens.sum()) + ndt * bs)
    else:
        mask_size = bs * ndt * ndt
    outs = []
    for impl in ("shim", "sglang"):
        mask = torch.full((mask_size,), True)
        positions = torch.empty(bs * ndt, dtype=torch.long)
        retrieve = torch.full((3, bs, ndt), -1, dtype=torch.long)
        args = (
            parents,
            selected,
            seq_lens,
            mask,
            positions,
            retrieve[0],
            retrieve[1],
            retrieve[2],
            topk,
            steps,
            ndt,
            int(mode),
        )
        (shim.build_tree_kernel_efficient_cpu if impl == "shim" else spec_tree.sgl_build_tree_kernel_triton)(*args)
        outs.append((mask, positions, retrieve))
    for what, a, b in zip(("tree_mask", "positions", "retrieve"), *outs):
        equal(f"build_tree {what} (bs={bs}, topk={topk}, steps={steps}, ndt={ndt}, mode={mode.name})", a, b)
    return drafts, outs[0][2]


def verify_case(shim, g, bs, topk, steps, ndt):
    from sglang.kernels.ops.speculative import spec_tree

    drafts, retrieve = tree_case(shim, g, bs, topk, steps, ndt, spec_tree.TreeMaskMode.QLEN_ONLY)
    candidates = torch.cat([torch.randint(0, 50, (bs, 1), generator=g), drafts], dim=1)
    # The target follows one of a node's children most of the time, so paths get accepted.
    target = torch.randint(0, 50, (bs, ndt), generator=g)
    for b in range(bs):
        for node in range(ndt):
            child, kids = int(retrieve[1, b, node]), []
            while child != -1:
                kids.append(child)
                child = int(retrieve[2, b, child])
            if kids and torch.rand(1, generator=g) < 0.8:
                target[b, node] = candidates[b, kids[int(torch.randint(len(kids), (1,), generator=g))]]
    outs = []
    for impl in ("shim", "sglang"):
        predicts = torch.zeros(bs * ndt, dtype=torch.long)
        accept_index = torch.full((bs, steps + 1), -1, dtype=torch.long)
        accept_num = torch.zeros(bs, dtype=torch.long)
        if impl == "shim":
            shim.verify_tree_greedy_cpu(
                predicts=predicts,
                accept_index=accept_index,
                accept_token_num=accept_num,
                candidates=candidates,
                retrive_index=retrieve[0],
                retrive_next_token=retrieve[1],
                retrive_next_sibling=retrieve[2],
                target_predict=target,
            )
        else:
            spec_tree.verify_tree_greedy_triton(
                predicts, accept_index, accept_num, candidates, retrieve[0], retrieve[1], retrieve[2], target
            )
        outs.append((predicts, accept_index, accept_num))
    for what, a, b in zip(("predicts", "accept_index", "accept_token_num"), *outs):
        equal(f"verify_tree_greedy {what} (bs={bs}, topk={topk}, steps={steps}, ndt={ndt})", a, b)
    return int(outs[0][2].sum())


def pool_cases(shim, g):
    """The req->token table and cache-slot ops, each against its Triton kernel."""
    from sglang.kernels.ops.speculative import cache_locs, eagle
    from sglang.srt.mem_cache import allocation

    bs, pool_len = int(torch.randint(1, 5, (1,), generator=g)), 64
    table = torch.randint(0, 1000, (8, pool_len), generator=g, dtype=torch.int32)
    reqs = torch.randperm(8, generator=g)[:bs]
    start = torch.randint(0, 20, (bs,), generator=g)
    end = start + torch.randint(0, 20, (bs,), generator=g)
    slots = torch.randint(0, 1000, (int((end - start).sum()),), generator=g)

    a, b = table.clone(), table.clone()
    shim.assign_req_to_token_pool_cpu(reqs, a, start, end, slots, pool_len)
    allocation.assign_req_to_token_pool[(bs,)](reqs, b, start, end, slots, pool_len, 8)
    equal("assign_req_to_token_pool", a, b)

    a, b = torch.empty_like(slots), torch.empty_like(slots)
    shim.assign_extend_cache_locs_cpu(reqs, table, start, end, a, pool_len)
    cache_locs.assign_extend_cache_locs[(bs,)](reqs, table, start, end, b, pool_len, 8)
    equal("assign_extend_cache_locs", a, b)

    topk, cols = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(1, 5, (1,), generator=g))
    a, b = torch.empty(bs * topk * cols, dtype=torch.long), torch.empty(bs * topk * cols, dtype=torch.long)
    shim.assign_draft_cache_locs_contiguous_cpu(reqs, table, start, a, pool_len, topk, cols)
    cache_locs.assign_draft_cache_locs_contiguous[(bs,)](reqs, table, start, b, pool_len, topk, cols, BS=bs)
    equal("assign_draft_cache_locs_contiguous", a, b)

    width = int(torch.randint(1, 6, (1,), generator=g))
    tokens = torch.randint(0, 1000, (bs, width), generator=g)
    lens = torch.randint(1, width + 1, (bs,), generator=g)
    a, b = torch.empty(bs, dtype=torch.long), torch.empty(bs, dtype=torch.long)
    shim.fill_bonus_tokens_cpu(tokens, lens, a, width)
    eagle.fill_bonus_tokens[(bs,)](tokens, lens, b, width)
    equal("fill_bonus_tokens", a, b)

    index = torch.randint(0, 3 * bs * width, (bs * width,), generator=g)
    index[torch.rand(bs * width, generator=g) < 0.4] = -1
    cache = torch.randint(0, 1000, (3 * bs * width,), generator=g)
    a, b = torch.full((bs * width,), -7), torch.full((bs * width,), -7)
    shim.fill_accept_out_cache_loc_cpu(index, cache, a)
    eagle.fill_accept_out_cache_loc[(bs * width,)](index, cache, b, 1 << (bs * width - 1).bit_length())
    equal("fill_accept_out_cache_loc", a, b)


def kv_copy_case(shim, g):
    """copy_all_layer_kv_cache_cpu moves slots in place in every buffer, as indexing would."""
    buffers = [torch.randn(40, 2, 8, generator=g), torch.randn(40, 2, 8, generator=g).bfloat16()]
    expected = [b.clone() for b in buffers]
    n = int(torch.randint(1, 10, (1,), generator=g))
    src, tgt = torch.randperm(40, generator=g)[:n], torch.randperm(40, generator=g)[:n]
    for e in expected:
        e[tgt] = e[src].clone()
    ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64)
    strides = torch.tensor([b.stride(0) * b.element_size() for b in buffers])
    shim.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for a, b in zip(buffers, expected):
        equal(
            "copy_all_layer_kv_cache",
            a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
            b.view(torch.int16) if b.dtype == torch.bfloat16 else b,
        )


def main(cases: int) -> None:
    from sglang.kernels.ops.speculative import spec_tree

    shim, g = load_shim(), torch.Generator().manual_seed(0)
    counts = {"build_tree": 0, "verify_tree_greedy": 0, "accepted_tokens": 0, "pool_ops": 0, "kv_copy": 0}
    for _ in range(cases):
        bs, topk, steps = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in ((1, 4), (1, 4), (1, 5)))
        most = topk + (steps - 1) * topk * topk
        ndt = steps + 1 if topk == 1 else int(torch.randint(2, most + 2, (1,), generator=g))
        for mode in (spec_tree.TreeMaskMode.FULL_MASK, spec_tree.TreeMaskMode.QLEN_ONLY):
            tree_case(shim, g, bs, topk, steps, ndt, mode)
            counts["build_tree"] += 1
        counts["accepted_tokens"] += verify_case(shim, g, bs, topk, steps, ndt)
        counts["verify_tree_greedy"] += 1
        pool_cases(shim, g)
        counts["pool_ops"] += 1
        kv_copy_case(shim, g)
        counts["kv_copy"] += 1
    print(json.dumps(counts))


if __name__ == "__main__":
    main(int(sys.argv[1]))
