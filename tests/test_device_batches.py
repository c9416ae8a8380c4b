"""The store's batches on the training device: what the trainer streams (workflows.train.
data.BatchStream) reaches the GPU in pinned memory, bit for bit, and trains there like on
the CPU; an int8 store's batches cross as int8 with their scales and are dequantised there
to exactly the CPU reader's bf16, and train to exactly the same losses. Marked `gpu`: on
the real device where there is one (bench.gpu_suite runs it on the lent GPU), on the CPU in
CI. Imports only torch, numpy and fsspec (the GPU machine has no Ray, Hydra or zarr)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eagle3.target_head import TargetHead
from eagle3.training import LoopConfig, OptimConfig, PlainOptimizer, forward_batch, train_step
from eagle3.ttt import TTTConfig
from storage.reader import StoreReader
from storage.states import encode_states
from storage.store import HiddenStateStore, ShardData
from tests.helpers import random_draft, tiny_draft_config
from workflows.train.data import BatchSettings, BatchStream, eval_batches, to_device

CFG = tiny_draft_config()


def write_store(folder, state_dtype: str = "bfloat16") -> str:
    g = torch.Generator().manual_seed(0)
    prov = {
        "hidden_size": CFG.target_hidden_size,
        "capture_layer_ids": CFG.capture_layer_ids,
        "final_is_normed": True,
        "state_dtype": state_dtype,
        "target": {},
    }
    store = HiddenStateStore.create_or_open(str(folder), prov)
    h = CFG.target_hidden_size
    for k, lengths in enumerate([[9, 5, 7], [6, 8]]):
        t = sum(lengths)
        states = []
        for n in lengths:
            aux = (
                torch.randn(n, CFG.num_aux * h, generator=g)
                * torch.logspace(-2, 2, CFG.num_aux * h)[torch.randperm(CFG.num_aux * h, generator=g)]
            )
            aux[0, h : 2 * h] = 0  # an all-zero slice: scale 0
            states.append((aux, torch.randn(n, h, generator=g)))
        data = ShardData(
            sample_ids=[f"{k}-{i}" for i in range(len(lengths))],
            input_ids=torch.randint(0, CFG.vocab_size, (t,), generator=g).numpy().astype(np.int32),
            loss_mask=np.ones(t, dtype=np.uint8),
            offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            **encode_states(states, state_dtype),
        )
        store.commit([store.write_shard(f"train-{k:05d}", data)])
    return str(folder)


class CpuDequantising:
    """The reader as the trainer used it before int8 batches crossed to the device: every
    sample's states dequantised to bf16 on the CPU by the reader (storage.states.dequantize_int8)."""

    def __init__(self, reader: StoreReader):
        self.reader, self.url, self.skipped = reader, reader.url, reader.skipped

    def iter_samples(self, names, seed=None, dequantize=True):
        return self.reader.iter_samples(names, seed=seed, dequantize=True)


@pytest.mark.gpu
def test_store_batches_reach_the_device_pinned_and_bit_exact(tmp_path, device):
    url = write_store(tmp_path / "store")
    settings = BatchSettings(batch_size=2, packing=False, max_seq_len=64)
    shards = StoreReader(url).shard_names()
    on_cpu = BatchStream(StoreReader(url), shards, settings, seed=3)
    pinned = BatchStream(StoreReader(url), shards, settings, seed=3, pin=device.type == "cuda")
    head = TargetHead(torch.randn(CFG.vocab_size, CFG.target_hidden_size, generator=torch.Generator().manual_seed(1)))
    draft = random_draft(CFG, dtype=torch.float32)
    try:
        for _ in range(4):  # past the first epoch's end
            want, got = next(on_cpu), next(pinned)
            assert all(v.is_pinned() == (device.type == "cuda") for v in got.values())
            moved = {k: v.to(device, non_blocking=True) for k, v in got.items()}
            assert moved["aux"].dtype == torch.bfloat16 and moved["aux"].device.type == device.type
            for k in want:
                assert torch.equal(moved[k].cpu(), want[k]), k
            # The same batch trains alike on both devices (fp32; kernels differ by rounding).
            ttt = TTTConfig(length=2, attention="dense")
            ref = forward_batch(draft, head, want, ttt, train=False)
            out = forward_batch(draft.to(device), head.to(device), moved, ttt, train=False)
            draft, head = draft.cpu(), head.cpu()
            torch.testing.assert_close(out.loss.cpu(), ref.loss, rtol=1e-4, atol=1e-5)
    finally:
        on_cpu.close(), pinned.close()


@pytest.mark.gpu
@pytest.mark.parametrize("packing", [True, False])
def test_int8_batches_cross_as_int8_and_are_dequantised_on_the_device_as_on_the_cpu(tmp_path, device, packing):
    url = write_store(tmp_path / "int8", "int8")
    settings = BatchSettings(batch_size=2, packing=packing, max_seq_len=16, rows_per_batch=2, window=4)
    shards = StoreReader(url).shard_names()
    cuda = device.type == "cuda"
    old = BatchStream(CpuDequantising(StoreReader(url)), shards, settings, seed=3)
    new = BatchStream(StoreReader(url), shards, settings, seed=3, pin=cuda)
    h, n = CFG.target_hidden_size, CFG.num_aux
    try:
        for _ in range(6):  # past the first epoch's end
            want, got = next(old), next(new)
            assert want["aux"].dtype == torch.bfloat16 and "aux_scale" not in want
            # What is pinned and copied: int8 states and float32 scales, ~half bf16's bytes.
            b, t = got["input_ids"].shape
            dtypes = {k: got[k].dtype for k in ("aux", "final", "aux_scale", "final_scale")}
            assert dtypes == {
                "aux": torch.int8,
                "final": torch.int8,
                "aux_scale": torch.float32,
                "final_scale": torch.float32,
            }
            assert got["aux_scale"].shape == (b, t, n) and got["final_scale"].shape == (b, t, 1)
            assert all(v.is_pinned() == cuda for v in got.values())
            int8_bytes = sum(got[k].nbytes for k in dtypes)
            assert int8_bytes == b * t * (n + 1) * (h + 4) and int8_bytes / (
                want["aux"].nbytes + want["final"].nbytes
            ) == ((h + 4) / (2 * h))
            moved = to_device(got, device, non_blocking=True)
            assert set(moved) == set(want) and moved["aux"].device.type == device.type
            for k in want:  # bit for bit the CPU reader's bf16 (padding included)
                assert moved[k].dtype == want[k].dtype and torch.equal(moved[k].cpu(), want[k]), k
    finally:
        old.close(), new.close()
    # Held-out batches too (eval_batches, as the trainer's evaluation moves them).
    reader = StoreReader(url)
    for got, want in zip(
        eval_batches(reader, shards, 2, 16, 0), eval_batches(CpuDequantising(reader), shards, 2, 16, 0), strict=True
    ):
        assert got["aux"].dtype == torch.int8
        moved = to_device(got, device)
        assert all(torch.equal(moved[k].cpu(), want[k]) for k in want)
    with pytest.raises(ValueError, match="dequantise the batch first"):
        forward_batch(random_draft(CFG, dtype=torch.float32), None, got, TTTConfig(length=2), train=False)


@pytest.mark.gpu
def test_training_from_an_int8_store_gives_the_losses_of_the_cpu_dequantised_batches(tmp_path, device):
    """Dequantising on the device changes where the multiply runs, not one bit of the batch:
    the same steps give exactly the same losses as the reader's CPU dequantisation did."""
    url = write_store(tmp_path / "int8", "int8")
    settings = BatchSettings(packing=True, max_seq_len=16, rows_per_batch=2, window=4)
    shards = StoreReader(url).shard_names()
    cfg = LoopConfig(steps=4, ttt=TTTConfig(length=2, attention="dense"), optim=OptimConfig(lr=1e-2))
    losses = {}
    for name, reader in (("cpu", CpuDequantising(StoreReader(url))), ("device", StoreReader(url))):
        head = TargetHead(
            torch.randn(CFG.vocab_size, CFG.target_hidden_size, generator=torch.Generator().manual_seed(1))
        )
        head = head.to(device)
        draft = random_draft(CFG, dtype=torch.float32).to(device)
        opt = PlainOptimizer(draft, cfg.optim)
        generator = torch.Generator(device=device).manual_seed(5)
        stream = BatchStream(reader, shards, settings, seed=3, pin=device.type == "cuda")
        try:
            losses[name] = [
                train_step(opt, head, [to_device(next(stream), device, non_blocking=True)], 1e-2, cfg, generator)[
                    "loss"
                ]
                for _ in range(cfg.steps)
            ]
        finally:
            stream.close()
    assert losses["device"] == losses["cpu"] and len(set(losses["cpu"])) == cfg.steps
