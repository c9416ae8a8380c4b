"""An exponential moving average of the draft's trained weights (issue 26).

With batch 1 and few samples, the weights of one step carry that step's noise: the
validation walk of a 10-epoch run moves by about 0.02 from one epoch to the next. The
average over the last few hundred steps is what evaluation, the best-walk choice and the
saved draft use when `train.ema_decay` > 0; training itself still steps the raw weights,
so a run with the average follows the same path as one without it, bit for bit.

After n updates the average is

    a_n = d_n a_{n-1} + (1 - d_n) w_n,    d_n = min(decay, n / (n + 9)),  a_0 = w_0

the warm-up of d_n letting the first steps' weights, far from trained, fade out quickly
rather than over 1 / (1 - decay) steps. The average is kept in fp32 on the weights'
device: one more copy of the draft (and, while evaluating, a second one of the raw
weights to put back).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from eagle3.schema import ConfigError


class WeightAverage:
    def __init__(self, module: torch.nn.Module, decay: float):
        if not 0 < decay < 1:
            raise ConfigError(f"ema_decay={decay} must lie in (0, 1): 0.999 averages over about 1000 steps")
        self.decay = decay
        self.params = {n: p for n, p in module.named_parameters() if p.requires_grad}
        self.average = {n: p.detach().float().clone() for n, p in self.params.items()}
        self.updates = 0

    def factor(self) -> float:
        """d_n of the next update."""
        n = self.updates + 1
        return min(self.decay, n / (n + 9))

    @torch.no_grad()
    def update(self) -> None:
        """Fold the current weights in: call once after each optimizer step."""
        d = self.factor()
        for name, p in self.params.items():
            self.average[name].lerp_(p.detach().float(), 1 - d)
        self.updates += 1

    @contextmanager
    def applied(self):
        """The averaged weights in the module for the duration (evaluating, saving), the
        raw ones put back exactly afterwards."""
        raw = {n: p.detach().clone() for n, p in self.params.items()}
        self.copy_to_module()
        try:
            yield
        finally:
            with torch.no_grad():
                for name, p in self.params.items():
                    p.copy_(raw[name])

    @torch.no_grad()
    def copy_to_module(self) -> None:
        """The averaged weights into the module, for good (the end of training)."""
        for name, p in self.params.items():
            p.copy_(self.average[name])

    def state_dict(self) -> dict:
        return {"updates": self.updates, "average": {n: a.clone() for n, a in self.average.items()}}

    def load_state_dict(self, state: dict) -> None:
        names = set(state["average"])
        if names != set(self.average):
            raise ConfigError(
                f"the saved weight average holds {sorted(names ^ set(self.average))} that this draft "
                "does not (or lacks them): resume with the draft settings it was trained with"
            )
        for name, tensor in state["average"].items():
            self.average[name].copy_(tensor)
        self.updates = int(state["updates"])
