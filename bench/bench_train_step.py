"""Draft training-step throughput: bf16 autocast vs fp32, same model and batch, one run.

    python -m bench.bench_train_step [--hidden 576 --vocab 49152 --draft-vocab 12288 --seq 256]

Prints tokens/s of each and the ratio bf16/fp32. The ratio differs by machine (1.55x on a
Xeon with AMX, far below 1 on CPUs without bf16 units), which is why `train.compute_dtype`
defaults to `auto`: measured at start-up (workflows.core.precision).
"""

from __future__ import annotations

import argparse
import time

import torch

from eagle3.draft_config import DraftConfig
from eagle3.modeling import Eagle3Draft
from eagle3.target_head import TargetHead
from eagle3.training import LoopConfig, PlainOptimizer, lr_at, train_step
from eagle3.ttt import TTTConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--draft-vocab", type=int, default=12288)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    cfg = DraftConfig(
        hidden_size=a.hidden,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        head_dim=a.hidden // a.heads,
        intermediate_size=a.intermediate,
        vocab_size=a.vocab,
        draft_vocab_size=a.draft_vocab,
        target_hidden_size=a.hidden,
        target_num_layers=30,
        capture_layer_ids=[1, 14, 26],
    )
    g = torch.Generator().manual_seed(0)
    b, t = a.batch, a.seq
    batch = {
        "input_ids": torch.randint(0, a.vocab, (b, t), generator=g),
        "loss_mask": torch.ones(b, t, dtype=torch.long),
        "attention_mask": torch.ones(b, t, dtype=torch.bool),
        "aux": torch.randn(b, t, 3 * a.hidden, generator=g).bfloat16(),
        "final": torch.randn(b, t, a.hidden, generator=g).bfloat16(),
    }
    head = TargetHead(torch.randn(a.vocab, a.hidden, generator=g) * 0.02)
    results = {}
    for dtype in ("float32", "bfloat16"):
        torch.manual_seed(0)
        draft = Eagle3Draft(cfg)
        loop = LoopConfig(steps=a.steps + 1, ttt=TTTConfig(length=a.ttt), compute_dtype=dtype)
        opt = PlainOptimizer(draft, loop.optim)
        train_step(opt, head, [batch], lr_at(0, loop.steps, loop.optim), loop)  # warm-up
        t0 = time.perf_counter()
        for s in range(a.steps):
            train_step(opt, head, [batch], lr_at(s + 1, loop.steps, loop.optim), loop)
        dt = (time.perf_counter() - t0) / a.steps
        results[dtype] = b * t / dt
        print(f"{dtype:9s} {dt:7.3f} s/step  {results[dtype]:9.1f} tokens/s")
    print(
        f"ratio bf16/fp32 tokens/s: {results['bfloat16'] / results['float32']:.2f}x (threads={torch.get_num_threads()})"
    )


if __name__ == "__main__":
    main()
