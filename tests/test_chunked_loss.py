"""The block-wise soft cross-entropy (eagle3.chunked_loss) against the plain path it
replaces: the same loss, argmax, acceptance rate and gradients (float64), on views of the
target's distribution as score_steps passes them, in blocks that do not divide the rows."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eagle3.chunked_loss import chunked_soft_ce
from eagle3.objectives import position_loss


def plain(x, weight, p):
    log_q = torch.log_softmax(x @ weight.T, dim=-1)
    loss, alpha = position_loss("soft_ce", log_q, p)
    return loss, (x @ weight.T).argmax(-1), alpha


@settings(max_examples=25, deadline=None)
@given(
    b=st.integers(1, 3),
    rows=st.integers(1, 40),
    h=st.integers(2, 12),
    vd=st.integers(2, 30),
    block=st.integers(1, 17),
    seed=st.integers(0, 10_000),
)
def test_chunked_soft_ce_equals_the_plain_path(b, rows, h, vd, block, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, rows, h, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vd, h, generator=g, dtype=torch.float64, requires_grad=True)
    # The target's distribution for every row of the batch, sliced as score_steps slices it
    # (rows 1+j onwards): a view that is not contiguous when b > 1.
    full = torch.softmax(torch.randn(b, rows + 2, vd, generator=g, dtype=torch.float64), -1)
    p = full[:, 2:]
    upstream = torch.rand(b, rows, generator=g, dtype=torch.float64)  # the step's position weights

    want = plain(x, weight, p)
    (want[0] * upstream).sum().backward()
    want_grads = x.grad.clone(), weight.grad.clone()
    x.grad = weight.grad = None
    got = chunked_soft_ce(x, weight, p, block)
    (got[0] * upstream).sum().backward()

    torch.testing.assert_close(got[0], want[0].float(), rtol=1e-6, atol=1e-6)  # the loss rows are fp32
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[2], want[2].float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, want_grads[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weight.grad, want_grads[1], rtol=1e-5, atol=1e-6)


def test_under_bf16_autocast_it_runs_the_matmuls_in_bf16_like_the_plain_path():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 50, 16, generator=g, requires_grad=True)
    lin = torch.nn.Linear(16, 40, bias=False)
    p = torch.softmax(torch.randn(1, 50, 40, generator=g), -1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = position_loss("soft_ce", torch.log_softmax(lin(x).float(), -1), p)[0]
        got = chunked_soft_ce(x, lin.weight, p, 7)[0]
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # the same bf16 logits, the same fp32 maths after
    got.sum().backward()
    assert x.grad.dtype == torch.float32 and lin.weight.grad.dtype == torch.float32


def test_only_the_loss_has_a_gradient():
    x = torch.randn(1, 4, 3, requires_grad=True)
    w = torch.randn(5, 3, requires_grad=True)
    loss, best, alpha = chunked_soft_ce(x, w, torch.full((1, 4, 5), 0.2), 2)
    assert loss.requires_grad and not best.requires_grad and not alpha.requires_grad
    with pytest.raises(RuntimeError):
        alpha.sum().backward()


def test_a_training_forward_with_blocks_equals_the_plain_one():
    """forward_batch (unroll + score_steps) with loss_block_rows: the loss, every step's
    figures and every parameter's gradient as without, padded rows and all (float64)."""
    from eagle3.objectives import ObjectiveConfig
    from eagle3.target_head import TargetHead
    from eagle3.training import forward_batch
    from eagle3.ttt import TTTConfig
    from tests.helpers import random_draft, tiny_draft_config

    cfg = tiny_draft_config()
    g = torch.Generator().manual_seed(3)
    attn = torch.ones(2, 30, dtype=torch.bool)
    attn[1, 21:] = False
    batch = {
        "input_ids": torch.randint(0, cfg.vocab_size, (2, 30), generator=g),
        "attention_mask": attn,
        "loss_mask": attn.long(),
        "aux": torch.randn(2, 30, 3 * cfg.target_hidden_size, generator=g).double(),
        "final": torch.randn(2, 30, cfg.target_hidden_size, generator=g).double(),
    }
    head = TargetHead(torch.randn(cfg.vocab_size, cfg.target_hidden_size, generator=g).double())
    runs = []
    for block in (0, 7):
        draft = random_draft(cfg, seed=0).train()
        s = forward_batch(
            draft,
            head,
            batch,
            TTTConfig(length=3, attention="dense"),
            train=False,
            objective=ObjectiveConfig(loss_block_rows=block),
        )
        s.loss.backward()
        runs.append((s, {n: p.grad for n, p in draft.named_parameters() if p.grad is not None}))
    (a, grads_a), (b, grads_b) = runs
    torch.testing.assert_close(b.loss, a.loss)
    assert torch.equal(b.correct, a.correct)
    torch.testing.assert_close(b.step_alpha_t, a.step_alpha_t.float())
    assert grads_a.keys() == grads_b.keys() and "lm_head.weight" in grads_b
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], msg=name)
