"""The weight average (`train.ema_decay`, eagle3.weight_average): its values against a slow
reference, the raw weights put back exactly, and the training loop stepping the same raw
weights with it as without it while evaluating and ending on the average."""

import dataclasses

import pytest
import torch

from eagle3.schema import ConfigError
from eagle3.training import LoopConfig, evaluate, train_in_memory
from eagle3.weight_average import WeightAverage
from tests.test_early_stop import fresh_draft, setup, weights


def reference_average(sequence: list[dict], decay: float) -> dict:
    """a_0 = w_0; a_n = d_n a_{n-1} + (1 - d_n) w_n with d_n = min(decay, (1 + n) / (10 + n))
    counting n from 0 at the first update: the textbook formula, in float64."""
    average = {n: w.double() for n, w in sequence[0].items()}
    for n, w in enumerate(sequence[1:]):
        d = min(decay, (1 + n) / (10 + n))
        average = {k: d * a + (1 - d) * w[k].double() for k, a in average.items()}
    return average


@pytest.mark.parametrize("decay", [0.5, 0.9, 0.999])
def test_the_average_follows_the_textbook_formula(decay):
    torch.manual_seed(0)
    module = torch.nn.Linear(5, 3)
    module.bias.requires_grad_(False)  # frozen: not averaged
    average = WeightAverage(module, decay)
    sequence = [{"weight": module.weight.detach().clone()}]
    for _ in range(40):
        with torch.no_grad():
            module.weight.add_(torch.randn_like(module.weight))
        average.update()
        sequence.append({"weight": module.weight.detach().clone()})
    want = reference_average(sequence, decay)["weight"]
    assert set(average.average) == {"weight"} and average.updates == 40
    torch.testing.assert_close(average.average["weight"].double(), want, rtol=0, atol=1e-5)
    assert not torch.allclose(average.average["weight"], module.weight)  # not just the last weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_average_is_applied_for_a_while_and_the_raw_weights_put_back_exactly(dtype):
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 4).to(dtype)
    average = WeightAverage(module, 0.9)
    with torch.no_grad():
        module.weight.mul_(3)
    average.update()
    raw = {n: p.detach().clone() for n, p in module.named_parameters()}
    with average.applied():
        assert torch.equal(module.weight, average.average["weight"].to(dtype))
        assert not torch.equal(module.weight, raw["weight"])
    for n, p in module.named_parameters():
        assert torch.equal(p, raw[n]), n
    with pytest.raises(RuntimeError), average.applied():  # put back on an error too
        raise RuntimeError
    assert torch.equal(module.weight, raw["weight"])


def test_a_decay_outside_0_1_and_a_foreign_average_are_refused():
    module = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="ema_decay=1"):
        WeightAverage(module, 1.0)
    with pytest.raises(ConfigError, match="train.ema_decay"):
        LoopConfig(steps=1, ema_decay=1.0).validate()
    average = WeightAverage(module, 0.9)
    with pytest.raises(ConfigError, match="'other'"):
        average.load_state_dict({"updates": 3, "average": {"weight": module.weight, "other": module.bias}})


def test_training_steps_the_same_raw_weights_and_evaluates_and_ends_on_their_average():
    """With ema_decay the loop's raw weights at every checkpoint equal a run without it, bit
    for bit; its evaluations are those of the average of those raw weights (the slow
    reference over every step's weights), and the draft ends holding that average."""
    target, batches, head, cfg = setup()
    cfg = dataclasses.replace(cfg, checkpoint_every=1, eval_every=5)
    runs = {}
    for decay in (0.0, 0.7):
        draft = fresh_draft(target, batches[0])
        raw = [weights(draft)]
        history = train_in_memory(
            draft,
            head,
            batches,
            dataclasses.replace(cfg, ema_decay=decay),
            batches,
            checkpoint=lambda done, best, last, loop, draft=draft, raw=raw: raw.append(weights(draft)),
        )
        runs[decay] = (raw, history, draft)
    (raw, plain_history, plain), (raw_ema, history, averaged) = runs[0.0], runs[0.7]
    assert len(raw) == len(raw_ema) == 11
    for before, after in zip(raw, raw_ema):
        assert all(torch.equal(before[n], after[n]) for n in before)
    want = reference_average(raw, 0.7)
    for n, w in weights(averaged).items():
        torch.testing.assert_close(w.double(), want[n], rtol=0, atol=1e-6)
    assert any(not torch.equal(w, weights(plain)[n]) for n, w in weights(averaged).items())
    assert history[-1]["eval"] == evaluate(averaged, head, batches, cfg)
    assert history[-1]["eval"] != plain_history[-1]["eval"]
