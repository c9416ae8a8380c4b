"""The linear-memory TTT attention (flex) against the dense reference, and device hygiene.

The dense implementation is itself checked against the slow per-query reference in
test_ttt_equivalence.py; here flex must match it in fp64, outputs and gradients, on
padded and packed rows. On CPU flex runs eagerly, which evaluates `mask_mod` on every
(query, key) pair and ignores the block table; the block table (what the compiled CUDA
kernel trusts to skip work) is therefore checked on its own, element by element.
"""

import contextlib
import math
import warnings
from unittest import mock

import pytest
import torch
import torch.nn.attention.flex_attention as flex_module
from hypothesis import given, settings
from hypothesis import strategies as st

from eagle3.attention import DenseTTTAttention, FlexTTTAttention, make_ttt_attention
from eagle3.target_head import TargetHead
from eagle3.training import forward_batch
from eagle3.ttt import TTTConfig, unroll
from tests.helpers import random_draft, tiny_draft_config


@contextlib.contextmanager
def cpu_flex_backward():
    """torch refuses flex backward on CPU up front (its compiled CPU kernel has none), but
    the eager implementation differentiates fine: lift that one check inside this block so
    the fp64 gradients of the real flex maths can be compared on a CPU-only machine."""
    original = flex_module._validate_device

    def allow_cpu_grad(query, key, value):
        if query.device.type != "cpu":
            original(query, key, value)

    with mock.patch.object(flex_module, "_validate_device", allow_cpu_grad), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "flex_attention called without torch.compile()"
        yield


def packed_segments(lengths_per_row: list[list[int]], t: int) -> torch.Tensor:
    """[B, t] segment ids: row b holds samples of the given lengths, then padding (-1)."""
    seg = torch.full((len(lengths_per_row), t), -1, dtype=torch.long)
    for b, lengths in enumerate(lengths_per_row):
        pos = 0
        for i, n in enumerate(lengths):
            seg[b, pos : pos + n] = i
            pos += n
    return seg


@st.composite
def segment_layouts(draw):
    """Rows of packed samples with right padding; every row starts with a real token (a row
    of padding only has no key to attend to at step 0)."""
    t = draw(st.integers(1, 23))
    b = draw(st.integers(1, 3))
    rows = []
    for _ in range(b):
        used = draw(st.integers(1, t))
        lengths = []
        while sum(lengths) < used:
            lengths.append(draw(st.integers(1, used - sum(lengths))))
        rows.append(lengths)
    return packed_segments(rows, t)


def random_qkv(g, b, hq, hkv, t, d, steps):
    def r(h):
        return [torch.randn(b, h, t, d, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(steps)]

    return r(hq), r(hkv), r(hkv)


def run_state(state, qs, ks, vs, group: int):
    """Outputs of every step; k/v repeated for states that do not group heads themselves."""
    outs = []
    for q, k, v in zip(qs, ks, vs):
        if not state.native_gqa:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        outs.append(state.attend(q, k, v))
    return outs


@settings(max_examples=20, deadline=None)
@given(
    seg=segment_layouts(),
    steps=st.integers(1, 4),
    heads=st.sampled_from([(1, 1), (2, 1), (4, 2), (3, 3)]),
    block=st.sampled_from([2, 4, 8, 128]),
    seed=st.integers(0, 10_000),
)
def test_flex_matches_dense_outputs_and_gradients(seg, steps, heads, block, seed):
    hq, hkv = heads
    b, t = seg.shape
    g = torch.Generator().manual_seed(seed)
    qs, ks, vs = random_qkv(g, b, hq, hkv, t, 4, steps)
    upstream = [torch.randn(b, hq, t, 4, generator=g, dtype=torch.float64) for _ in range(steps)]

    def outputs_and_grads(state):
        leaves = qs + ks + vs
        for x in leaves:
            x.grad = None
        outs = run_state(state, qs, ks, vs, hq // hkv)
        sum((o * u).sum() for o, u in zip(outs, upstream)).backward()
        return [o.detach() for o in outs], [x.grad.clone() for x in leaves]

    want_out, want_grad = outputs_and_grads(DenseTTTAttention(segment_ids=seg))
    with cpu_flex_backward():
        got_out, got_grad = outputs_and_grads(FlexTTTAttention(seg, block_size=block))
    for got, want in zip(got_out + got_grad, want_out + want_grad):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def element_mask_of(bm, b: int) -> torch.Tensor:
    """What a block-sparse kernel computes with: mask_mod inside partial blocks, everything
    inside full blocks, nothing elsewhere. [b, Q, KV] bool."""
    q_len, kv_len = bm.seq_lengths
    bq, bkv = bm.BLOCK_SIZE

    def table(count, cols):
        nq, nkv = q_len // bq, kv_len // bkv
        dense = torch.zeros(b, nq, nkv, dtype=torch.bool)
        for bi in range(b):
            for r in range(nq):
                for c in cols[bi, 0, r, : count[bi, 0, r]].tolist():
                    assert not dense[bi, r, c], "a block listed twice"
                    dense[bi, r, c] = True
        return dense.repeat_interleave(bq, dim=1).repeat_interleave(bkv, dim=2)

    partial = table(bm.kv_num_blocks, bm.kv_indices)
    full = table(bm.full_kv_num_blocks, bm.full_kv_indices)
    assert not (partial & full).any(), "a block both partial and full"
    return full | (partial & mask_mod_dense(bm.mask_mod, b, q_len, kv_len))


def mask_mod_dense(mask_mod, b, q_len, kv_len):
    bi = torch.arange(b)[:, None, None]
    qi = torch.arange(q_len)[None, :, None]
    ki = torch.arange(kv_len)[None, None, :]
    return mask_mod(bi, torch.zeros_like(bi), qi, ki)


def reference_visibility(seg: torch.Tensor, steps: int) -> torch.Tensor:
    """[B, T, steps*T] from the rule as written: step-0 key s visible to row t iff s <= t,
    s is real and (same segment or t is padding); step-i key s visible iff s == t."""
    b, t = seg.shape
    vis = torch.zeros(b, t, steps * t, dtype=torch.bool)
    for bi in range(b):
        for q in range(t):
            for s in range(t):
                vis[bi, q, s] = s <= q and seg[bi, s] >= 0 and (seg[bi, q] == seg[bi, s] or seg[bi, q] < 0)
            for i in range(1, steps):
                vis[bi, q, i * t + q] = True
    return vis


@settings(max_examples=40, deadline=None)
@given(seg=segment_layouts(), steps=st.integers(1, 4), block=st.sampled_from([1, 2, 3, 4, 8]))
def test_block_table_is_exactly_what_mask_mod_says(seg, steps, block):
    b, t = seg.shape
    state = FlexTTTAttention(seg, block_size=block)
    bm = state.block_mask(steps)
    tp = state.tp
    element = mask_mod_dense(bm.mask_mod, b, tp, steps * tp)
    # Sound: skipping empty blocks and not masking full ones changes nothing.
    assert torch.equal(element_mask_of(bm, b), element)
    # And the rule itself, on the real rows and real keys of every step.
    keys = torch.cat([torch.arange(t) + i * tp for i in range(steps)])
    assert torch.equal(element[:, :t][:, :, keys], reference_visibility(seg, steps))
    # Tight: a block is listed iff some pair in it is visible (no wasted kernel tiles).
    nq, nkv = tp // block, steps * tp // block
    listed = torch.zeros(b, nq, nkv, dtype=torch.bool)
    for count, cols in ((bm.kv_num_blocks, bm.kv_indices), (bm.full_kv_num_blocks, bm.full_kv_indices)):
        for bi in range(b):
            for r in range(nq):
                listed[bi, r, cols[bi, 0, r, : count[bi, 0, r]].long()] = True
    any_visible = element.view(b, nq, block, nkv, block).any(-1).any(2)
    assert torch.equal(listed, any_visible)


def test_causal_padded_batch_skips_blocks_above_the_diagonal():
    seg = torch.zeros(1, 64, dtype=torch.long)
    bm = FlexTTTAttention(seg, block_size=16).block_mask(3)
    # Step 0: query block r lists key blocks 0..r (r full ones below the diagonal, the
    # diagonal partial); each later step adds only its diagonal block.
    assert bm.kv_num_blocks[0, 0].tolist() == [3, 3, 3, 3]
    assert bm.full_kv_num_blocks[0, 0].tolist() == [0, 1, 2, 3]


def test_unroll_flex_equals_dense_through_the_draft():
    """Whole TTT unroll with GQA (4 query heads, 2 kv heads) on packed rows: hidden states
    and the gradient of every draft parameter agree in fp64."""
    cfg = tiny_draft_config()
    draft = random_draft(cfg, seed=3).train()
    g = torch.Generator().manual_seed(3)
    seg = packed_segments([[5, 4, 3], [9]], 14)
    positions = torch.zeros_like(seg)
    for b in range(seg.shape[0]):
        for s in seg[b].unique().tolist():
            where = (seg[b] == s).nonzero().flatten()
            positions[b, where] = torch.arange(len(where))
    ids = torch.randint(0, cfg.vocab_size, seg.shape, generator=g)
    aux = torch.randn(*seg.shape, cfg.num_aux * cfg.target_hidden_size, generator=g, dtype=torch.float64)
    mask = seg >= 0
    results = {}
    for backend in ("dense", "flex"):
        draft.zero_grad()
        with cpu_flex_backward():
            outs = unroll(draft, ids, aux, mask, 4, position_ids=positions, segment_ids=seg, attention=backend)
            sum(o.pow(2).mean() for o in outs).backward()
        results[backend] = (
            [o.detach() for o in outs],
            {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None},
        )
    (dense_out, dense_grad), (flex_out, flex_grad) = results["dense"], results["flex"]
    for a, b in zip(flex_out, dense_out):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    assert dense_grad.keys() == flex_grad.keys() and dense_grad
    for name in dense_grad:
        torch.testing.assert_close(flex_grad[name], dense_grad[name], rtol=1e-9, atol=1e-10, msg=name)


def test_backend_selection_and_config():
    seg = torch.zeros(1, 4, dtype=torch.long)
    assert isinstance(make_ttt_attention(seg, "auto"), DenseTTTAttention)  # CPU tensors: dense
    assert isinstance(make_ttt_attention(seg, "flex"), FlexTTTAttention)
    with pytest.raises(ValueError, match="backend 'fast'"):
        make_ttt_attention(seg, "fast")
    from eagle3.schema import ConfigError, from_dict

    assert from_dict(TTTConfig, {"attention": "flex"}).attention == "flex"
    with pytest.raises(ConfigError, match="attention"):
        from_dict(TTTConfig, {"attention": "sdpa"})
    with pytest.raises(ConfigError, match="ttt.attention='sdpa'"):
        TTTConfig(attention="sdpa").validate()


# --- devices ------------------------------------------------------------------------------
def meta_batch(cfg, b=2, t=9):
    """A padded batch on the meta device: shapes only. Any tensor the maths creates on the
    CPU by default and then combines with these fails loudly."""
    m = torch.device("meta")
    return {
        "input_ids": torch.zeros(b, t, dtype=torch.long, device=m),
        "loss_mask": torch.ones(b, t, dtype=torch.long, device=m),
        "attention_mask": torch.ones(b, t, dtype=torch.bool, device=m),
        "position_ids": torch.zeros(b, t, dtype=torch.long, device=m),
        "segment_ids": torch.zeros(b, t, dtype=torch.long, device=m),
        "aux": torch.zeros(b, t, cfg.num_aux * cfg.target_hidden_size, device=m),
        "final": torch.zeros(b, t, cfg.target_hidden_size, device=m),
    }


@pytest.mark.parametrize("packed", [False, True])
def test_maths_creates_no_tensor_off_the_inputs_device(packed):
    cfg = tiny_draft_config()
    draft = random_draft(cfg, dtype=torch.float32).train().to("meta")
    head = TargetHead(torch.zeros(cfg.vocab_size, cfg.target_hidden_size)).to("meta")
    batch = meta_batch(cfg)
    if not packed:  # a padded batch derives positions and segments itself
        del batch["position_ids"], batch["segment_ids"]
    ttt = TTTConfig(length=3, attention="dense")
    scores = forward_batch(draft, head, batch, ttt, train=True)  # noise, head, unroll, score
    scores.loss.backward()
    assert scores.loss.device.type == "meta" and scores.correct.device.type == "meta"
    assert all(p.grad.device.type == "meta" for p in draft.parameters() if p.requires_grad)
    # The flex block tables are built on the inputs' device too.
    state = FlexTTTAttention(batch["attention_mask"].long() - 1, block_size=4)
    bm = state.block_mask(3)
    assert bm.kv_indices.device.type == "meta" and bm.full_kv_indices.device.type == "meta"


def test_draft_to_target_follows_the_buffers():
    """The known CUDA failure: an index made elsewhere (an arange on the CPU) must be moved
    to the mapping's device rather than added to a gather on another device."""
    cfg = tiny_draft_config()
    draft = random_draft(cfg, dtype=torch.float32).to("meta")
    out = draft.draft_to_target(torch.arange(cfg.draft_vocab_size))
    assert out.device.type == "meta"
    assert draft.target_ids().device.type == "meta"


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["dense", "flex"])
def test_unroll_and_score_on_the_device(device, backend):
    """On CUDA (when there is one): unroll + score + backward with each backend, flex
    compiled, against the dense backend in fp32. On a CPU-only machine the same test runs
    on the CPU (flex without gradients there: torch has no CPU flex backward)."""
    cfg = tiny_draft_config(num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_size=64)
    draft = random_draft(cfg, seed=1, dtype=torch.float32).to(device).train()
    g = torch.Generator().manual_seed(1)
    seg = packed_segments([[40, 70, 20], [100]], 150).to(device)
    ids = torch.randint(0, cfg.vocab_size, seg.shape, generator=g).to(device)
    aux = torch.randn(*seg.shape, cfg.num_aux * cfg.target_hidden_size, generator=g).to(device)
    final = torch.randn(*seg.shape, cfg.target_hidden_size, generator=g).to(device)
    head = TargetHead(torch.randn(cfg.vocab_size, cfg.target_hidden_size, generator=g)).to(device)
    positions = torch.cat([torch.arange(n) for n in (40, 70, 20, 20)] + [torch.arange(100), torch.arange(50)]).view(
        2, 150
    )
    batch = {
        "input_ids": ids,
        "aux": aux,
        "final": final,
        "loss_mask": torch.ones_like(ids),
        "attention_mask": seg >= 0,
        "segment_ids": seg,
        "position_ids": positions.to(device),
    }

    def run(name):
        ttt = TTTConfig(length=3, attention=name)
        grad = device.type == "cuda" or name == "dense"
        draft.zero_grad()
        with torch.set_grad_enabled(grad):
            s = forward_batch(draft, head, batch, ttt, train=False)
            if grad:
                s.loss.backward()
        return s, {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}

    ref, ref_grad = run("dense")
    got, got_grad = run(backend)
    assert got.loss.device.type == device.type and got.correct.device.type == device.type
    assert math.isfinite(float(got.loss.detach()))
    torch.testing.assert_close(got.loss, ref.loss, rtol=1e-4, atol=1e-4)
    for name in got_grad:
        torch.testing.assert_close(got_grad[name], ref_grad[name], rtol=1e-3, atol=1e-4, msg=name)


@pytest.mark.gpu
def test_flex_memory_is_linear_in_sequence_length(device):
    """Flex forward + backward at a length where dense TTT scores alone would need more
    memory than the whole measured peak (CUDA); a short smoke run on the CPU."""
    t = 16384 if device.type == "cuda" else 64
    b, hq, hkv, d, steps = 1, 8, 2, 64, 3
    seg = packed_segments([[t // 2, t // 4, t // 8]], t).to(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    grad = device.type == "cuda"  # no CPU flex backward
    qs = [torch.randn(b, hq, t, d, device=device, dtype=dtype, requires_grad=grad) for _ in range(steps)]
    ks = [torch.randn(b, hkv, t, d, device=device, dtype=dtype, requires_grad=grad) for _ in range(steps)]
    vs = [torch.randn(b, hkv, t, d, device=device, dtype=dtype, requires_grad=grad) for _ in range(steps)]
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    with torch.set_grad_enabled(grad), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        state = make_ttt_attention(seg, "flex")
        outs = run_state(state, qs, ks, vs, hq // hkv)
        if grad:
            sum(o.float().sum() for o in outs).backward()
    assert all(torch.isfinite(o).all() for o in outs)
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        dense_scores = b * hq * t * t * 4  # one step's fp32 [B, H, T, T] scores
        assert peak < dense_scores / 4, (peak, dense_scores)
