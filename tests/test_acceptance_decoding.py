"""Simulated acceptance vs. a literal chain-speculation decoder, and a learning check."""

import torch

from eagle3.attention import KVCache
from eagle3.draft_config import DraftConfig
from eagle3.metrics import acceptance
from eagle3.modeling import Eagle3Draft
from eagle3.target_features import capture_batch
from eagle3.target_head import TargetHead
from eagle3.training import LoopConfig, OptimConfig, evaluate, train_in_memory
from eagle3.ttt import NoiseConfig, TTTConfig
from eagle3.vocab import build_draft_vocab, count_tokens
from tests.helpers import tiny_hf_llama

LAYERS = [0, 2, 4]


def greedy_texts(model, n, prompt_len, new_tokens, seed):
    g = torch.Generator().manual_seed(seed)
    seqs, masks = [], []
    for _ in range(n):
        prompt = torch.randint(3, model.config.vocab_size, (1, prompt_len), generator=g)
        out = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        seqs.append(out[0].tolist())
        masks.append([0] * prompt_len + [1] * new_tokens)
    return seqs, masks


def make_draft(model, batch, draft_vocab):
    cfg = DraftConfig(
        hidden_size=24,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=6,
        intermediate_size=48,
        vocab_size=97,
        draft_vocab_size=draft_vocab,
        target_hidden_size=24,
        target_num_layers=6,
        capture_layer_ids=LAYERS,
    )
    draft = Eagle3Draft(cfg)
    draft.load_target_embeddings(model.get_input_embeddings().weight.float())
    v = build_draft_vocab(count_tokens(batch["input_ids"], batch["loss_mask"], 97), draft_vocab, warn=lambda m: None)
    draft.set_vocab_mapping(v.d2t, v.t2d)
    return draft


def chain_decode(draft, aux, text, span, k):
    """Brute force: run chain drafting with a KV cache; the text is the target's greedy output."""
    s, e = span
    fused = draft.fuse(aux[None])
    tokens = passes = 0
    p = max(s, 1)
    while p < e - 1:
        cache = KVCache()
        out = draft.step(torch.tensor([text[1 : p + 1]]), fused[:, :p], torch.arange(p)[None], cache)
        h = out[:, -1:]
        proposals = []
        for i in range(k):
            tok = draft.draft_to_target(draft.logits(h).argmax(-1))
            proposals.append(int(tok))
            if i + 1 < k:
                h = draft.step(tok.view(1, 1), h, torch.tensor([[p + i]]), cache)
        m = 0
        while m < k and p + 1 + m < len(text) and proposals[m] == text[p + 1 + m]:
            m += 1
        gain = min(m + 1, e - 1 - p)
        tokens += gain
        passes += 1
        p += gain
    return tokens, passes


def test_training_raises_acceptance_and_walk_matches_chain_decoding():
    torch.manual_seed(0)
    target = tiny_hf_llama(num_layers=6, hidden=24, vocab=97, dtype=torch.float64)
    seqs, masks = greedy_texts(target, 8, prompt_len=6, new_tokens=40, seed=1)
    batch = capture_batch(target, seqs, masks, LAYERS, dtype=torch.float32)
    head = TargetHead(target.lm_head.weight.float())
    draft = make_draft(target, batch, draft_vocab=64)
    cfg = LoopConfig(
        steps=100,
        ttt=TTTConfig(length=4, decay=0.8, noise=NoiseConfig(kind="gaussian", std=0.01)),
        optim=OptimConfig(lr=3e-3, warmup_steps=10),
        compute_dtype="float32",
        acceptance_k=3,
        log_every=150,
    )
    before = evaluate(draft, head, [batch], cfg)
    history = train_in_memory(draft, head, [batch], cfg)
    after = evaluate(draft, head, [batch], cfg)
    # The random target's own distributions are broad (entropy ~2.8 nats per step), so the
    # soft loss has a high floor; it must still fall clearly, and greedy agreement rise.
    assert history[-1]["loss"] < history[0]["loss"] - 0.8
    assert before["acceptance_walk"] < 1.1
    assert after["acceptance_walk"] > 1.5, after
    assert after["step_acc"][0] > 0.35, after

    # The walk over teacher-forced TTT outputs equals a literal chain decoder, sample by
    # sample (float64 on both sides so no argmax is decided by rounding).
    draft = draft.double().eval()
    head64 = TargetHead(target.lm_head.weight)
    batch64 = capture_batch(target, seqs, masks, LAYERS)
    with torch.no_grad():
        from eagle3.training import forward_batch

        scores = forward_batch(draft, head64, batch64, cfg.ttt, train=False)
        for i, (text, mask) in enumerate(zip(seqs, masks)):
            walk = acceptance(
                scores.correct[i : i + 1], batch64["loss_mask"][i : i + 1], batch64["attention_mask"][i : i + 1], k=3
            )
            span = (mask.index(1), len(mask))
            assert (walk.tokens, walk.passes) == chain_decode(draft, batch64["aux"][i], text, span, 3), i
