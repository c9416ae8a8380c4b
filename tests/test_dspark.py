"""The DSpark draft's maths (eagle3.dspark) against slow, obvious references.

The references run one block at a time, as a decoder meets it (tests.test_dflash's
`reference_block`: context up to the row before the anchor, [anchor, mask, ..] at consecutive
positions, plain softmax attention), then apply the heads by hand: slot i's logits are
lm_head(norm(h_i)) + markov_w2(markov_w1[prev_i]) with prev_0 the anchor and prev_i the
previous slot's token (the text's in training, the draft's own guess in drafting), and its
confidence sigmoid(proj([norm(h_i), markov_w1[prev_i]])).
"""

import json
from dataclasses import asdict

import pytest
import torch
import torch.nn.functional as F

from eagle3.dspark.config import DSparkConfig, DSparkSettings
from eagle3.dspark.drafter import DSparkDrafter
from eagle3.dspark.model import DSparkDraft
from eagle3.families import family_named
from eagle3.objectives import ObjectiveConfig
from eagle3.schema import ConfigError
from eagle3.spec_decode import SpeculativeDecoder, greedy_decode
from eagle3.target_head import TargetHead
from eagle3.ttt import TTTConfig, step_weights
from tests.helpers import tiny_hf_llama
from tests.test_dflash import LAYERS, greedy_answers, packed_batch, random_draft, reference_block, runs_of, tiny_dflash

OBJECTIVE = ObjectiveConfig()


def tiny_dspark(seed: int = 0, block_size: int = 4, rank: int = 8, dtype=torch.float64, **over) -> DSparkDraft:
    """A DSpark draft with every weight random (the Markov head's too, so it matters)."""
    base = {k: v for k, v in asdict(tiny_dflash(seed, block_size=block_size).cfg).items() if k != "family"}
    cfg = DSparkConfig(**{**base, **over}, markov_rank=rank)
    return random_draft(DSparkDraft, cfg, seed, dtype)


def heads_by_hand(draft: DSparkDraft, hidden: torch.Tensor, prev: list[int]):
    """(logits [S, Vd], confidence logits [S]) of one block's slots, written out."""
    normed = draft.norm(hidden)
    w1 = draft.markov_head.markov_w1.weight[torch.tensor(prev)]
    logits = normed @ draft.lm_head.weight.T + w1 @ draft.markov_head.markov_w2.weight.T
    proj = draft.confidence_head.proj
    conf = torch.cat([normed, w1], -1) @ proj.weight[0] + proj.bias[0]
    return logits, conf


# ------------------------------------------------------------------ the training pass
@pytest.mark.parametrize("seed", [0, 1])
def test_training_pass_equals_a_block_at_a_time(seed):
    """Loss (the paper's three terms), gradients, accuracy and per-row hits of the DSpark
    pass against the reference run block by block, on packed and padded rows."""
    draft = tiny_dspark(seed, block_size=3, ce_weight=0.3, l1_weight=0.6, confidence_weight=0.8)
    cfg = draft.cfg
    batch = packed_batch(seed)
    head = TargetHead(torch.randn(97, 24, generator=torch.Generator().manual_seed(seed + 9), dtype=torch.float64))
    probs, best = head(batch["final"], draft.target_ids())
    length = cfg.block_size  # every slot guesses
    weights = step_weights(batch["loss_mask"], batch["attention_mask"], length, segment_ids=batch["segment_ids"])
    decay = 0.7
    family = family_named("dspark")
    ttt = TTTConfig()
    from eagle3.dflash.blocks import score_blocks
    from eagle3.dspark.blocks import dspark_slot_scores

    scores = score_blocks(
        draft, probs, best, weights, batch, batch["aux"], decay=decay, chunk=3, slot_scores=dspark_slot_scores
    )
    assert family.trained_steps(cfg, ttt) == length
    params = [draft.fc.weight, draft.markov_head.markov_w1.weight, draft.markov_head.markov_w2.weight]
    params += [draft.confidence_head.proj.weight, draft.layers[1].mlp.up_proj.weight]
    grads = torch.autograd.grad(scores.loss, params)

    numerators, counts, hits = [0.0] * length, [0.0] * length, [0.0] * length
    ids = batch["input_ids"]
    for b in range(2):
        for _, (lo, hi) in runs_of(batch["segment_ids"][b].tolist()).items():
            for t in range(lo, hi - 1):
                if weights[b, t, 0] == 0:
                    continue
                anchor = t + 1
                hidden = reference_block(draft, batch["aux"][b, lo:anchor], int(ids[b, anchor]), anchor - lo)
                prev = [int(ids[b, min(anchor + j, ids.shape[1] - 1)]) for j in range(length)]
                logits, conf = heads_by_hand(draft, hidden, prev)
                for j in range(length):
                    w = float(weights[b, t, j])
                    if w == 0:
                        continue
                    p = probs[b, t + 1 + j]
                    q = torch.softmax(logits[j], -1)
                    ce = -(p * torch.log_softmax(logits[j], -1)).sum()
                    l1 = (q - p).abs().sum()
                    accept = torch.minimum(p, q).sum().detach()
                    bce = F.binary_cross_entropy_with_logits(conf[j], accept)
                    term = cfg.ce_weight * ce + cfg.l1_weight * l1 + cfg.confidence_weight * bce
                    numerators[j] = numerators[j] + w * term
                    counts[j] += w
                    hit = bool(logits[j].argmax() == best[b, t + 1 + j])
                    hits[j] += w * hit
                    assert bool(scores.correct[b, t, j]) == hit
    want = sum(decay**j * numerators[j] / counts[j] for j in range(length))
    torch.testing.assert_close(scores.loss, want, rtol=1e-10, atol=1e-10)
    assert scores.step_acc == pytest.approx([h / c for h, c in zip(hits, counts)])
    for a, b in zip(grads, torch.autograd.grad(want, params)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_the_markov_head_starts_at_zero_and_the_parallel_drafter():
    """A fresh draft's Markov bias is 0: its guesses are the backbone's argmaxes, whatever
    the previous tokens, so training starts from the parallel drafter (the paper's start)."""
    cfg = tiny_dspark(0).cfg
    torch.manual_seed(1)
    draft = DSparkDraft(cfg).double()
    hidden = torch.randn(5, 24, dtype=torch.float64)
    a, _ = draft.heads(hidden, torch.tensor([1, 2, 3, 4, 5]))
    b, _ = draft.heads(hidden, torch.tensor([9, 9, 9, 9, 9]))
    assert torch.equal(a, b) and torch.equal(a, draft.lm_head(draft.norm(hidden)))
    assert not hasattr(draft, "mask_embedding")  # vLLM's DSpark embeds the mask slots as the target's row


# ------------------------------------------------------------------ drafting
def test_drafter_chooses_token_by_token_with_the_markov_bias():
    draft = tiny_dspark(4, block_size=5)
    g = torch.Generator().manual_seed(4)
    aux = torch.randn(9, 72, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, 96, (9,), generator=g).tolist()
    drafter = DSparkDrafter(draft)
    drafter.commit(tokens[:4], aux[:4])
    drafter.commit(tokens[4:], aux[4:])
    for k in (5, 3):
        tree = drafter.propose(k, 1, k + 1)
        ref = tiny_dspark(4, block_size=k)
        hidden = reference_block(ref, aux, tokens[-1], 9)
        prev, want, conf = [tokens[-1]], [], []
        for i in range(k):  # the slot's logits need the token chosen before it
            logits, c = heads_by_hand(draft, hidden[i : i + 1], prev[-1:])
            want.append(int(draft.draft_to_target(logits.argmax(-1))))
            conf.append(float(torch.sigmoid(c[0].detach())))
            prev.append(want[-1])
        assert tree.tokens == want and tree.parents == list(range(-1, k - 1))
        assert drafter.confidences[-1] == pytest.approx(conf)
    # The Markov bias changes the chain: without it (w2 = 0) another chain is drafted.
    with torch.no_grad():
        draft.markov_head.markov_w2.weight.zero_()
    assert drafter.propose(5, 1, 6).tokens != drafter_tokens_first(tokens, aux)


def drafter_tokens_first(tokens, aux) -> list[int]:
    drafter = DSparkDrafter(tiny_dspark(4, block_size=5))
    drafter.commit(tokens, aux)
    return drafter.propose(5, 1, 6).tokens


def test_adaptive_cut_verifies_while_the_confidences_product_holds():
    draft = tiny_dspark(6, block_size=6)
    g = torch.Generator().manual_seed(6)
    aux = torch.randn(7, 72, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, 96, (7,), generator=g).tolist()
    full = DSparkDrafter(draft, verify_threshold=0.0)
    full.commit(tokens, aux)
    chain = full.propose(6, 1, 7).tokens
    survival = torch.tensor(full.confidences[-1]).cumprod(0)
    for threshold in [0.999, float(survival[2]), float(survival[4]) + 1e-12, 1e-9]:
        cut = DSparkDrafter(draft, verify_threshold=threshold)
        cut.commit(tokens, aux)
        tree = cut.propose(6, 1, 7)
        keep = max(1, int((survival >= threshold).sum()))
        assert tree.tokens == chain[:keep] and tree.depths == list(range(1, keep + 1)), threshold


@pytest.mark.parametrize("threshold", [0.0, 0.3])
def test_reference_decoder_with_a_dspark_draft_is_greedy_decoding(threshold):
    target = tiny_hf_llama(dtype=torch.float64)
    draft = tiny_dspark(5, block_size=5)
    draft.load_target_embeddings(target.get_input_embeddings().weight)
    decoder = SpeculativeDecoder(target, DSparkDrafter(draft, verify_threshold=threshold), LAYERS, num_steps=5)
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        prompt = torch.randint(0, 96, (6,), generator=g).tolist()
        res = decoder.generate(prompt, 14)
        ref, _ = greedy_decode(target, prompt, 14)
        assert res.tokens == ref
        assert res.drafted <= 5 * res.target_forwards and (threshold == 0) == (res.drafted == 5 * res.target_forwards)


# ------------------------------------------------------------------ configuration
def test_settings_refuse_what_dspark_cannot_do():
    with pytest.raises(ConfigError, match="markov_head_type='gated'"):
        DSparkSettings(markov_head_type="gated").validate()
    with pytest.raises(ConfigError, match="verify_threshold=1.5"):
        DSparkSettings(verify_threshold=1.5).validate()
    with pytest.raises(ConfigError, match="markov_rank"):
        DSparkSettings(markov_rank=0).validate()
    with pytest.raises(ConfigError, match="both 0"):
        tiny_dspark(0, ce_weight=0.0, l1_weight=0.0)
    with pytest.raises(ConfigError, match="family='dflash'.*DSparkConfig is family 'dspark'"):
        tiny_dspark(0, family="dflash")
    assert DSparkSettings().draft_tokens == 7 and DSparkSettings().block_size == 7  # the paper's block of 7


def test_offline_walk_of_dspark_blocks_equals_decoding():
    """A DSpark draft that has learnt the target's answers: the held-out walk (the training
    pass's guesses, the Markov head reading the text's previous token) is exactly what the
    reference decoder accepts drafting token by token (on greedy answers the text's previous
    token is the one an accepted guess chose)."""
    from workflows.evaluate.decoding import decode_all, offline_acceptance

    target, rows, batches = greedy_answers()
    torch.manual_seed(6)
    draft = DSparkDraft(tiny_dspark(block_size=4).cfg)  # torch's own initialisation, Markov head at 0
    draft.load_target_embeddings(target.get_input_embeddings().weight)
    head = TargetHead(target.lm_head.weight)
    family = family_named("dspark")
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-2)
    draft.train()
    for step in range(200):
        b = batches[step % 2]
        probs, best = head(b["final"], draft.target_ids())
        w = step_weights(b["attention_mask"], b["attention_mask"], 4)
        loss = family.score(draft, probs, best, w, b, b["aux"], TTTConfig(), OBJECTIVE, False, None).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    draft.eval()
    assert draft.markov_head.markov_w2.weight.abs().max() > 0  # the Markov head trained
    offline, per_row = offline_acceptance(draft, head, [rows[:3], rows[3:]], batches, k=4)
    dec = decode_all(target, draft, rows, LAYERS, num_steps=4, topk=1, num_draft_tokens=None, eos=[])
    assert dec["lossless"]
    assert offline.walk > 1.5  # it learnt something, so the equality below means something
    assert [(a.tokens, a.passes) for a in per_row] == [(p["gained"], p["passes"]) for p in dec["per_row"]]
    assert dec["per_position_acceptance"] == pytest.approx(offline.per_slot_rate)


# ------------------------------------------------------------------ export and the doctor
def test_the_dspark_export_is_vllms_layout_and_the_doctor_reads_it(tmp_path):
    """vLLM's Qwen3DSparkModel config (every slot a guess: sample_from_anchor; the heads named),
    the weights under vLLM's names without the shared embeddings and with no mask-embedding file
    (vLLM's DSpark embeds the mask slots as the target's row, as the draft trains them); the
    doctor agrees with the draft and names a shifted id, a head the config does not announce,
    and DFlash's fill-in layout."""
    from safetensors.torch import load_file, save_file

    from eagle3.dspark.export import ARCHITECTURE
    from workflows.core import wiring as doctor
    from workflows.core.draft_files import save_draft
    from workflows.export import export_dspark

    draft = tiny_dspark(0, block_size=4, draft_vocab_size=40, dtype=torch.float32)
    chosen = torch.arange(40) * 2
    t2d = torch.zeros(97, dtype=torch.bool)
    t2d[chosen] = True
    draft.set_vocab_mapping(chosen - torch.arange(40), t2d)
    save_draft(tmp_path / "draft", draft, {"capture_layer_ids": [1, 2, 3], "layer_id_convention": "output_of_layer"})
    out = export_dspark(tmp_path / "draft", tmp_path / "vllm", "float32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == [ARCHITECTURE] and cfg["sample_from_anchor"] is True
    assert cfg["dflash_config"] == {"mask_token_id": 96, "target_layer_ids": [1, 2, 3]}  # vLLM refuses more there
    assert (cfg["markov_rank"], cfg["markov_head_type"], cfg["enable_confidence_head"]) == (8, "vanilla", True)
    assert cfg["confidence_head_with_markov"] is True and cfg["block_size"] == 4
    weights = load_file(str(out / "model.safetensors"))
    assert not {"embed_tokens.weight", "t2d", "mask_embedding"} & set(weights)
    assert list(weights["markov_head.markov_w1.weight"].shape) == [97, 8]
    assert list(weights["markov_head.markov_w2.weight"].shape) == [40, 8]
    assert torch.equal(weights["confidence_head.proj.weight"], draft.confidence_head.proj.weight.detach())
    assert not (out / "mask_embedding.pt").exists()
    assert doctor.check([doctor.side_from_draft(tmp_path / "draft"), doctor.side_from_vllm_export(out)]) == []
    shifted = export_dspark(tmp_path / "draft", tmp_path / "shifted", "float32", target_layer_ids=[2, 3, 4])
    [error] = doctor.check([doctor.side_from_draft(tmp_path / "draft"), doctor.side_from_vllm_export(shifted)])
    assert error.startswith("capture_layer_ids:"), error
    cfg["enable_confidence_head"], cfg["sample_from_anchor"] = False, False
    (shifted / "config.json").write_text(json.dumps(cfg))
    errors = doctor.side_from_vllm_export(shifted).errors
    assert any("enable_confidence_head=False but the weights hold confidence_head.proj" in e for e in errors), errors
    assert any("sample_from_anchor=False" in e for e in errors), errors
    del weights["markov_head.markov_w1.weight"]
    save_file(weights, str(shifted / "model.safetensors"))
    assert any("markov_w1 is None" in e for e in doctor.side_from_vllm_export(shifted).errors)
