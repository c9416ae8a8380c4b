"""The block draft's maths (eagle3.dflash) against slow, obvious references.

The reference runs one block at a time, the way a decoder meets it: the context is the
rows of the anchor's own sample up to the row before the anchor, the block is [anchor,
mask, ..., mask] at consecutive positions, and every layer attends over the concatenated
context and block keys with a plain softmax, no mask at all (everything it is given is
visible). The batched training pass (many blocks over packed rows, masks, anchors drawn
at random) must give the same logits, loss, gradients and per-row figures.
"""

import math
from dataclasses import asdict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eagle3.dflash.blocks import choose_anchors, context_visibility, score_blocks
from eagle3.dflash.config import DFlashConfig, DFlashSettings, evenly_spaced_layer_ids
from eagle3.dflash.drafter import DFlashDrafter
from eagle3.dflash.model import DFlashDraft, block_attention
from eagle3.modeling import apply_rotary, rotary_cos_sin
from eagle3.objectives import position_loss
from eagle3.schema import ConfigError
from eagle3.spec_decode import SpeculativeDecoder, greedy_decode
from eagle3.target_features import capture_batch
from eagle3.target_head import TargetHead
from eagle3.ttt import step_weights
from tests.helpers import tiny_draft_config, tiny_hf_llama

LAYERS = [1, 2, 3]


def tiny_dflash(seed: int = 0, block_size: int = 4, num_layers: int = 2, dtype=torch.float64, **over) -> DFlashDraft:
    cfg = DFlashConfig(
        hidden_size=24,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        num_layers=num_layers,
        vocab_size=97,
        draft_vocab_size=over.pop("draft_vocab_size", 97),
        target_hidden_size=24,
        target_num_layers=6,
        capture_layer_ids=LAYERS,
        block_size=block_size,
        mask_token_id=96,
        rope_theta=10000.0,
        **over,
    )
    return random_draft(DFlashDraft, cfg, seed, dtype)


def random_draft(model_class, cfg, seed: int, dtype):
    """`model_class(cfg)` with every weight random, norms near 1 (every part then matters)."""
    cfg.validate()
    torch.manual_seed(seed)
    draft = model_class(cfg)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else torch.randn_like(p) * 0.4)
        draft.embed_tokens.weight.copy_(torch.randn_like(draft.embed_tokens.weight))
    return draft.to(dtype).eval()


# ------------------------------------------------------------------ the slow reference
def reference_block(draft: DFlashDraft, aux_rows, anchor_token: int, start: int) -> torch.Tensor:
    """Pre-norm hidden states [S, H] of one block: context = aux_rows [n, n_aux * H_t] at
    positions start - n .. start - 1, the block at start .. start + S - 1."""
    c, d = draft.cfg, draft.cfg.head_dim
    n, s = aux_rows.shape[0], c.block_size
    ctx = draft.hidden_norm(draft.fc(aux_rows))
    ctx_pos = torch.arange(start - n, start)[None]
    blk_pos = torch.arange(start, start + s)[None]
    ids = torch.tensor([anchor_token] + [c.mask_token_id] * (s - 1))
    # DFlash's mask slots embed as its own mask_embedding; DSpark's as the target's mask row.
    mask = getattr(draft, "mask_embedding", draft.embed_tokens.weight[c.mask_token_id])
    h = torch.stack([draft.embed_tokens.weight[anchor_token]] + [mask] * (s - 1))
    assert torch.equal(draft.embed_block(ids), h) or anchor_token == c.mask_token_id
    group = c.num_attention_heads // c.num_key_value_heads

    def heads(x, proj, norm, pos):
        y = proj(x).view(x.shape[0], -1, d)  # [L, heads, D]
        if norm is None:
            return y.transpose(0, 1)
        y = norm(y).transpose(0, 1)[None]  # [1, heads, L, D]
        cos, sin = rotary_cos_sin(pos, d, c.rope_theta)
        return apply_rotary(y, cos, sin)[0]

    for layer in draft.layers:
        a = layer.self_attn
        x = layer.input_layernorm(h)
        q = heads(x, a.q_proj, a.q_norm, blk_pos)
        k = torch.cat([heads(ctx, a.k_proj, a.k_norm, ctx_pos), heads(x, a.k_proj, a.k_norm, blk_pos)], dim=1)
        v = torch.cat([heads(ctx, a.v_proj, None, None), heads(x, a.v_proj, None, None)], dim=1)
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), dim=-1) @ v  # [heads, S, D]
        h = h + a.o_proj(att.transpose(0, 1).reshape(s, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return h


def packed_batch(seed: int):
    """Two rows: two samples packed in the first (positions restart), one padded in the second."""
    g = torch.Generator().manual_seed(seed)
    t, h = 14, 3 * 24
    ids = torch.randint(0, 96, (2, t), generator=g)
    segments = torch.tensor([[0] * 8 + [1] * 6, [0] * 10 + [-1] * 4])
    positions = torch.tensor([list(range(8)) + list(range(6)), list(range(10)) + [0] * 4])
    loss_mask = (torch.rand(2, t, generator=g) > 0.3).long() * (segments >= 0)
    return {
        "input_ids": ids,
        "loss_mask": loss_mask,
        "attention_mask": segments >= 0,
        "position_ids": positions,
        "segment_ids": segments,
        "aux": torch.randn(2, t, h, generator=g, dtype=torch.float64),
        "final": torch.randn(2, t, 24, generator=g, dtype=torch.float64),
    }


def runs_of(segments: list[int]) -> dict[int, tuple[int, int]]:
    out = {}
    for i, s in enumerate(segments):
        if s >= 0:
            a, _ = out.get(s, (i, i))
            out[s] = (a, i + 1)
    return out


# ------------------------------------------------------------------ attention and visibility
@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=4), st.integers(0, 3), st.data())
def test_visibility_is_the_anchor_rows_own_sample_up_to_it(lengths, pad, data):
    segments = torch.tensor([[k for k, n in enumerate(lengths) for _ in range(n)] + [-1] * pad])
    t = segments.shape[1]
    rows = torch.tensor([data.draw(st.lists(st.integers(0, t - 1), min_size=1, max_size=5))])
    got = context_visibility(rows, segments)[0]
    seg = segments[0].tolist()
    for n, r in enumerate(rows[0].tolist()):
        for j in range(t):
            want = seg[r] >= 0 and seg[j] == seg[r] and j <= r
            assert bool(got[n, j]) == want, (seg, r, j)


@pytest.mark.parametrize("seed", [0, 1])
def test_block_attention_is_softmax_over_visible_context_and_own_block(seed):
    g = torch.Generator().manual_seed(seed)
    b, h, n, s, t, d = 2, 3, 4, 3, 7, 5
    q, kb, vb = (torch.randn(b, h, n, s, d, generator=g, dtype=torch.float64) for _ in range(3))
    kc, vc = (torch.randn(b, h, t, d, generator=g, dtype=torch.float64) for _ in range(2))
    visible = torch.rand(b, n, t, generator=g) > 0.4
    got = block_attention(q, kb, vb, kc, vc, visible)
    for bi in range(b):
        for ni in range(n):
            ctx = visible[bi, ni].nonzero().flatten()
            keys = torch.cat([kc[bi][:, ctx], kb[bi, :, ni]], dim=1)  # [h, |ctx| + s, d]
            values = torch.cat([vc[bi][:, ctx], vb[bi, :, ni]], dim=1)
            want = torch.softmax(q[bi, :, ni] @ keys.transpose(-1, -2) / math.sqrt(d), -1) @ values
            torch.testing.assert_close(got[bi, :, ni], want, rtol=1e-12, atol=1e-12)


def test_anchors_drawn_are_eligible_distinct_and_at_most_the_limit():
    eligible = torch.tensor([[True, False, True, True, True, False], [False] * 6, [True] + [False] * 5])
    rows, valid = choose_anchors(eligible, 2, torch.Generator().manual_seed(0))
    assert valid.tolist() == [[True, True], [False, False], [True, False]]
    picked = rows[0].tolist()
    assert picked == sorted(picked) and len(set(picked)) == 2 and all(eligible[0, r] for r in picked)
    assert rows[2, 0] == 0
    every, valid = choose_anchors(eligible, None, None)
    assert every[0].tolist() == [0, 2, 3, 4] and valid.sum() == 5


# ------------------------------------------------------------------ the training pass
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_training_pass_equals_a_block_at_a_time(seed):
    """Loss, gradients, accuracy and per-row hits of score_blocks (every scored row an
    anchor, packed and padded rows) against the reference run block by block."""
    draft = tiny_dflash(seed, block_size=4)
    batch = packed_batch(seed)
    head = TargetHead(torch.randn(97, 24, generator=torch.Generator().manual_seed(seed + 9), dtype=torch.float64))
    probs, best = head(batch["final"], draft.target_ids())
    length = draft.cfg.block_size - 1
    weights = step_weights(batch["loss_mask"], batch["attention_mask"], length, segment_ids=batch["segment_ids"])
    decay = 0.7
    scores = score_blocks(draft, probs, best, weights, batch, batch["aux"], decay=decay, chunk=3)
    grads = torch.autograd.grad(
        scores.loss, [draft.fc.weight, draft.mask_embedding, draft.layers[1].mlp.up_proj.weight]
    )

    numerators = [0.0] * length
    counts = [0.0] * length
    hits = [0.0] * length
    for b in range(2):
        for s, (lo, hi) in runs_of(batch["segment_ids"][b].tolist()).items():
            for t in range(lo, hi - 1):
                if weights[b, t, 0] == 0:
                    assert not scores.correct[b, t].any() and scores.weights[b, t].sum() == 0
                    continue
                anchor = t + 1
                hidden = reference_block(
                    draft, batch["aux"][b, lo:anchor], int(batch["input_ids"][b, anchor]), anchor - lo
                )
                logits = draft.logits(hidden[1:])
                for j in range(length):
                    w = float(weights[b, t, j])
                    if w == 0:
                        continue
                    loss, _ = position_loss("soft_ce", torch.log_softmax(logits[j], -1), probs[b, t + 1 + j])
                    numerators[j] = numerators[j] + w * loss
                    counts[j] += w
                    hit = bool(logits[j].argmax() == best[b, t + 1 + j])
                    hits[j] += w * hit
                    assert bool(scores.correct[b, t, j]) == hit
    want = sum(decay**j * numerators[j] / counts[j] for j in range(length))
    torch.testing.assert_close(scores.loss, want, rtol=1e-10, atol=1e-10)
    assert scores.step_acc == pytest.approx([h / c for h, c in zip(hits, counts)])
    want_grads = torch.autograd.grad(want, [draft.fc.weight, draft.mask_embedding, draft.layers[1].mlp.up_proj.weight])
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_training_draws_its_anchors_and_scores_only_them():
    draft = tiny_dflash(3, block_size=3)
    batch = packed_batch(3)
    head = TargetHead(torch.randn(97, 24, dtype=torch.float64))
    probs, best = head(batch["final"], draft.target_ids())
    weights = step_weights(batch["attention_mask"], batch["attention_mask"], 2, segment_ids=batch["segment_ids"])
    full = score_blocks(draft, probs, best, weights, batch, batch["aux"], decay=1.0)
    some = score_blocks(
        draft,
        probs,
        best,
        weights,
        batch,
        batch["aux"],
        decay=1.0,
        anchors=3,
        generator=torch.Generator().manual_seed(0),
    )
    chosen = some.weights[..., 0] > 0
    assert chosen.sum(-1).tolist() == [3, 3]
    # Where a block was drawn it is the same block as in the full pass.
    assert torch.equal(some.correct[chosen], full.correct[chosen])
    assert torch.equal(some.weights[chosen], full.weights[chosen])
    assert not some.correct[~chosen].any()


# ------------------------------------------------------------------ decoding
def test_drafter_proposes_the_argmax_of_the_reference_block():
    draft = tiny_dflash(4, block_size=5)
    g = torch.Generator().manual_seed(4)
    aux = torch.randn(9, 72, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, 96, (9,), generator=g).tolist()
    drafter = DFlashDrafter(draft)
    drafter.commit(tokens[:5], aux[:5])  # committed in two rounds: the cache grows as decoding's
    drafter.commit(tokens[5:], aux[5:])
    for k in (4, 2):  # fewer slots than trained: the block the decoder is asked for
        tree = drafter.propose(k, 1, k + 1)
        ref_draft = tiny_dflash(4, block_size=k + 1)
        hidden = reference_block(ref_draft, aux, tokens[-1], 9)
        assert tree.tokens == draft.draft_to_target(draft.logits(hidden[1:]).argmax(-1)).tolist()
        assert tree.parents == list(range(-1, k - 1)) and tree.depths == list(range(1, k + 1))
    with pytest.raises(ValueError, match="one chain per pass"):
        drafter.propose(3, 2, 6)


def test_reference_decoder_with_a_block_draft_is_greedy_decoding():
    target = tiny_hf_llama(dtype=torch.float64)
    draft = tiny_dflash(5, block_size=5)
    draft.load_target_embeddings(target.get_input_embeddings().weight)
    decoder = SpeculativeDecoder(target, DFlashDrafter(draft), LAYERS, num_steps=4)
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        prompt = torch.randint(0, 96, (6,), generator=g).tolist()
        res = decoder.generate(prompt, 14)
        ref, _ = greedy_decode(target, prompt, 14)
        assert res.tokens == ref and res.target_forwards >= 1


def greedy_answers():
    """A tiny float32 target, six rows of its greedy answers (14 tokens after 5 prompt
    tokens) and their captured states in two batches of three."""
    target = tiny_hf_llama(dtype=torch.float32, seed=3)
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(6):
        prompt = torch.randint(0, 96, (5,), generator=g).tolist()
        answer, _ = greedy_decode(target, prompt, 14)
        rows.append({"id": str(i), "input_ids": prompt + answer, "loss_mask": [0] * 5 + [1] * 14})
    batches = [
        capture_batch(
            target, [r["input_ids"] for r in rows[i : i + 3]], [r["loss_mask"] for r in rows[i : i + 3]], LAYERS
        )
        for i in (0, 3)
    ]
    return target, rows, batches


def test_offline_walk_of_blocks_equals_decoding():
    """A draft that has learnt the target's answers: the walk over the stored answers, block
    by block, is exactly what the reference decoder then accepts (the same blocks over the
    same context)."""
    from workflows.evaluate.decoding import decode_all, offline_acceptance

    target, rows, batches = greedy_answers()
    torch.manual_seed(6)
    draft = DFlashDraft(tiny_dflash(block_size=5).cfg)  # torch's own initialisation
    draft.load_target_embeddings(target.get_input_embeddings().weight)
    head = TargetHead(target.lm_head.weight)
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-2)
    draft.train()
    for step in range(200):
        b = batches[step % 2]
        probs, best = head(b["final"], draft.target_ids())
        w = step_weights(b["attention_mask"], b["attention_mask"], 4)
        loss = score_blocks(draft, probs, best, w, b, b["aux"], decay=0.8).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    draft.eval()
    groups = [rows[:3], rows[3:]]
    offline, per_row = offline_acceptance(draft, head, groups, batches, k=3)
    dec = decode_all(target, draft, rows, LAYERS, num_steps=3, topk=1, num_draft_tokens=None, eos=[])
    assert dec["lossless"]
    assert offline.walk > 1.5  # it learnt something, so the equality below means something
    assert [(a.tokens, a.passes) for a in per_row] == [(p["gained"], p["passes"]) for p in dec["per_row"]]
    assert dec["per_position_acceptance"] == pytest.approx(offline.per_slot_rate)


# ------------------------------------------------------------------ configuration
def test_evenly_spaced_ids_follow_dflash_recipe():
    assert evenly_spaced_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B in the DFlash paper
    assert evenly_spaced_layer_ids(30, 5) == [1, 8, 14, 21, 27]
    assert evenly_spaced_layer_ids(6, 5) == [1, 2, 3]  # fewer layers than ids: what there is
    with pytest.raises(ConfigError, match="at least 4 layers"):
        evenly_spaced_layer_ids(3, 2)


def test_mask_token_is_outside_the_draft_vocabulary_unless_set():
    t2d = torch.zeros(10, dtype=torch.bool)
    t2d[[0, 1, 2, 9]] = True
    assert DFlashSettings().mask_id(t2d) == 8
    assert DFlashSettings(mask_token_id=3).mask_id(t2d) == 3
    assert DFlashSettings().mask_id(torch.ones(10, dtype=torch.bool)) == 9


def test_config_refuses_what_a_block_draft_cannot_do():
    from workflows.core.config import compose

    cfg = compose(["target=tiny", "draft=dflash"])
    assert cfg.draft.family == "dflash" and cfg.evaluate.num_steps == 7 == cfg.train.acceptance_k
    assert cfg.draft_capture_ids == [1, 2, 3] == cfg.store_capture_ids
    both = compose(["target=tiny", "draft=dflash", "capture.families=[eagle3,dflash]"])
    assert both.store_capture_ids == [0, 1, 2, 3, 4] and both.draft_capture_ids == [1, 2, 3]
    refusals = [
        (["evaluate.num_steps=8"], r"evaluate.num_steps=8 exceeds the 7 draft tokens of a block"),
        (["evaluate.topk=2", "evaluate.num_draft_tokens=6"], r"one chain per pass"),
        (["draft.fc_norm=true"], r"draft.fc_norm=true is an EAGLE-3 option"),
        (
            ["draft.dflash.target_layer_ids=[1,6]"],
            r"draft.dflash.target_layer_ids\[1\]=6 is out of range for a 6-layer",
        ),
        (["train.objective.weighting=chain"], r"EAGLE-3 options"),
        (["capture.families=[eagle3,medusa]"], r"capture.families\[1\]='medusa' is not a draft family"),
    ]
    for extra, message in refusals:
        with pytest.raises(ConfigError, match=message):
            compose(["target=tiny", "draft=dflash", *extra])


def test_a_draft_folder_says_its_family():
    from eagle3.families import config_from_dict

    cfg = tiny_dflash().cfg
    assert type(config_from_dict(asdict(cfg))) is DFlashConfig
    legacy = {k: v for k, v in asdict(tiny_draft_config()).items() if k != "family"}
    assert config_from_dict(legacy).family == "eagle3"  # folders written before families
    with pytest.raises(ConfigError, match=r"family='medusa' is not a draft family"):
        config_from_dict({**asdict(cfg), "family": "medusa"})


# ------------------------------------------------------------------ flex (the GPU path) against dense
def block_batch_scores(draft, batch, backend: str):
    head = TargetHead(torch.randn(97, 24, generator=torch.Generator().manual_seed(7), dtype=draft.fc.weight.dtype))
    head = head.to(batch["aux"].device)
    probs, best = head(batch["final"], draft.target_ids())
    weights = step_weights(batch["attention_mask"], batch["attention_mask"], 3, segment_ids=batch["segment_ids"])
    return score_blocks(draft, probs, best, weights, batch, batch["aux"], decay=0.8, attention=backend)


def test_flex_blocks_equal_dense_outputs_and_gradients():
    """The block-sparse flex mask (every block over [context | all blocks' keys]) gives the
    dense two-part attention's loss and gradients, packed and padded rows, grouped heads."""
    from tests.test_attention_scale import cpu_flex_backward

    draft = tiny_dflash(8, block_size=4)
    batch = packed_batch(8)
    dense = block_batch_scores(draft, batch, "dense")
    grads = torch.autograd.grad(dense.loss, [draft.fc.weight, draft.layers[0].self_attn.k_proj.weight])
    with cpu_flex_backward():
        flex = block_batch_scores(draft, batch, "flex")
        flex_grads = torch.autograd.grad(flex.loss, [draft.fc.weight, draft.layers[0].self_attn.k_proj.weight])
    torch.testing.assert_close(flex.loss, dense.loss, rtol=1e-10, atol=1e-10)
    assert torch.equal(flex.correct, dense.correct)
    for a, b in zip(flex_grads, grads):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


@pytest.mark.gpu
def test_block_training_on_the_device(device):
    """On CUDA (when there is one) the block draft trains with flex, compiled, on the
    device, against dense in fp32; on a CPU-only machine the same on the CPU, dense both."""
    draft = tiny_dflash(9, block_size=4, dtype=torch.float32).to(device).train()
    batch = {k: v.to(device) for k, v in packed_batch(9).items()}
    batch["aux"], batch["final"] = batch["aux"].float(), batch["final"].float()
    auto = block_batch_scores(draft, batch, "auto")
    auto.loss.backward()
    grad = draft.fc.weight.grad.clone()
    draft.zero_grad()
    dense = block_batch_scores(draft, batch, "dense")
    dense.loss.backward()
    assert auto.loss.device.type == device.type and auto.correct.device.type == device.type
    torch.testing.assert_close(auto.loss, dense.loss, rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(grad, draft.fc.weight.grad, rtol=2e-3, atol=2e-4)
