"""Packing: several samples in one row must train and score exactly as if each were alone.

The slow, obvious reference is the padded batch (one sample per row, `collate_samples`):
every per-step loss, every scored logit, the gradients and the acceptance of a packed
batch must equal it in fp64.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eagle3.metrics import acceptance, acceptance_one
from eagle3.target_features import collate_samples, first_fit, pack_samples
from eagle3.target_head import TargetHead
from eagle3.training import forward_batch
from eagle3.ttt import TTTConfig, step_weights, unroll
from tests.helpers import random_draft, tiny_draft_config


def make_samples(cfg, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        mask = (torch.rand(n, generator=g) < 0.8).long()
        mask[0] = 0  # a prompt token first, as in real data
        out.append(
            {
                "input_ids": torch.randint(0, cfg.vocab_size, (n,), generator=g),
                "loss_mask": mask,
                "aux": torch.randn(n, cfg.num_aux * cfg.target_hidden_size, generator=g, dtype=torch.float64),
                "final": torch.randn(n, cfg.target_hidden_size, generator=g, dtype=torch.float64),
            }
        )
    return out


def slow_first_fit(lengths, capacity):
    rows, room = [], []
    for i, n in enumerate(lengths):
        for r in range(len(rows)):
            if room[r] >= n:
                rows[r].append(i)
                room[r] -= n
                break
        else:
            rows.append([i])
            room.append(capacity - n)
    return rows


@settings(max_examples=100, deadline=None)
@given(lengths=st.lists(st.integers(1, 20), max_size=60), capacity=st.integers(20, 45))
def test_first_fit_is_greedy_first_fit(lengths, capacity):
    assert first_fit(lengths, capacity) == slow_first_fit(lengths, capacity)


def test_pack_samples_layout_and_truncation():
    cfg = tiny_draft_config()
    samples = make_samples(cfg, [5, 9, 3, 12, 4])
    said = pack_samples(samples, max_seq_len=10, pad_id=7, rows_per_batch=2)
    # First fit, capacity 10: 5 -> row 0; 9 -> row 1; 3 -> row 0 (2 left); the 12, cut to
    # 10 -> row 2; 4 fits nowhere (2, 1, 0 left) -> row 3.
    assert said.rows == [[0, 2], [1], [3], [4]]
    assert said.truncated == 1
    assert len(said.batches) == 2
    b0 = said.batches[0]
    assert b0["input_ids"].shape == (2, 9)  # padded to the batch's longest row (5 + 3 vs 9)
    assert b0["segment_ids"][0].tolist() == [0] * 5 + [1] * 3 + [-1]
    assert b0["position_ids"][0, :8].tolist() == list(range(5)) + list(range(3))
    assert b0["input_ids"][0, 8] == 7 and b0["loss_mask"][0, 8] == 0
    assert torch.equal(b0["input_ids"][0, 5:8], samples[2]["input_ids"])
    assert torch.equal(b0["aux"][0, 5:8], samples[2]["aux"]) and torch.equal(b0["final"][0, :5], samples[0]["final"])
    assert torch.equal(b0["attention_mask"], b0["segment_ids"] >= 0)
    b1 = said.batches[1]
    assert torch.equal(b1["input_ids"][0], samples[3]["input_ids"][:10])  # truncated, not dropped
    assert said.tokens == 5 + 9 + 3 + 10 + 4 and said.slots == 2 * 9 + 2 * 10
    assert said.pad_fraction == pytest.approx(1 - 31 / 38)
    # Deterministic.
    again = pack_samples(samples, max_seq_len=10, pad_id=7, rows_per_batch=2)
    assert again.rows == said.rows and all(torch.equal(a["aux"], b["aux"]) for a, b in zip(again.batches, said.batches))


def test_collate_emits_padded_layout_and_it_changes_nothing():
    cfg = tiny_draft_config()
    samples = make_samples(cfg, [7, 4, 6], seed=1)
    batch = collate_samples(samples)
    assert batch["segment_ids"].tolist()[1] == [0] * 4 + [-1] * 3
    assert batch["position_ids"].tolist()[1] == list(range(7))
    draft = random_draft(cfg, seed=1)
    head = TargetHead(torch.randn(cfg.vocab_size, cfg.target_hidden_size, dtype=torch.float64))
    ttt = TTTConfig(length=3, attention="dense")
    with torch.no_grad():
        with_ids = forward_batch(draft, head, batch, ttt, train=False)
        bare = {k: v for k, v in batch.items() if k not in ("segment_ids", "position_ids")}
        without = forward_batch(draft, head, bare, ttt, train=False)
    assert torch.equal(with_ids.step_loss_t, without.step_loss_t)
    assert torch.equal(with_ids.correct, without.correct)


def test_step_weights_stop_at_the_sample_boundary():
    loss = torch.ones(1, 7, dtype=torch.long)
    seg = torch.tensor([[0, 0, 0, 0, 1, 1, 1]])
    w = step_weights(loss, seg >= 0, 2, segment_ids=seg)
    # Row t step j predicts x_{t+2+j}: scored only when that token is in row t's sample.
    assert w[0, :, 0].tolist() == [1, 1, 0, 0, 1, 0, 0]
    assert w[0, :, 1].tolist() == [1, 0, 0, 0, 0, 0, 0]


def offsets(packing, lengths):
    """sample index -> (batch, row in batch, offset in row)."""
    per_batch = packing.batches[0]["input_ids"].shape[0]
    out = {}
    for r, members in enumerate(packing.rows):
        off = 0
        for i in members:
            out[i] = (r // per_batch, r % per_batch, off)
            off += lengths[i]
    return out


@pytest.mark.parametrize("backend", ["dense", "flex"])
@pytest.mark.parametrize("seed", [0, 1])
def test_packed_equals_padded(backend, seed):
    cfg = tiny_draft_config()
    draft = random_draft(cfg, seed=seed).train()
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 12, (7,), generator=g).tolist()
    samples = make_samples(cfg, lengths, seed=seed)
    head = TargetHead(torch.randn(cfg.vocab_size, cfg.target_hidden_size, generator=g, dtype=torch.float64))
    steps, k = 4, 3
    ttt = TTTConfig(length=steps, attention=backend)
    padded = collate_samples(samples)
    packing = pack_samples(samples, max_seq_len=20, rows_per_batch=2)
    assert len(packing.rows) < len(samples)  # something was actually packed
    where = offsets(packing, lengths)

    @torch.no_grad()  # gradients: test_packed_gradients_equal_padded (dense), test_attention_scale (flex)
    def run(batches):
        results = []
        for batch in batches:
            s = forward_batch(draft, head, batch, ttt, train=False)
            hiddens = unroll(
                draft,
                batch["input_ids"],
                batch["aux"],
                batch["attention_mask"],
                steps,
                position_ids=batch.get("position_ids"),
                segment_ids=batch.get("segment_ids"),
                attention=backend,
            )
            # Sums, not means: a packed batch splits the same scored positions differently.
            sums = s.step_loss_t * s.weights.sum((0, 1)).clamp_min(1)
            results.append((s, [draft.logits(h) for h in hiddens], sums))
        return results

    pad_res = run([padded])
    pack_res = run(packing.batches)
    # Every scored position of every sample: same weight, logits and hit, at every step.
    pad_s, pad_logits, pad_sums = pad_res[0]
    for i, n in enumerate(lengths):
        b, r, off = where[i]
        s, logits, _ = pack_res[b]
        w_pack, w_pad = s.weights[r, off : off + n], pad_s.weights[i, :n]
        assert torch.equal(w_pack, w_pad)
        scored = w_pad.bool()
        for j in range(steps):
            rows = scored[:, j]
            torch.testing.assert_close(
                logits[j][r, off : off + n][rows], pad_logits[j][i, :n][rows], rtol=1e-10, atol=1e-10
            )
            assert torch.equal(s.correct[r, off : off + n, j][rows], pad_s.correct[i, :n, j][rows])
    # The cross-entropy itself runs in fp32 (soft_cross_entropy), whatever the model's dtype.
    torch.testing.assert_close(sum(x[2] for x in pack_res), pad_sums, rtol=1e-6, atol=1e-6)
    # Acceptance: each packed sample walked on its own equals the padded walk.
    acc_pad = acceptance(pad_s.correct, padded["loss_mask"], padded["attention_mask"], k)
    acc_pack = None
    for (s, _, _), batch in zip(pack_res, packing.batches):
        a = acceptance(s.correct, batch["loss_mask"], batch["attention_mask"], k, segment_ids=batch["segment_ids"])
        acc_pack = a if acc_pack is None else acc_pack.merge(a)
    # (A random draft is rarely right; test_acceptance_of_a_packed_row_is_the_sum_of_its_samples
    # covers the walk on arbitrary hit patterns.)
    fields = ("tokens", "passes", "position_sum", "positions", "slots")
    assert [getattr(acc_pack, f) for f in fields] == [getattr(acc_pad, f) for f in fields]


def test_packed_gradients_equal_padded():
    """One loss over the same scored positions (all samples in one packed row vs one padded
    batch): the same function of the parameters, so the same gradients."""
    cfg = tiny_draft_config()
    draft = random_draft(cfg, seed=4).train()
    samples = make_samples(cfg, [6, 9, 4], seed=4)
    head = TargetHead(torch.randn(cfg.vocab_size, cfg.target_hidden_size, dtype=torch.float64))
    ttt = TTTConfig(length=3, attention="dense")
    grads = []
    packed = pack_samples(samples, max_seq_len=19)
    assert packed.rows == [[0, 1, 2]]
    for batch in (collate_samples(samples), packed.batches[0]):
        draft.zero_grad()
        s = forward_batch(draft, head, batch, ttt, train=False)
        s.loss.backward()
        grads.append({n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-9, atol=1e-12, msg=name)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 15), min_size=1, max_size=5),
    pad=st.integers(0, 4),
    k=st.integers(1, 4),
    seed=st.integers(0, 10_000),
)
def test_acceptance_of_a_packed_row_is_the_sum_of_its_samples(lengths, pad, k, seed):
    g = torch.Generator().manual_seed(seed)
    correct = [torch.rand(n, 4, generator=g) < 0.7 for n in lengths]
    masks = [(torch.rand(n, generator=g) < 0.7).long() for n in lengths]
    t = sum(lengths) + pad
    row_correct = torch.rand(1, t, 4, generator=g) < 0.5  # padding holds garbage
    row_mask = torch.zeros(1, t, dtype=torch.long)
    seg = torch.full((1, t), -1, dtype=torch.long)
    off = 0
    for i, n in enumerate(lengths):
        row_correct[0, off : off + n] = correct[i]
        row_mask[0, off : off + n] = masks[i]
        seg[0, off : off + n] = i
        off += n
    got = acceptance(row_correct, row_mask, seg >= 0, k, segment_ids=seg)
    want = None
    for c, m in zip(correct, masks):
        a = acceptance_one(c, m, len(m), k)
        want = a if want is None else want.merge(a)
    assert (got.tokens, got.passes, got.position_sum, got.positions) == (
        want.tokens,
        want.passes,
        want.position_sum,
        want.positions,
    )
    assert got.slots == want.slots
