"""The draft's training step on a GPU at real shapes: tokens/s, peak memory, MFU by sequence length.

    python -m bench.bench_train_gpu                 # Llama-3.1-8B draft shapes, seq 2048/4096/8192
    python -m bench.bench_train_gpu --small --device cpu --seq 128 256   # a smoke run anywhere

Shapes (default): hidden 4096, 32/8 heads, intermediate 14336, vocab 128256, draft vocab
32000, batch 1, TTT 7, bf16 autocast, random weights and data; the attention backend is the
one training uses (`auto`: flex_attention on CUDA). MFU is 3x the draft's forward matmul
FLOPs plus the target head's forward, over a bf16 matmul measured in the same run (the
machine's reachable peak, not the datasheet's). A sequence length that runs out of memory
is reported as such and the others still run. SpecForge's figures for the same shapes are
in the training issue; run its trainer beside this one in the same session to compare.
"""

from __future__ import annotations

import argparse
import time

import torch

from eagle3.dflash.config import DFlashConfig, evenly_spaced_layer_ids
from eagle3.dflash.model import DFlashDraft
from eagle3.draft_config import DraftConfig
from eagle3.modeling import Eagle3Draft
from eagle3.objectives import ObjectiveConfig
from eagle3.target_head import TargetHead
from eagle3.training import LoopConfig, PlainOptimizer, lr_at, train_step
from eagle3.ttt import TTTConfig

# Llama-3.1-8B's draft (SpecForge's and ours), and a 256-wide one for smoke runs.
LLAMA8B = dict(
    hidden=4096,
    heads=32,
    kv_heads=8,
    head_dim=128,
    intermediate=14336,
    vocab=128256,
    draft_vocab=32000,
    target_hidden=4096,
)
# DFlash's recipe for Qwen3-8B (the DFlash paper, SpecForge's and ModelOpt's recipes): 5
# draft layers of the target's shape over 5 target layers, blocks of 16, 512 anchors a
# sequence; our draft keeps its own head over a 32000-token draft vocabulary.
QWEN3_8B_DFLASH = dict(
    hidden=4096,
    heads=32,
    kv_heads=8,
    head_dim=128,
    intermediate=12288,
    vocab=151936,
    draft_vocab=32000,
    target_hidden=4096,
    num_layers=5,
    num_target_layers=5,
    block_size=16,
    num_anchors=512,
)
SMALL = dict(
    hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512, vocab=4096, draft_vocab=1024, target_hidden=256
)


def matmul_tflops(device: torch.device, n: int = 8192, reps: int = 10) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    a @ b  # warm-up
    sync(device)
    started = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - started) / 1e12


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def step_flops(cfg: DraftConfig, tokens: int, ttt: int) -> float:
    """3x the draft's forward matmul FLOPs over `ttt` steps, plus the target head's forward."""
    h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    per_token = 2 * (2 * h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size + h * cfg.draft_vocab_size)
    fuse = 2 * cfg.num_aux * cfg.target_hidden_size * h
    attention = 2 * 2 * tokens * q / 2  # causal scores and values, per token (half the square)
    head = 2 * cfg.target_hidden_size * cfg.vocab_size
    return 3 * tokens * (fuse + ttt * (per_token + attention)) + tokens * head


def draft_config(s: dict) -> DraftConfig:
    """A draft of the given shapes (bench.gpu_suite's dicts: hidden, heads, kv_heads, ...)."""
    return DraftConfig(
        hidden_size=s["hidden"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        head_dim=s["head_dim"],
        intermediate_size=s["intermediate"],
        vocab_size=s["vocab"],
        draft_vocab_size=s["draft_vocab"],
        target_hidden_size=s["target_hidden"],
        target_num_layers=32,
        capture_layer_ids=[1, 15, 28],
    )


def dflash_config(s: dict) -> DFlashConfig:
    """A block draft of the given shapes (QWEN3_8B_DFLASH's keys), on a 36-layer target."""
    return DFlashConfig(
        hidden_size=s["hidden"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        head_dim=s["head_dim"],
        intermediate_size=s["intermediate"],
        num_layers=s["num_layers"],
        vocab_size=s["vocab"],
        draft_vocab_size=s["draft_vocab"],
        target_hidden_size=s["target_hidden"],
        target_num_layers=36,
        capture_layer_ids=evenly_spaced_layer_ids(36, s["num_target_layers"]),
        block_size=s["block_size"],
        mask_token_id=s["vocab"] - 1,
        num_anchors=s["num_anchors"],
        loss_gamma=7.0,
    )


def dflash_step_flops(cfg: DFlashConfig, tokens: int) -> float:
    """3x the block draft's forward matmul FLOPs (every anchored block's slots through every
    layer, the context's keys and values per layer, fc, the draft head on the mask slots),
    plus the target head's forward over the sequence."""
    h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    slots = min(cfg.num_anchors, tokens) * cfg.block_size
    layer = 2 * (h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size)
    attention = 2 * 2 * q * (tokens / 2 + cfg.block_size)  # a slot's scores and values: half the context on average
    context = tokens * (2 * cfg.num_aux * cfg.target_hidden_size * h + cfg.num_layers * 2 * 2 * h * kv)
    head = slots * 2 * h * cfg.draft_vocab_size
    return 3 * (slots * cfg.num_layers * (layer + attention) + context + head) + tokens * 2 * h * cfg.vocab_size


def random_batch(cfg: DraftConfig, seq: int, device: torch.device, seed: int = 0, batch: int = 1) -> dict:
    """One batch of random tokens and bf16 states (the store's dtype), every token trained."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return {
        "input_ids": torch.randint(0, cfg.vocab_size, (batch, seq), generator=g).to(device),
        "loss_mask": torch.ones(batch, seq, dtype=torch.long, device=device),
        "attention_mask": torch.ones(batch, seq, dtype=torch.bool, device=device),
        "aux": torch.randn(batch, seq, cfg.num_aux * cfg.target_hidden_size, generator=g).bfloat16().to(device),
        "final": torch.randn(batch, seq, cfg.target_hidden_size, generator=g).bfloat16().to(device),
    }


def run_one(
    cfg: DraftConfig,
    seq: int,
    ttt: int,
    device: torch.device,
    steps: int,
    dtype: str = "bfloat16",
    loss_block_rows: int = 0,
    compile_layer: bool = False,
    activation_checkpointing: str = "none",
) -> dict:
    """Our step (eagle3.training.train_step, as the train stage runs it) at batch 1: seconds
    per step after one warm-up step, peak memory from the warm-up's end. `cfg`: an EAGLE-3
    draft's (TTT `ttt` steps) or a DFlash block draft's (its blocks and anchors; `ttt` unused). `loss_block_rows`:
    train.objective.loss_block_rows (soft_ce in blocks of rows, eagle3.chunked_loss);
    `compile_layer`: the draft's decoder layer under torch.compile (its norms, MLP and rotary
    are memory-bound elementwise chains that inductor fuses), a measurement only so far;
    `activation_checkpointing`: train.activation_checkpointing ("mlp": the MLP recomputed)."""
    batch = random_batch(cfg, seq, device)
    g = torch.Generator(device="cpu").manual_seed(1)
    head_weight = (torch.randn(cfg.vocab_size, cfg.target_hidden_size, generator=g) * 0.02).to(device)
    head = TargetHead(head_weight.bfloat16() if dtype == "bfloat16" else head_weight)
    torch.manual_seed(0)
    draft = (DFlashDraft if isinstance(cfg, DFlashConfig) else Eagle3Draft)(cfg).to(device)
    if compile_layer:
        for layer in draft.layers if isinstance(draft, DFlashDraft) else [draft.midlayer]:
            layer.compile()
    loop = LoopConfig(
        steps=steps + 1,
        ttt=TTTConfig(length=ttt),
        compute_dtype=dtype,
        objective=ObjectiveConfig(loss_block_rows=loss_block_rows),
        activation_checkpointing=activation_checkpointing,
    )
    opt = PlainOptimizer(draft, loop.optim)
    generator = torch.Generator(device=device).manual_seed(0)
    train_step(opt, head, [batch], lr_at(0, loop.steps, loop.optim), loop, generator)  # warm-up (and compilation)
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    for s in range(steps):
        train_step(opt, head, [batch], lr_at(s + 1, loop.steps, loop.optim), loop, generator)
    sync(device)
    dt = (time.perf_counter() - started) / steps
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    flops = dflash_step_flops(cfg, seq) if isinstance(cfg, DFlashConfig) else step_flops(cfg, seq, ttt)
    return {"seq": seq, "tokens_per_s": seq / dt, "peak_gib": peak, "tflops": flops / dt / 1e12}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, nargs="*", default=[2048, 4096, 8192])
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="a 256-wide draft (smoke run)")
    a = ap.parse_args()
    device = torch.device(a.device)
    cfg = draft_config(SMALL if a.small else LLAMA8B)
    peak = matmul_tflops(device, n=8192 if device.type == "cuda" else 1024, reps=10 if device.type == "cuda" else 2)
    print(f"device {device}; bf16 matmul {peak:.1f} TFLOP/s measured")
    print("| seq len | tokens/s | peak GiB | MFU |")
    print("|---|---|---|---|")
    for seq in a.seq:
        try:
            r = run_one(cfg, seq, a.ttt, device, a.steps)
        except torch.OutOfMemoryError:
            print(f"| {seq} | out of memory | - | - |")
            torch.cuda.empty_cache()
            continue
        mfu = f"{r['tflops'] / peak:.0%}" if device.type == "cuda" else "n/a on CPU"
        print(f"| {seq} | {r['tokens_per_s']:.0f} | {r['peak_gib']:.1f} | {mfu} |")


if __name__ == "__main__":
    main()
