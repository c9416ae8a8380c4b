"""Training throughput with packing vs padding, same samples, same draft, one run.

    python -m bench.bench_packing [--samples 40 --batch 4 --max-seq-len 2048 1024]

Sample lengths are drawn from a fixed seeded lognormal with mean ~200 tokens, clipped to
[16, 1024] (the shape of the default mixture's conversations). Padding = length-sorted
batches of `--batch` samples (what the train stage does without packing); packing =
`eagle3.target_features.pack_samples` into rows of each `--max-seq-len`, one row per
batch. Each layout trains one pass over the same samples (after one warm-up step), the
layouts taking turns; prints real (non-pad) training tokens/s, the pad fraction, and the
ratios to padding.

On the CPU the TTT attention is the dense backend, whose cost grows with T^2 per row: long
packed rows pay that; on CUDA the flex backend skips the blocks across samples.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from eagle3.draft_config import DraftConfig
from eagle3.modeling import Eagle3Draft
from eagle3.target_features import collate_samples, pack_samples
from eagle3.target_head import TargetHead
from eagle3.training import LoopConfig, PlainOptimizer, lr_at, train_step
from eagle3.ttt import TTTConfig


def lengths_like_default(n: int, seed: int, mean: float = 200.0, sigma: float = 0.8) -> list[int]:
    """Lognormal lengths with the given mean (before clipping), clipped to [16, 1024]."""
    g = torch.Generator().manual_seed(seed)
    mu = math.log(mean) - sigma**2 / 2  # E[exp(mu + sigma z)] = mean
    raw = torch.exp(mu + sigma * torch.randn(n, generator=g, dtype=torch.float64))
    return raw.round().clamp(16, 1024).long().tolist()


def make_samples(lengths: list[int], vocab: int, aux_width: int, hidden: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "input_ids": torch.randint(0, vocab, (n,), generator=g),
            "loss_mask": torch.ones(n, dtype=torch.long),
            "aux": torch.randn(n, aux_width, generator=g).bfloat16(),
            "final": torch.randn(n, hidden, generator=g).bfloat16(),
        }
        for n in lengths
    ]


def padded_batches(samples: list[dict], batch_size: int) -> list[dict]:
    order = sorted(range(len(samples)), key=lambda i: len(samples[i]["input_ids"]))
    return [collate_samples([samples[i] for i in order[s : s + batch_size]]) for s in range(0, len(order), batch_size)]


def measure(cfg: DraftConfig, head: TargetHead, layouts: dict[str, list[dict]], ttt: int) -> dict[str, float]:
    """Seconds of one pass of train steps over each layout's batches (after a warm-up step
    each). The layouts take turns batch by batch, so a machine whose load changes during
    the run (shared cores) slows them alike."""
    runs = {}
    for name, batches in layouts.items():
        torch.manual_seed(0)
        draft = Eagle3Draft(cfg)
        loop = LoopConfig(steps=len(batches) + 1, ttt=TTTConfig(length=ttt))
        opt = PlainOptimizer(draft, loop.optim)
        train_step(opt, head, [batches[0]], lr_at(0, loop.steps, loop.optim), loop)  # warm-up (allocator, first calls)
        runs[name] = (draft, loop, opt)
    seconds = dict.fromkeys(layouts, 0.0)
    for s in range(max(len(b) for b in layouts.values())):
        for name, batches in layouts.items():
            if s < len(batches):
                draft, loop, opt = runs[name]
                t0 = time.perf_counter()
                train_step(opt, head, [batches[s]], lr_at(s + 1, loop.steps, loop.optim), loop)
                seconds[name] += time.perf_counter() - t0
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=40)
    ap.add_argument("--batch", type=int, default=4, help="samples per padded batch (train.batch_size)")
    ap.add_argument("--max-seq-len", type=int, nargs="+", default=[2048, 1024])
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--draft-vocab", type=int, default=1024)
    ap.add_argument("--ttt", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    cfg = DraftConfig(
        hidden_size=a.hidden,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=a.hidden // 4,
        intermediate_size=3 * a.hidden,
        vocab_size=a.vocab,
        draft_vocab_size=a.draft_vocab,
        target_hidden_size=a.hidden,
        target_num_layers=30,
        capture_layer_ids=[1, 14, 26],
    )
    lengths = lengths_like_default(a.samples, a.seed)
    samples = make_samples(lengths, a.vocab, 3 * a.hidden, a.hidden, a.seed)
    head = TargetHead(torch.randn(a.vocab, a.hidden, generator=torch.Generator().manual_seed(a.seed)) * 0.02)
    real = sum(lengths)
    print(
        f"{a.samples} samples, {real} tokens, mean length {real / a.samples:.0f} (min {min(lengths)}, "
        f"max {max(lengths)}); draft hidden {a.hidden}, ttt {a.ttt}, threads {torch.get_num_threads()}"
    )

    layouts = {f"padding (batch {a.batch})": padded_batches(samples, a.batch)}
    for n in a.max_seq_len:
        packing = pack_samples(samples, n)
        if packing.truncated:
            print(f"  packing to {n}: {packing.truncated} samples truncated")
        layouts[f"packing (max_seq_len {n})"] = packing.batches
    seconds = measure(cfg, head, layouts, a.ttt)
    results = {}
    for name, batches in layouts.items():
        tokens = sum(int(b["attention_mask"].sum()) for b in batches)
        slots = sum(b["attention_mask"].numel() for b in batches)
        results[name] = tokens / seconds[name]
        print(
            f"{name:28s} {len(batches):4d} batches  pad {1 - tokens / slots:6.1%}  "
            f"{seconds[name]:6.2f} s  {results[name]:8.1f} real tokens/s"
        )
    base = next(iter(results.values()))
    for name, rate in list(results.items())[1:]:
        print(f"ratio {name} / padding tokens/s: {rate / base:.2f}x")


if __name__ == "__main__":
    main()
