"""`train.objective.weighting=chain` (eagle3.objectives.chain_weights and score_steps)
against slow, obvious references: the expected accepted length of chain decoding, written
out position by position and step by step."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eagle3.objectives import ObjectiveConfig, chain_weights
from eagle3.schema import ConfigError
from eagle3.ttt import score_steps, step_weights
from tests.helpers import LogitDraft


def expected_accepted(c: list[float]) -> float:
    """Chain decoding: draft m is accepted when drafts 0..m all are."""
    total, reach = 0.0, 1.0
    for cm in c:
        reach *= cm
        total += reach
    return total


def slow_gradient(c: list[float], eps: float = 1e-6) -> list[float]:
    """d expected_accepted / d c_j by central differences (it is linear in each c_j)."""
    out = []
    for j in range(len(c)):
        up, down = list(c), list(c)
        up[j] += eps
        down[j] -= eps
        out.append((expected_accepted(up) - expected_accepted(down)) / (2 * eps))
    return out


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=8))
def test_chain_weights_are_the_gradient_of_the_expected_accepted_length(c):
    got = chain_weights(torch.tensor([c], dtype=torch.float64))[0].tolist()
    assert got == pytest.approx(slow_gradient(c), abs=1e-6)


def test_chain_weights_by_hand():
    # E = c0 + c0 c1 + c0 c1 c2. A sure miss at step 1 cuts off step 2 (reached with
    # chance 0) and leaves step 0 nothing to unlock; step 1 is reached half the time and,
    # when right, unlocks step 2's 0.9.
    got = chain_weights(torch.tensor([[0.5, 0.0, 0.9]])).tolist()[0]
    assert got == pytest.approx([1.0, 0.5 * 1.9, 0.0])
    # Certain hits: step j is reached always and unlocks the L-1-j steps after it.
    assert chain_weights(torch.ones(1, 4)).tolist()[0] == [4.0, 3.0, 2.0, 1.0]


def test_score_steps_weighs_each_position_by_its_chain_against_a_slow_reference():
    g = torch.Generator().manual_seed(0)
    T, L, V = 7, 3, 3
    hiddens = [torch.randn(1, T, V, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(L)]
    probs = torch.softmax(torch.randn(1, T, V, generator=g, dtype=torch.float64) * 2, -1)
    argmax = probs.argmax(-1) + 10
    argmax[0, 3] = 4  # the target's token at t=3 is outside the draft vocabulary
    loss_mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1]])
    w = step_weights(loss_mask, torch.ones(1, T), L)
    got = score_steps(LogitDraft(3), hiddens, probs, argmax, w, 0.8, ObjectiveConfig(weighting="chain"))

    # Row t's step j predicts position t+1+j: chance c = q_j(t)[the target's token there],
    # 0 where that token is outside the draft vocabulary or the step is not scored.
    def chance(t, j):
        label = t + 1 + j
        if label >= T or w[0, t, j] == 0 or argmax[0, label] == 4:
            return 0.0
        return float(torch.softmax(hiddens[j][0, t].detach(), -1)[int(argmax[0, label]) - 10])

    want = 0.0
    for j in range(L):
        scored = [t for t in range(T - 1 - j) if w[0, t, j] > 0]
        step = 0.0
        for t in scored:
            c = [chance(t, i) for i in range(L)]
            weight = slow_gradient(c)[j]
            ce = -sum(
                float(probs[0, t + 1 + j, v]) * math.log(float(torch.softmax(hiddens[j][0, t].detach(), -1)[v]))
                for v in range(V)
            )
            step += weight * ce
        want += step / len(scored)
    assert float(got.loss.detach()) == pytest.approx(want, rel=1e-6)
    # The reported per-step loss stays the plain mean, as under decay weighting.
    plain = score_steps(LogitDraft(3), hiddens, probs, argmax, w, 0.8)
    assert got.step_loss == pytest.approx(plain.step_loss, rel=1e-12)
    assert got.step_acc == plain.step_acc


def test_a_position_whose_first_guess_cannot_hit_trains_only_its_first_step():
    T, L, V = 5, 3, 3
    hiddens = [torch.zeros(1, T, V, dtype=torch.float64, requires_grad=True) for _ in range(L)]
    probs = torch.full((1, T, V), 1 / V, dtype=torch.float64)
    probs[..., 0] = 0.5
    probs[..., 1:] = 0.25
    argmax = torch.full((1, T), 10)
    argmax[0, 1] = 4  # row 0's step 0 (label at t=1) can never be accepted
    w = step_weights(torch.ones(1, T), torch.ones(1, T), L)
    loss = score_steps(LogitDraft(3), hiddens, probs, argmax, w, 0.8, ObjectiveConfig(weighting="chain")).loss
    grads = torch.autograd.grad(loss, hiddens)
    assert grads[0][0, 0].abs().sum() > 0  # step 0 of row 0 still learns
    assert grads[1][0, 0].abs().sum() == 0 and grads[2][0, 0].abs().sum() == 0
    assert grads[1][0, 1].abs().sum() > 0  # row 1's chain is open: its step 1 learns
    # Under decay weighting the unreachable chain's later steps are trained all the same.
    decayed = score_steps(LogitDraft(3), hiddens, probs, argmax, w, 0.8).loss
    assert torch.autograd.grad(decayed, hiddens[1])[0][0, 0].abs().sum() > 0


def test_chain_weighting_refuses_what_it_cannot_compute():
    with pytest.raises(ConfigError, match="objective.weighting='steps' is not 'decay' or 'chain'"):
        ObjectiveConfig(weighting="steps").validate()
    with pytest.raises(ConfigError, match="loss_block_rows=64 does not keep: set it to 0"):
        ObjectiveConfig(weighting="chain", loss_block_rows=64).validate()
