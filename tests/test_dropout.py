"""`train.dropout`: residual dropout in the draft layer, drawn from the training generator.
Checked against a slow, obvious reference (masks applied by hand to the attention's and
the MLP's outputs), off outside training, and refused outside [0, 1)."""

import copy

import pytest
import torch
from torch import nn

from eagle3.schema import ConfigError
from eagle3.training import LoopConfig
from eagle3.ttt import unroll
from tests.helpers import random_draft, tiny_draft_config


class DroppedByHand(nn.Module):
    """`inner`'s output times a keep mask of probability 1-p, scaled by 1/(1-p)."""

    def __init__(self, inner: nn.Module, p: float, generator: torch.Generator):
        super().__init__()
        self.inner, self.p, self.generator = inner, p, generator

    def forward(self, *args):
        y = self.inner(*args)
        keep = (torch.rand(y.shape, generator=self.generator) >= self.p).to(y.dtype)
        return y * keep / (1 - self.p)


def inputs(cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=g)
    aux = torch.randn(2, 9, cfg.target_hidden_size * 3, generator=g, dtype=torch.float64)
    return ids, aux, torch.ones(2, 9, dtype=torch.long)


def run(draft, ids, aux, mask, length=3):
    return unroll(draft, ids, aux, mask, length, attention="dense")


def test_dropout_drops_the_layers_two_residual_branches_as_the_reference_does():
    cfg = tiny_draft_config()
    draft, ids, aux, mask = random_draft(cfg).train(), *inputs(cfg)
    reference = copy.deepcopy(draft)
    p = 0.3
    draft.midlayer.dropout = (p, torch.Generator().manual_seed(7))
    by_hand = torch.Generator().manual_seed(7)
    reference.midlayer.self_attn = DroppedByHand(reference.midlayer.self_attn, p, by_hand)
    reference.midlayer.mlp = DroppedByHand(reference.midlayer.mlp, p, by_hand)
    got, want = run(draft, ids, aux, mask), run(reference, ids, aux, mask)
    for j, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=f"TTT step {j}")
    undropped = copy.deepcopy(draft)
    undropped.midlayer.dropout = None
    assert not torch.allclose(got[0], run(undropped, ids, aux, mask)[0])  # the masks changed the states


def test_dropout_is_off_outside_training_and_at_probability_zero():
    cfg = tiny_draft_config()
    draft, ids, aux, mask = random_draft(cfg), *inputs(cfg)
    want = run(draft, ids, aux, mask)  # eval mode, no dropout set
    draft.midlayer.dropout = (0.5, torch.Generator().manual_seed(0))
    for a, b in zip(run(draft.eval(), ids, aux, mask), want):  # evaluate()/decoding: eval mode
        assert torch.equal(a, b)
    draft.train().midlayer.dropout = (0.0, torch.Generator().manual_seed(0))
    for a, b in zip(run(draft, ids, aux, mask), want):
        assert torch.equal(a, b)


def test_dropout_keeps_the_expected_value_of_each_branch():
    layer = random_draft(tiny_draft_config()).train().midlayer
    layer.dropout = (0.25, torch.Generator().manual_seed(3))
    x = torch.ones(400, 500, dtype=torch.float64)
    y = layer.drop(x)
    assert set(torch.unique(y).tolist()) == {0.0, 1 / 0.75}
    assert float((y == 0).double().mean()) == pytest.approx(0.25, abs=0.005)
    assert float(y.mean()) == pytest.approx(1.0, abs=0.01)


@pytest.mark.parametrize("p", [1.0, -0.1])
def test_a_dropout_outside_zero_to_one_is_refused_by_name(p):
    with pytest.raises(ConfigError, match=r"train\.dropout"):
        LoopConfig(steps=1, dropout=p).validate()
