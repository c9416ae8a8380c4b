"""Sequence parallelism (Ulysses, eagle3.sequence_parallel): one sample split over 2 ranks is
invisible in the maths. Two gloo processes on the CPU (torch.multiprocessing), as two Ray
Train workers would be: the sharded TTT attention against the whole-sequence reference, a
training step at SP 2 against SP 1, the bytes autograd keeps per rank; then the settings it
refuses, and one short Ray Train run through the train stage."""

from __future__ import annotations

import os
import random

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from eagle3.attention import DenseTTTAttention, FlexTTTAttention
from eagle3.objectives import ObjectiveConfig
from eagle3.schema import ConfigError
from eagle3.sequence_parallel import SequenceParallel, SequenceParallelAttention, check_heads, pad_segments
from eagle3.target_head import TargetHead
from eagle3.training import LoopConfig, forward_batch, train_step
from eagle3.ttt import NoiseConfig, TTTConfig
from tests.helpers import free_port, random_draft, tiny_draft_config

SP = 2


def _entry(rank: int, fn, port: int, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=SP)
    fn(SequenceParallel(dist.group.WORLD, rank, SP), *args)
    # Neither rank tears gloo down while the other still uses it, and neither runs gloo's
    # C++ teardown at all: a rank leaving early, or rank 0's store going while rank 1 was
    # still destroying its group (about 1 run in 6), made a rank abort ("terminate called
    # without an active exception"). After the barrier both have finished; the process ends
    # at once, and the kernel closes its sockets. A rank that raised never gets here; spawn
    # then ends the other.
    dist.barrier()
    os._exit(0)


def on_two_ranks(fn, *args) -> None:
    """fn(sp, *args) in 2 fresh processes joined by gloo; a rank's failure fails the test
    with that rank's traceback."""
    mp.start_processes(_entry, args=(fn, free_port(), args), nprocs=SP, start_method="spawn")


def shard(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """This rank's rows of [B, H, T, D]."""
    return sp.local(x.transpose(1, 2)).transpose(1, 2)


def segments_of(b: int, t: int, packed: bool, rng: random.Random) -> torch.Tensor:
    """Per row: 1-3 packed samples (or one), then right padding (segment -1)."""
    rows = []
    for _ in range(b):
        valid = rng.randint(t // 2, t)
        cuts = sorted(rng.sample(range(1, valid), rng.randint(0, 2))) if packed and valid > 3 else []
        row, seg = [], 0
        for k in range(valid):
            if k in cuts:
                seg += 1
            row.append(seg)
        rows.append(row + [-1] * (t - valid))
    return torch.tensor(rows)


# ------------------------------------------------------------------ sharded TTT attention
def _attention_matches(sp: SequenceParallel, cases: list[tuple]) -> None:
    for b, t, heads, d, steps, packed, seed in cases:
        rng = random.Random(seed)
        g = torch.Generator().manual_seed(seed)
        seg = segments_of(b, t, packed, rng)
        qkv = [[torch.randn(b, heads, t, d, generator=g, dtype=torch.float64) for _ in range(3)] for _ in range(steps)]
        weigh = [torch.randn(b, heads, t, d, generator=g, dtype=torch.float64) for _ in range(steps)]

        whole = [[x.clone().requires_grad_() for x in step] for step in qkv]
        state = DenseTTTAttention(segment_ids=seg)
        outs = [state.attend(*step) for step in whole]
        grads = torch.autograd.grad(sum((o * w).sum() for o, w in zip(outs, weigh)), [x for s in whole for x in s])

        mine = [[shard(x, sp).requires_grad_() for x in step] for step in qkv]
        state = SequenceParallelAttention(DenseTTTAttention(segment_ids=pad_segments(seg, sp)), sp, heads)
        outs_sp = [state.attend(*step) for step in mine]
        loss = sum((o * shard(w, sp)).sum() for o, w in zip(outs_sp, weigh))
        grads_sp = torch.autograd.grad(loss, [x for s in mine for x in s])

        start, real = sp.start(t), min(sp.rows(t), t - sp.start(t))  # this rank's rows inside the sequence
        case = f"case {(b, t, heads, d, steps, packed, seed)} rank {sp.rank}"
        for j, (o, o_sp) in enumerate(zip(outs, outs_sp)):
            torch.testing.assert_close(o_sp[:, :, :real], o[:, :, start : start + real], msg=f"{case} step {j}")
            assert torch.isfinite(o_sp).all()
        for k, (gr, gr_sp) in enumerate(zip(grads, grads_sp)):
            torch.testing.assert_close(gr_sp[:, :, :real], gr[:, :, start : start + real], msg=f"{case} grad {k}")
            assert not gr_sp[:, :, real:].any(), f"{case}: a padding row got a gradient"
    _flex_matches(sp)


def _flex_matches(sp: SequenceParallel) -> None:
    """Forward only (torch has no CPU flex backward): grouped k/v heads that divide over the
    group travel unrepeated to the flex state, which groups them itself."""
    import warnings

    warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
    b, t, heads, kv, d, steps = 2, 11, 4, 2, 4, 3
    seg = segments_of(b, t, True, random.Random(5))
    g = torch.Generator().manual_seed(5)
    qkv = [[torch.randn(b, n, t, d, generator=g, dtype=torch.float64) for n in (heads, kv, kv)] for _ in range(steps)]
    state = DenseTTTAttention(segment_ids=seg)
    want = [state.attend(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)) for q, k, v in qkv]
    state = SequenceParallelAttention(FlexTTTAttention(pad_segments(seg, sp)), sp, kv)
    assert state.native_gqa
    got = [state.attend(*(shard(x, sp) for x in step)) for step in qkv]
    start, real = sp.start(t), min(sp.rows(t), t - sp.start(t))
    for j, (o, o_sp) in enumerate(zip(want, got)):
        torch.testing.assert_close(o_sp[:, :, :real], o[:, :, start : start + real], msg=f"flex step {j}")


def test_sharded_ttt_attention_equals_the_whole_sequence_reference():
    """Property test over random cases (float64): lengths that 2 does not divide, packed
    segments, padded rows, several TTT steps, 2 and 4 heads. Each rank's output rows and
    the gradients of its q/k/v rows equal the whole-sequence DenseTTTAttention's; the rows
    padded to divide the length get no gradient. And the flex state, forward only, reading
    grouped k/v heads unrepeated."""
    rng = random.Random(51)
    cases = [
        (rng.randint(1, 2), rng.choice([5, 9, 13, 16, 23]), rng.choice([2, 4]), 4, rng.randint(1, 4), packed, seed)
        for seed, packed in enumerate([False, True] * 4)
    ]
    on_two_ranks(_attention_matches, cases)


# ------------------------------------------------------------------ a training step
class GradientsOnly:
    """The optimizer side of train_step without the step: gradients kept for comparison,
    averaged over the ranks (`average`) as DeepSpeed's data-parallel reduction does."""

    def __init__(self, module, average: bool):
        self.module, self.average = module, average

    def begin(self, lr: float) -> None:
        self.module.train()
        self.module.zero_grad(set_to_none=True)

    def backward(self, loss, micro_batches: int) -> None:
        (loss / micro_batches).backward()

    def finish(self) -> float:
        if self.average:
            for p in self.module.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= dist.get_world_size()
        return 0.0


def tiny_batch(cfg, t: int, packed: bool, seed: int, b: int = 2) -> dict:
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    seg = segments_of(b, t, packed, rng)
    positions = torch.zeros_like(seg)
    for r in range(b):  # positions restart at 0 per sample
        for k in range(1, t):
            positions[r, k] = positions[r, k - 1] + 1 if seg[r, k] == seg[r, k - 1] else 0
    batch = {
        "input_ids": torch.randint(0, cfg.vocab_size, (b, t), generator=g),
        "loss_mask": (torch.rand(b, t, generator=g) < 0.7).long(),
        "attention_mask": (seg >= 0).long(),
        "aux": torch.randn(b, t, 3 * cfg.target_hidden_size, generator=g),
        "final": torch.randn(b, t, cfg.target_hidden_size, generator=g),
    }
    if packed:
        batch.update(position_ids=positions, segment_ids=seg)
    return batch


def _step_matches(sp: SequenceParallel, cases: list[tuple]) -> None:
    cfg = tiny_draft_config()
    head = TargetHead(torch.randn(cfg.vocab_size, cfg.target_hidden_size, generator=torch.Generator().manual_seed(3)))
    for t, packed, objective in cases:
        batch = tiny_batch(cfg, t, packed, seed=t)
        loop = LoopConfig(
            steps=1,
            ttt=TTTConfig(length=3, attention="dense", noise=NoiseConfig("gaussian", 0.05)),
            objective=objective,
            compute_dtype="float32",
        )
        runs = {}
        for split in (None, sp):
            draft = random_draft(cfg, seed=1, dtype=torch.float32)
            opt = GradientsOnly(draft, average=split is not None)
            noise = torch.Generator().manual_seed(7)  # the same seed on both ranks: one data rank
            figures = train_step(opt, head, [batch], 1e-3, loop, noise, sp=split)
            grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
            runs[split is not None] = figures, grads
        (want, want_grads), (got, got_grads) = runs[False], runs[True]
        case = f"T={t} packed={packed} {objective} rank {sp.rank}"
        for key in ("loss", "step_loss", "step_acc", "step_alpha"):
            torch.testing.assert_close(
                torch.tensor(got[key]), torch.tensor(want[key]), rtol=1e-5, atol=1e-6, msg=f"{case}: {key}"
            )
        assert got_grads.keys() == want_grads.keys() and len(want_grads) > 5
        for name in want_grads:
            torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-4, atol=1e-6, msg=f"{case}: {name}")


def test_a_training_step_at_sp2_equals_sp1():
    """A tiny draft (4 query heads, 2 kv heads), float32, noise on, odd lengths, packing on
    and off, both loss weightings (decay and the chain's per-position weights) and the
    blocked loss (eagle3.chunked_loss): the loss, per-step losses, accuracies and acceptance
    rates, and every parameter's gradient (averaged over the 2 ranks, as DeepSpeed does)
    equal one rank's whole-sample step within float32 tolerance."""
    cases = [
        (13, False, ObjectiveConfig()),
        (13, True, ObjectiveConfig()),
        (20, True, ObjectiveConfig(weighting="chain")),
        (9, False, ObjectiveConfig(loss_block_rows=4)),
    ]
    on_two_ranks(_step_matches, cases)


# ------------------------------------------------------------------ memory
def _saved(draft, head, batch, ttt, sp) -> int:
    """Bytes autograd saves for backward in one forward_batch (unique storages)."""
    storages = {}

    def pack(x):
        storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        forward_batch(draft, head, batch, ttt, train=True, sp=sp)
    return sum(storages.values())


def _saved_bytes_halve(sp: SequenceParallel, t: int) -> None:
    cfg = tiny_draft_config(hidden_size=64, intermediate_size=128, head_dim=16, draft_vocab_size=64)
    draft = random_draft(cfg, dtype=torch.float32).train()
    head = TargetHead(torch.randn(cfg.vocab_size, cfg.target_hidden_size, generator=torch.Generator().manual_seed(0)))
    batch = tiny_batch(cfg, t, packed=False, seed=0, b=1)
    ttt = TTTConfig(length=3, attention="dense")
    one, split = _saved(draft, head, batch, ttt, None), _saved(draft, head, batch, ttt, sp)
    assert split <= 0.55 * one, (split, one, split / one)


def test_saved_bytes_per_rank_at_sp2_are_at_most_055_of_sp1():
    """The same sample (T 384, 3 TTT steps, dense attention, so the [heads, T, T] scores
    dominate as they do at length): each rank keeps at most 0.55x of what one rank
    keeps for the whole sample. Its heads' scores halve, and so do its rows' activations
    and the target window it is scored against (T/2 + 3 rows)."""
    on_two_ranks(_saved_bytes_halve, 384)


# ------------------------------------------------------------------ refusals
def test_sequence_parallel_refuses_what_it_cannot_split():
    from workflows.core.config import DraftSection, compose
    from workflows.train.checkpoint import resume_mismatch
    from workflows.train.stage import backend_of, resume_fields

    with pytest.raises(ConfigError, match=r"sequence_parallel=3 does not divide the draft's num_attention_heads=4"):
        check_heads(4, 3)
    check_heads(4, 2)
    with pytest.raises(ConfigError, match=r"train.num_workers=3 is not a multiple of train.sequence_parallel=2"):
        compose(["target=tiny", "train.num_workers=3", "train.sequence_parallel=2"])
    with pytest.raises(ConfigError, match=r"train.sequence_parallel=2 with draft.family=dflash"):
        compose(["target=tiny", "draft=dflash", "train.sequence_parallel=2"])
    with pytest.raises(ConfigError, match=r"use train.backend=ray \(or auto\), not train.backend=local"):
        compose(["target=tiny", "train.backend=local", "train.sequence_parallel=2"])
    with pytest.raises(ConfigError, match=r"train.dropout=0.1 with train.sequence_parallel=2"):
        compose(["target=tiny", "train.dropout=0.1", "train.sequence_parallel=2"])
    train = compose(["target=tiny", "train.sequence_parallel=2"]).train
    # A split run's checkpoint is refused by an unsplit one (another data rank per worker),
    # and an unsplit run's resume fields are as before the setting existed.
    split, whole = (resume_fields(t, DraftSection(), 0, "deepspeed", "key") for t in (train, compose([]).train))
    assert resume_mismatch(split, whole) == ["sequence_parallel: 2 -> None"]
    with pytest.raises(ConfigError, match=r"train.sequence_parallel=2 splits a sample over Ray Train workers"):
        backend_of(train, "online")
    with pytest.raises(ConfigError, match=r"train.sequence_parallel=2 with train.data_source=stream"):
        backend_of(train, "stream")
    # The tiny target's draft has 2 heads: groups of 2 split them, groups of 4 cannot.
    assert compose(["target=tiny", "train.num_workers=4", "train.sequence_parallel=2"]).train.sequence_parallel == 2
    with pytest.raises(ConfigError, match=r"sequence_parallel=4 does not divide the draft's num_attention_heads=2"):
        compose(["target=tiny", "train.num_workers=4", "train.sequence_parallel=4"])
