import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eagle3.metrics import acceptance_one, assistant_spans, leading_correct
from eagle3.ttt import score_steps, shift_left, soft_cross_entropy, step_weights
from eagle3.vocab import build_draft_vocab, count_tokens, covered_fraction, target_to_draft


# --- draft vocabulary -----------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(vocab=st.integers(5, 60), dv=st.integers(1, 60), seed=st.integers(0, 1000))
def test_vocab_round_trip_and_conventions(vocab, dv, seed):
    dv = min(dv, vocab)
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 5, (vocab,), generator=g)
    v = build_draft_vocab(counts, dv, warn=lambda _m: None)
    target_ids = torch.arange(dv) + v.d2t
    assert v.t2d.sum() == dv
    assert torch.equal(target_ids, v.t2d.nonzero().flatten())  # same ids, ascending
    assert torch.equal(target_to_draft(target_ids, v.t2d), torch.arange(dv))
    missing = (~v.t2d).nonzero().flatten()
    assert (target_to_draft(missing, v.t2d) == -1).all()
    # Every chosen id is at least as frequent as every id left out (top-k by count).
    if missing.numel():
        assert counts[target_ids].min() >= counts[missing].max() or v.filled > 0


def test_vocab_keeps_most_frequent_and_breaks_ties_by_id():
    counts = torch.tensor([0, 5, 5, 9, 1, 0, 5])
    v = build_draft_vocab(counts, 3)
    assert v.target_ids.tolist() == [1, 2, 3]  # 9, then the two smallest ids among the 5s
    assert v.d2t.tolist() == [1, 1, 1]
    assert v.covered_fraction == pytest.approx(19 / 25)


def test_vocab_fills_deterministically_and_says_so():
    said = []
    counts = torch.zeros(10, dtype=torch.long)
    counts[7] = 3
    v = build_draft_vocab(counts, 4, warn=said.append)
    assert v.target_ids.tolist() == [0, 1, 2, 7]
    assert v.filled == 3 and "filled 3" in said[0]
    empty = build_draft_vocab(torch.zeros(10, dtype=torch.long), 4, warn=said.append)
    assert empty.target_ids.tolist() == [0, 1, 2, 3] and empty.covered_fraction == 0.0


def test_count_tokens_uses_loss_mask_and_refuses_out_of_vocab():
    ids = torch.tensor([[1, 2, 2, 3]])
    mask = torch.tensor([[0, 1, 1, 0]])
    assert count_tokens(ids, mask, 5).tolist() == [0, 0, 2, 0, 0]
    with pytest.raises(ValueError, match="outside 0..4"):
        count_tokens(torch.tensor([[9]]), torch.tensor([[1]]), 5)


def test_vocab_size_refused():
    with pytest.raises(ValueError, match="draft_vocab_size=0"):
        build_draft_vocab(torch.ones(4), 0)


# --- loss -----------------------------------------------------------------------------
def test_soft_cross_entropy_hand_computed():
    logits = torch.tensor([[math.log(1.0), math.log(3.0)]])  # q = [0.25, 0.75]
    p = torch.tensor([[0.5, 0.5]])
    want = -(0.5 * math.log(0.25) + 0.5 * math.log(0.75))
    assert soft_cross_entropy(logits, p).item() == pytest.approx(want, rel=1e-6)


class IdentityHeadDraft:
    """The hidden state *is* the logits; draft id i is target id i + 10."""

    def logits(self, h):
        return h

    def draft_to_target(self, ids):
        return ids + 10


def test_score_steps_hand_computed():
    # T=4, 2 steps, draft vocab 2. loss_mask [0,1,1,1]: step 0 scores rows 0,1 (x2, x3);
    # step 1 scores row 0 (x3).
    h0 = torch.log(torch.tensor([[[1.0, 1.0], [1.0, 3.0], [2.0, 1.0], [1.0, 1.0]]]))
    h1 = torch.log(torch.tensor([[[1.0, 4.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0]]]))
    probs = torch.tensor([[[0.9, 0.1], [0.2, 0.8], [0.6, 0.4], [0.5, 0.5]]])
    argmax = torch.tensor([[0, 10, 11, 10]])
    w = step_weights(torch.tensor([[0, 1, 1, 1]]), torch.ones(1, 4), 2)
    assert w[0, :, 0].tolist() == [1, 1, 0, 0] and w[0, :, 1].tolist() == [1, 0, 0, 0]
    s = score_steps(IdentityHeadDraft(), [h0, h1], probs, argmax, w, decay=0.8)
    # step 0: row 0 (q=[.5,.5]) vs target row 1 [.2,.8]; row 1 (q=[.25,.75]) vs row 2 [.6,.4]
    l0 = (-(0.2 * math.log(0.5) + 0.8 * math.log(0.5)) - (0.6 * math.log(0.25) + 0.4 * math.log(0.75))) / 2
    # step 1: row 0 (q=[.2,.8]) vs target row 2 [.6,.4]
    l1 = -(0.6 * math.log(0.2) + 0.4 * math.log(0.8))
    assert s.step_loss[0] == pytest.approx(l0, rel=1e-6)
    assert s.step_loss[1] == pytest.approx(l1, rel=1e-6)
    assert s.loss.item() == pytest.approx(l0 + 0.8 * l1, rel=1e-6)
    # accuracy: step 0 row 0 argmax is draft 0 (tie -> first) -> 10 == argmax[1]=10 yes;
    # row 1 argmax draft 1 -> 11 == argmax[2]=11 yes. step 1 row 0 -> 11 vs argmax[2]=11 yes.
    assert s.step_acc == [1.0, 1.0]


def test_shift_left():
    x = torch.tensor([[1, 2, 3, 4]])
    assert shift_left(x, 2).tolist() == [[3, 4, 0, 0]]
    assert shift_left(x, 0).tolist() == [[1, 2, 3, 4]]


# --- acceptance -----------------------------------------------------------------------
def test_leading_correct_and_spans():
    c = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    assert leading_correct(c, 4).tolist() == [2, 0, 4]
    assert leading_correct(c, 1).tolist() == [1, 0, 1]
    assert assistant_spans(torch.tensor([0, 1, 1, 0, 1])) == [(1, 3), (4, 5)]


def brute_force_walk(correct, mask, k):
    """Literal decoding story: target emits x_p, draft chain from row p-1, target verifies."""
    tokens = passes = 0
    m = mask.tolist()
    t = len(m)
    p = 0
    while p < t:
        if not m[p] or (p > 0 and m[p - 1]):
            p += 1
            continue
        end = p  # assistant turn [p, end)
        while end < t and m[end]:
            end += 1
        cur = max(p, 1)
        while cur < end - 1:
            accepted = 0
            while accepted < k and correct[cur - 1][accepted]:
                accepted += 1
            produced = 0
            for _ in range(accepted + 1):  # accepted drafts, then the target's own token
                if cur >= end - 1:
                    break
                cur += 1
                produced += 1
            tokens += produced
            passes += 1
        p = end
    return tokens, passes


@settings(max_examples=60, deadline=None)
@given(t=st.integers(3, 30), k=st.integers(1, 5), seed=st.integers(0, 10_000))
def test_walk_against_brute_force(t, k, seed):
    g = torch.Generator().manual_seed(seed)
    correct = torch.rand(t, 5, generator=g) < 0.7
    mask = (torch.rand(t, generator=g) < 0.7).long()
    mask[0] = 0
    acc = acceptance_one(correct, mask, t, k)
    tokens, passes = brute_force_walk(correct.tolist(), mask, k)
    assert (acc.tokens, acc.passes) == (tokens, passes)


def test_walk_hand_example_and_average_overestimates():
    # One turn over x_1..x_8; every row has 2 leading correct guesses with k=3.
    t = 9
    correct = torch.tensor([[1, 1, 0]] * t, dtype=torch.bool)
    mask = torch.tensor([0] + [1] * 8)
    acc = acceptance_one(correct, mask, t, 3)
    # p=1: gain 3 -> p=4: gain 3 -> p=7: remaining 1 -> gain 1. 7 tokens in 3 passes.
    assert (acc.tokens, acc.passes) == (7, 3)
    assert acc.walk == pytest.approx(7 / 3)
    # > walk: counts every row. Rows 0..5 count 1 + 2; row 6's second guess would be x_9,
    # past the text, so it counts 1 + 1.
    assert acc.per_position_average == pytest.approx(20 / 7)
    assert acc.per_slot_rate == [1.0, 1.0, 0.0]


def test_covered_fraction_is_the_share_of_counted_tokens_in_the_vocab():
    t2d = torch.tensor([True, False, True, False])
    counts = torch.tensor([3, 5, 1, 1])
    assert covered_fraction(t2d, counts) == pytest.approx(4 / 10)
    assert covered_fraction(t2d, torch.zeros(4, dtype=torch.long)) is None  # nothing counted: no figure


def test_the_vocab_stage_reports_how_much_of_the_heldout_answers_it_holds(corpus, tiny_target, tmp_path):
    """A ceiling on acceptance that training cannot lift, reported (never used to choose)."""
    from safetensors.torch import load_file

    from tests.helpers import cfg_for, corpus_rows, run_dir_with_corpus
    from workflows import vocab as vocab_stage
    from workflows.core.records import VocabSummary

    run_dir = run_dir_with_corpus(corpus, tmp_path)
    out = vocab_stage.run(cfg_for(tiny_target, run_dir, "draft.draft_vocab_size=16"))
    summary = VocabSummary.read(out / "vocab.json")
    t2d = load_file(str(out / "vocab.safetensors"))["t2d"]
    # The obvious count: every answer token of the held-out rows, in the vocab or not.
    held = [
        t for r in corpus_rows(run_dir) if r["split"] == "heldout" for t, m in zip(r["input_ids"], r["loss_mask"]) if m
    ]
    expected = sum(bool(t2d[t]) for t in held) / len(held)
    assert 0 < expected < 1  # 16 slots hold some of the held-out answers' tokens, not all
    assert summary.heldout_covered_fraction == pytest.approx(expected)
