"""Sequence parallelism (Ulysses, eagle3.sequence_parallel) on this CPU: how long a sample
trains within a memory cap per worker, and the throughput of 2 workers on one sample.

    python -m bench.bench_sequence_parallel [--cap-mib 512 --ttt 7 --steps 3]

Two gloo processes (as two Ray Train workers are) with one EAGLE-3 draft layer, float32,
dense TTT attention (the CPU's backend), batch 1, no packing:

* Longest sample: the largest length (to `--granularity` tokens) whose training forward
  keeps at most `--cap-mib` MiB for backward on each worker, at SP 1 and at SP 2. The
  memory counted is autograd's saved tensors (unique storages, through saved_tensors_hooks,
  as tests/test_train_device.py counts them): the activations a step holds at its peak,
  deterministic, where a process's RSS also holds the allocator's caches (and here the
  probes past the cap). SP 2's longest sample then trains one real step (forward,
  backward, optimizer); SP 1's trains in the throughput run.
* Throughput: tokens/s of `--steps` training steps at one length both fit (SP 1's longest,
  or `--length`): SP 1 on one worker (the other idle), SP 2 on both; their ratio.
"""

from __future__ import annotations

import argparse
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from eagle3.draft_config import DraftConfig
from eagle3.modeling import Eagle3Draft
from eagle3.sequence_parallel import SequenceParallel
from eagle3.target_head import TargetHead
from eagle3.training import LoopConfig, PlainOptimizer, forward_batch, train_step
from eagle3.ttt import TTTConfig

MIB = 1 << 20


def draft_config(args) -> DraftConfig:
    cfg = DraftConfig(
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        intermediate_size=4 * args.hidden,
        vocab_size=args.vocab,
        draft_vocab_size=args.vocab // 4,
        target_hidden_size=args.hidden,
        target_num_layers=6,
        capture_layer_ids=[0, 2, 4],
        rope_theta=10000.0,
    )
    cfg.validate()
    return cfg


def sample(cfg: DraftConfig, t: int) -> dict:
    g = torch.Generator().manual_seed(t)
    return {
        "input_ids": torch.randint(0, cfg.vocab_size, (1, t), generator=g),
        "loss_mask": torch.ones(1, t, dtype=torch.long),
        "attention_mask": torch.ones(1, t, dtype=torch.long),
        "aux": torch.randn(1, t, 3 * cfg.target_hidden_size, generator=g),
        "final": torch.randn(1, t, cfg.target_hidden_size, generator=g),
    }


def saved_mib(draft, head, cfg, t: int, ttt: TTTConfig, sp) -> float:
    """MiB autograd keeps for backward in one training forward of a length-t sample."""
    storages = {}

    def pack(x):
        storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        forward_batch(draft, head, sample(cfg, t), ttt, train=True, sp=sp)
    return sum(storages.values()) / MIB


def longest(fits, granularity: int, start: int) -> int:
    """The largest multiple of `granularity` with fits(t): doubling, then bisection."""
    lo, hi = 0, start
    while fits(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > granularity:
        mid = (lo + hi) // 2 // granularity * granularity
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


class AveragingOptimizer(PlainOptimizer):
    """The plain optimizer with the data-parallel gradient average DeepSpeed does over the ranks."""

    def finish(self) -> float:
        for p in self.module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
        return super().finish()


def train_seconds(draft, head, cfg, t: int, loop: LoopConfig, steps: int, sp) -> float:
    """Seconds per training step at length t (after one warm-up step)."""
    opt = AveragingOptimizer(draft, loop.optim) if sp is not None else PlainOptimizer(draft, loop.optim)
    batch = sample(cfg, t)
    generator = torch.Generator().manual_seed(0)
    train_step(opt, head, [batch], 1e-4, loop, generator, sp=sp)
    t0 = time.perf_counter()
    for _ in range(steps):
        train_step(opt, head, [batch], 1e-4, loop, generator, sp=sp)
    return (time.perf_counter() - t0) / steps


def worker(rank: int, args, port: int, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    sp = SequenceParallel(dist.group.WORLD, rank, 2)
    cfg = draft_config(args)
    torch.manual_seed(0)
    draft = Eagle3Draft(cfg).train()
    head = TargetHead(torch.randn(cfg.vocab_size, cfg.target_hidden_size, generator=torch.Generator().manual_seed(1)))
    ttt = TTTConfig(length=args.ttt, attention="dense")
    loop = LoopConfig(steps=1, ttt=ttt, compute_dtype="float32")
    out = {}

    # SP 1: rank 0 alone (no collective inside), the result shared.
    box = [None]
    if rank == 0:
        box = [longest(lambda t: saved_mib(draft, head, cfg, t, ttt, None) <= args.cap_mib, args.granularity, 256)]
    dist.broadcast_object_list(box, src=0)
    out["sp1_longest"] = box[0]

    # SP 2: both ranks probe the same lengths; a length fits when the fuller rank's bytes do.
    def fits_split(t: int) -> bool:
        mib = torch.tensor([saved_mib(draft, head, cfg, t, ttt, sp)], dtype=torch.float64)
        dist.all_reduce(mib, op=dist.ReduceOp.MAX)
        return float(mib) <= args.cap_mib

    out["sp2_longest"] = longest(fits_split, args.granularity, 256)
    out["sp1_mib"] = saved_mib(draft, head, cfg, out["sp1_longest"], ttt, None) if rank == 0 else None
    out["sp2_mib"] = saved_mib(draft, head, cfg, out["sp2_longest"], ttt, sp)

    # Each longest sample trains one real step; then the throughput at a length both fit.
    out["sp2_step_s_at_longest"] = train_seconds(draft, head, cfg, out["sp2_longest"], loop, 1, sp)
    length = args.length or out["sp1_longest"]
    out["length"] = length
    if rank == 0:
        out["sp1_step_s"] = train_seconds(draft, head, cfg, length, loop, args.steps, None)
    dist.barrier()
    out["sp2_step_s"] = train_seconds(draft, head, cfg, length, loop, args.steps, sp)
    results[rank] = out
    dist.barrier()  # neither rank tears gloo down while the other still uses it
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cap-mib", type=float, default=512, help="saved-for-backward MiB allowed per worker")
    p.add_argument("--ttt", type=int, default=7, help="TTT steps unrolled")
    p.add_argument("--steps", type=int, default=3, help="timed training steps per setting")
    p.add_argument("--length", type=int, default=0, help="throughput length (0: SP 1's longest)")
    p.add_argument("--granularity", type=int, default=64, help="lengths probed in multiples of this")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=8192)
    args = p.parse_args(argv)
    results = mp.Manager().dict()
    mp.start_processes(worker, args=(args, free_port(), results), nprocs=2, start_method="spawn")
    r0, r1 = results[0], results[1]
    tokens1, tokens2 = r0["length"] / r0["sp1_step_s"], r0["length"] / max(r0["sp2_step_s"], r1["sp2_step_s"])
    summary = {
        "cap_mib_per_worker": args.cap_mib,
        "ttt": args.ttt,
        "longest_sp1": r0["sp1_longest"],
        "longest_sp2": r0["sp2_longest"],
        "longest_ratio": r0["sp2_longest"] / r0["sp1_longest"],
        "saved_mib_sp1_at_its_longest": round(r0["sp1_mib"], 1),
        "saved_mib_sp2_at_its_longest": [round(r["sp2_mib"], 1) for r in (r0, r1)],
        "sp2_step_s_at_its_longest": round(max(r0["sp2_step_s_at_longest"], r1["sp2_step_s_at_longest"]), 2),
        "throughput_length": r0["length"],
        "tokens_per_s_sp1": round(tokens1, 1),
        "tokens_per_s_sp2": round(tokens2, 1),
        "sp2_over_sp1": round(tokens2 / tokens1, 2),
    }
    for key, value in summary.items():
        print(f"{key:32s} {value}")
    return summary


if __name__ == "__main__":
    main()
