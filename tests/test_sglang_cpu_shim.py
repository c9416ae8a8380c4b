"""workflows/sglang_cpu_shim's EAGLE-3 stand-ins against slow, obvious references.

* The eight sgl-kernel ops against SGLang's own Triton kernels, run on CPU tensors by
  Triton's interpreter (tests/sglang_kernel_parity.py, in a child process: the interpreter
  must be chosen before triton is imported), on random drafts built by SGLang's own
  drafting helpers.
* The verify and draft-decode attention against a per-query, per-head softmax loop.
End to end (SGLang serving a draft with them): tests/test_served.py."""

import importlib
import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SHIM = ROOT / "workflows" / "sglang_cpu_shim"


@pytest.mark.slow  # the Triton interpreter runs SGLang's kernels: minutes
def test_the_cpu_ops_do_what_sglangs_own_kernels_do():
    env = {**os.environ, "TRITON_INTERPRET": "1", "TORCHDYNAMO_DISABLE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "sglang_kernel_parity.py"), "30"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    # Both mask layouts per case; trees of 1-3 requests, topk 1-3, 1-4 steps; paths accepted.
    assert counts == {**counts, "build_tree": 60, "verify_tree_greedy": 30, "pool_ops": 30, "kv_copy": 30}
    assert counts["accepted_tokens"] > 30


@contextmanager
def shim_package():
    """sglang_cpu_eagle imported from the shim folder, which is on sys.path only meanwhile
    (it also holds stand-ins named vllm and sgl_kernel, never to be seen by this process)."""
    sys.path.insert(0, str(SHIM))
    try:
        yield importlib.import_module("sglang_cpu_eagle.verify"), importlib.import_module("sglang_cpu_eagle.draft")
    finally:
        sys.path.remove(str(SHIM))


class Pool:
    """A KV pool of one layer: slots x kv heads x head dim."""

    def __init__(self, slots, kv_heads, dim, g):
        self.k, self.v = torch.randn(slots, kv_heads, dim, generator=g), torch.randn(slots, kv_heads, dim, generator=g)

    def set_kv_buffer(self, layer, loc, k, v):
        self.k[loc.loc], self.v[loc.loc] = k.view_as(self.k[loc.loc]), v.view_as(self.v[loc.loc])

    def get_key_buffer(self, layer_id):
        return self.k

    def get_value_buffer(self, layer_id):
        return self.v


LAYER = SimpleNamespace(tp_q_head_num=4, tp_k_head_num=2, qk_head_dim=8, v_head_dim=8, scaling=8**-0.5, layer_id=0)


def slow_attention(q, pool, slots):
    """One query [heads, d] over `slots`: softmax(q.k * scale) v per head, GQA by head // 2."""
    out = torch.empty(LAYER.tp_q_head_num, LAYER.v_head_dim)
    for h in range(LAYER.tp_q_head_num):
        kv = h // (LAYER.tp_q_head_num // LAYER.tp_k_head_num)
        scores = torch.tensor([float(q[h] @ pool.k[s, kv]) * LAYER.scaling for s in slots])
        weights = torch.softmax(scores, 0)
        out[h] = sum(w * pool.v[s, kv] for w, s in zip(weights, slots))
    return out


@pytest.mark.parametrize("full_mask", [False, True], ids=["qlen_only", "full_mask"])
def test_verify_attends_to_the_prefix_and_the_tree(full_mask):
    g = torch.Generator().manual_seed(3)
    with shim_package() as (verify, _):
        D, seq_lens, reqs = 4, [5, 3], [2, 0]
        table = torch.randperm(64, generator=g).view(4, 16)
        pool = Pool(64, 2, 8, g)
        out_cache_loc = torch.tensor([40, 41, 42, 43, 50, 51, 52, 53])
        trees = [
            torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool),
            torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool),
        ]
        mask = torch.cat(
            [
                torch.cat([torch.ones(D, n, dtype=torch.bool), t], 1).flatten() if full_mask else t.flatten()
                for n, t in zip(seq_lens, trees)
            ]
        )
        batch = SimpleNamespace(
            spec_info=SimpleNamespace(draft_token_num=D, custom_mask=mask),
            seq_lens=torch.tensor(seq_lens),
            req_pool_indices=torch.tensor(reqs),
            out_cache_loc=out_cache_loc,
        )
        backend = SimpleNamespace(
            token_to_kv_pool=pool,
            req_to_token_pool=SimpleNamespace(req_to_token=table),
            use_sliding_window_kv_pool=False,
        )
        q, k, v = torch.randn(8, 32, generator=g), torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
        got = verify.verify_forward(backend, q, k, v, LAYER, batch).view(8, 4, 8)
    assert torch.equal(pool.k[out_cache_loc], k.view(8, 2, 8))  # the draft tokens' KV written first
    for b, (req, n) in enumerate(zip(reqs, seq_lens)):
        for x in range(D):
            slots = table[req, :n].tolist() + [int(out_cache_loc[b * D + j]) for j in range(D) if trees[b][x, j]]
            torch.testing.assert_close(got[b * D + x], slow_attention(q.view(8, 4, 8)[b * D + x], pool, slots))


def test_draft_decode_step_i_sees_the_prefix_and_its_rank_s_slots():
    g = torch.Generator().manual_seed(4)
    with shim_package() as (_, draft):
        steps, topk, seq_lens, reqs = 4, 2, [3, 6], [1, 3]
        table = torch.randperm(96, generator=g).view(4, 24)
        pool = Pool(96, 2, 8, g)
        runner = SimpleNamespace(
            device="cpu", req_to_token_pool=SimpleNamespace(req_to_token=table), token_to_kv_pool=pool
        )
        backend = draft.TorchNativeMultiStepDraftBackend(runner, topk, steps)
        batch = SimpleNamespace(
            seq_lens=torch.tensor(seq_lens), req_pool_indices=torch.tensor(reqs), out_cache_loc=None, forward_mode=None
        )
        backend.init_forward_metadata(batch)
        assert len(backend.attn_backends) == steps - 1
        for i, step in enumerate(backend.attn_backends):
            # SGLang's layout: request b's draft slots follow its prefix as [topk, steps].
            want = [
                table[req, :n].tolist() + table[req, n + r * steps : n + r * steps + i + 1].tolist()
                for req, n in zip(reqs, seq_lens)
                for r in range(topk)
            ]
            assert [s.tolist() for s in step.query_slots] == want
            batch.out_cache_loc = torch.tensor([w[-1] for w in want])  # this step's own slots
            q, k, v = (torch.randn(4, d, generator=g) for d in (32, 16, 16))
            got = step.forward_decode(q, k, v, LAYER, batch).view(4, 4, 8)
            for j, slots in enumerate(want):
                torch.testing.assert_close(got[j], slow_attention(q.view(4, 4, 8)[j], pool, slots))
