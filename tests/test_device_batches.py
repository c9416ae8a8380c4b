"""The store's batches on the training device: what the trainer streams (workflows.train.
data.BatchStream) reaches the GPU in pinned memory, bit for bit, and trains there like on
the CPU. Marked `gpu`: on the real device where there is one (bench.gpu_suite runs it on
the lent GPU), on the CPU in CI. Imports only torch, numpy and fsspec (the GPU machine has
no Ray, Hydra or zarr)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eagle3.target_head import TargetHead
from eagle3.training import forward_batch
from eagle3.ttt import TTTConfig
from storage.reader import StoreReader
from storage.store import HiddenStateStore, ShardData
from storage.zarr_io import to_bf16_bits
from tests.helpers import random_draft, tiny_draft_config
from workflows.train.data import BatchSettings, BatchStream

CFG = tiny_draft_config()


def write_store(folder) -> str:
    g = torch.Generator().manual_seed(0)
    prov = {
        "hidden_size": CFG.target_hidden_size,
        "capture_layer_ids": CFG.capture_layer_ids,
        "final_is_normed": True,
        "target": {},
    }
    store = HiddenStateStore.create_or_open(str(folder), prov)
    for k, lengths in enumerate([[9, 5, 7], [6, 8]]):
        t = sum(lengths)
        data = ShardData(
            sample_ids=[f"{k}-{i}" for i in range(len(lengths))],
            input_ids=torch.randint(0, CFG.vocab_size, (t,), generator=g).numpy().astype(np.int32),
            loss_mask=np.ones(t, dtype=np.uint8),
            offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            aux=to_bf16_bits(torch.randn(t, CFG.num_aux * CFG.target_hidden_size, generator=g)),
            final=to_bf16_bits(torch.randn(t, CFG.target_hidden_size, generator=g)),
        )
        store.commit([store.write_shard(f"train-{k:05d}", data)])
    return str(folder)


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
