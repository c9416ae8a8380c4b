"""The heart of the maths: the TTT unroll is exactly what inference computes.

Reference: for every row t, the draft is run as at inference with a KV cache: prefill of
rows 0..t from the target states (step 0), then one token at a time, each step reading
its own previous hidden state and the teacher-forced token x_{t+1+j} at position t+j.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eagle3.attention import KVCache, TTTAttention
from eagle3.ttt import shift_left, unroll
from tests.helpers import random_draft, tiny_draft_config


def stepwise_reference(draft, input_ids, aux, length, steps, shift=True):
    """[steps][T, H] outputs of one sequence, decoded row by row with a KV cache (step j at
    position t + j, or at t when not `shift`)."""
    t_total = input_ids.shape[0]
    outs = [torch.zeros(t_total, draft.cfg.hidden_size, dtype=aux.dtype) for _ in range(steps)]
    fused = draft.fuse(aux[None])
    tokens0 = shift_left(input_ids[None], 1)
    for t in range(length):
        cache = KVCache()
        pos = torch.arange(t + 1)[None]
        out = draft.step(tokens0[:, : t + 1], fused[:, : t + 1], pos, cache)
        hidden = out[:, t : t + 1]
        outs[0][t] = hidden[0, 0]
        for j in range(1, steps):
            tok_index = t + 1 + j
            tok = input_ids[tok_index] if tok_index < t_total else torch.tensor(0)
            hidden = draft.step(tok.view(1, 1), hidden, torch.tensor([[t + j if shift else t]]), cache)
            outs[j][t] = hidden[0, 0]
    return outs


# Both TTT attention backends against inference itself (flex runs eagerly on the CPU;
# tests/test_attention_scale.py compares their gradients).
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("backend", ["dense", "flex"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_unroll_equals_kv_cache_decoding(seed, backend):
    cfg = tiny_draft_config()
    draft = random_draft(cfg, seed=seed)
    g = torch.Generator().manual_seed(seed)
    b, t, steps = 3, 11, 5
    input_ids = torch.randint(0, cfg.vocab_size, (b, t), generator=g)
    aux = torch.randn(b, t, cfg.num_aux * cfg.target_hidden_size, generator=g, dtype=torch.float64)
    lengths = [11, 7, 4]  # right padding in the batch must not leak into real rows
    mask = torch.zeros(b, t, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, :n] = True
        input_ids[i, n:] = 0
    with torch.no_grad():
        ttt = unroll(draft, input_ids, aux, mask, steps, attention=backend)
        for i, n in enumerate(lengths):
            ref = stepwise_reference(draft, input_ids[i], aux[i], n, steps)
            for j in range(steps):
                # Rows whose step-j token lies beyond the sequence still match (padding
                # token 0 on both sides); only rows inside the sample are compared.
                torch.testing.assert_close(ttt[j][i, :n], ref[j][:n], rtol=1e-9, atol=1e-9)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("backend", ["dense", "flex"])
def test_fixed_positions_keep_every_step_at_its_row(backend):
    """ttt.positions=fixed (SpecForge 0.2.0's SDPA path): the same decoding with every step's
    RoPE position left at t; it differs from the shifted unroll from step 1 on."""
    cfg = tiny_draft_config()
    draft = random_draft(cfg, seed=3)
    input_ids = torch.randint(0, cfg.vocab_size, (1, 10))
    aux = torch.randn(1, 10, cfg.num_aux * cfg.target_hidden_size, dtype=torch.float64)
    mask = torch.ones(1, 10, dtype=torch.bool)
    with torch.no_grad():
        fixed = unroll(draft, input_ids, aux, mask, 4, attention=backend, shift_positions=False)
        shifted = unroll(draft, input_ids, aux, mask, 4, attention=backend)
        ref = stepwise_reference(draft, input_ids[0], aux[0], 10, 4, shift=False)
    for j in range(4):
        torch.testing.assert_close(fixed[j][0], ref[j], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(fixed[0], shifted[0], rtol=0, atol=0)
    assert not torch.allclose(fixed[1], shifted[1])


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("backend", ["dense", "flex"])
def test_unroll_with_gqa_and_one_kv_head(backend):
    cfg = tiny_draft_config(num_attention_heads=4, num_key_value_heads=1)
    draft = random_draft(cfg, seed=5)
    input_ids = torch.randint(0, cfg.vocab_size, (1, 9))
    aux = torch.randn(1, 9, cfg.num_aux * cfg.target_hidden_size, dtype=torch.float64)
    with torch.no_grad():
        ttt = unroll(draft, input_ids, aux, torch.ones(1, 9, dtype=torch.bool), 4, attention=backend)
        ref = stepwise_reference(draft, input_ids[0], aux[0], 9, 4)
    for j in range(4):
        torch.testing.assert_close(ttt[j][0], ref[j], rtol=1e-9, atol=1e-9)


def reference_ttt_attention(qs, ks, vs, valid):
    """Slow and obvious: query (t, step j) sees (s, 0) for s <= t valid, and (t, i) for 1 <= i <= j."""
    steps = len(qs)
    b, h, t, d = qs[0].shape
    outs = []
    for j in range(steps):
        out = torch.zeros(b, h, t, d, dtype=qs[0].dtype)
        for bi in range(b):
            for hi in range(h):
                for ti in range(t):
                    keys, vals = [], []
                    for s in range(t):
                        if s <= ti and valid[bi, s]:
                            keys.append(ks[0][bi, hi, s])
                            vals.append(vs[0][bi, hi, s])
                    for i in range(1, j + 1):
                        keys.append(ks[i][bi, hi, ti])
                        vals.append(vs[i][bi, hi, ti])
                    if not keys:
                        continue
                    q = qs[j][bi, hi, ti]
                    scores = torch.stack([q @ k for k in keys]) / math.sqrt(d)
                    p = torch.softmax(scores, 0)
                    out[bi, hi, ti] = sum(pi * v for pi, v in zip(p, vals))
        outs.append(out)
    return outs


@settings(max_examples=25, deadline=None)
@given(
    b=st.integers(1, 2),
    h=st.integers(1, 3),
    t=st.integers(1, 6),
    steps=st.integers(1, 4),
    pad=st.integers(0, 5),
    seed=st.integers(0, 10_000),
)
def test_ttt_attention_matches_reference_mask(b, h, t, steps, pad, seed):
    g = torch.Generator().manual_seed(seed)
    d = 4
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[-1, max(1, t - pad) :] = False  # right padding of the last sample, first key valid
    qs = [torch.randn(b, h, t, d, generator=g, dtype=torch.float64) for _ in range(steps)]
    ks = [torch.randn(b, h, t, d, generator=g, dtype=torch.float64) for _ in range(steps)]
    vs = [torch.randn(b, h, t, d, generator=g, dtype=torch.float64) for _ in range(steps)]
    state = TTTAttention(valid)
    got = [state.attend(qs[j], ks[j], vs[j]) for j in range(steps)]
    want = reference_ttt_attention(qs, ks, vs, valid)
    for j in range(steps):
        torch.testing.assert_close(got[j], want[j], rtol=1e-10, atol=1e-10)


def test_kv_cache_block_prefill_equals_token_by_token():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 6, 4, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, 6, 4, generator=g, dtype=torch.float64)
    v = torch.randn(1, 2, 6, 4, generator=g, dtype=torch.float64)
    block = KVCache().attend(q, k, v)
    cache = KVCache()
    one = torch.cat([cache.attend(q[:, :, i : i + 1], k[:, :, i : i + 1], v[:, :, i : i + 1]) for i in range(6)], dim=2)
    torch.testing.assert_close(block, one)
    cache.truncate(3)
    assert len(cache) == 3
