"""Elastic resume (workflows.train.elastic, workflows.train.data.elastic_position): a run
checkpointed by W workers goes on with W' != W, and every sample of an epoch trains once,
none twice, however the old ranks stood (in different epochs, mid-window) and through
several resizes; a same-size resume after a resize replays its deal batch for batch."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from storage.reader import StoreReader
from storage.states import encode_states
from storage.store import HiddenStateStore, ShardData
from workflows.core.errors import InputError
from workflows.train.data import BatchSettings, BatchStream, StreamPosition, elastic_position, to_device

HIDDEN, LAYERS, VOCAB = 24, [0, 2, 4], 97  # tests.helpers.tiny_draft_config's target


def write_store(folder, shard_sizes: list[int]) -> str:
    """Shards of random-length samples (ids s<k>-<i>), states random: only ids matter here."""
    g = torch.Generator().manual_seed(0)
    prov = {
        "hidden_size": HIDDEN,
        "capture_layer_ids": LAYERS,
        "final_is_normed": True,
        "state_dtype": "bfloat16",
        "target": {},
    }
    store = HiddenStateStore.create_or_open(str(folder), prov)
    for k, n in enumerate(shard_sizes):
        lengths = torch.randint(3, 12, (n,), generator=g).tolist()
        states = [
            (torch.randn(t, len(LAYERS) * HIDDEN, generator=g), torch.randn(t, HIDDEN, generator=g)) for t in lengths
        ]
        data = ShardData(
            sample_ids=[f"s{k}-{i}" for i in range(n)],
            input_ids=torch.randint(0, VOCAB, (sum(lengths),), generator=g).numpy().astype(np.int32),
            loss_mask=np.ones(sum(lengths), dtype=np.uint8),
            offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            **encode_states(states, "bfloat16"),
        )
        store.commit([store.write_shard(f"train-{k:05d}", data)])
    return str(folder)


SETTINGS = {
    "packed": BatchSettings(packing=True, max_seq_len=24, rows_per_batch=1, window=5),
    "padded": BatchSettings(batch_size=2, packing=False, window=4),
}


class Ranks:
    """W ranks' streams, recording every batch they take as (epoch, ids)."""

    def __init__(self, url, settings, world, start=None):
        self.reader = StoreReader(url)
        self.shards = self.reader.shard_names("train")
        self.streams = [
            BatchStream(StoreReader(url), self.shards, settings, seed=5, rank=r, world=world, start=start, prefetch=1)
            for r in range(world)
        ]
        self.taken: list[tuple[int, list[str]]] = []

    def take(self, rank: int, n: int) -> None:
        stream = self.streams[rank]
        for _ in range(n):
            next(stream)
            self.taken.append((stream.position.epoch, list(stream.last_ids)))

    def positions(self) -> list[dict]:
        return [s.position.as_dict() for s in self.streams]

    def close(self) -> None:
        for s in self.streams:
            s.close()


def trained_per_epoch(*runs: Ranks) -> dict[int, Counter]:
    epochs: dict[int, Counter] = {}
    for run in runs:
        for epoch, ids in run.taken:
            epochs.setdefault(epoch, Counter()).update(ids)
    return epochs


@pytest.mark.parametrize("batching", sorted(SETTINGS))
@pytest.mark.parametrize("worlds", [(2, 1), (1, 2), (2, 3, 1)])
def test_every_sample_of_an_epoch_trains_once_across_resizes(tmp_path, batching, worlds):
    """W ranks stop at random, uneven points (some past an epoch's end), resume on W' ranks
    (and again on W''), which run until every one is past every epoch the old ranks had begun:
    each of those epochs trained each sample exactly once."""
    url = write_store(tmp_path / "store", [5, 3, 6, 4, 2])
    all_ids = Counter(StoreReader(url).sample_ids)
    settings, rng = SETTINGS[batching], random.Random(f"{batching}{worlds}")
    runs, start = [], None
    for i, world in enumerate(worlds):
        ranks = Ranks(url, settings, world, start=StreamPosition.of(start) if start else None)
        reached = max((e for run in runs for e, _ in run.taken), default=0)
        runs.append(ranks)
        for r in range(world):
            if i == len(worlds) - 1:  # past every epoch begun before: each rank runs into a later one
                while not ranks.taken or ranks.streams[r].position.epoch <= reached:
                    ranks.take(r, 1)
            else:
                ranks.take(r, rng.randint(1, 9))
        positions = ranks.positions()
        ranks.close()
        start = elastic_position(positions, ranks.reader, ranks.shards, seed=5)
        assert start["batches"] == 0 and not start["trained"]
    complete = max(e for run in runs[:-1] for e, _ in run.taken)
    epochs = trained_per_epoch(*runs)
    for epoch in range(complete + 1):
        assert epochs[epoch] == all_ids, (epoch, epochs[epoch] - all_ids, all_ids - epochs[epoch])


def test_a_same_size_resume_after_a_resize_replays_its_deal(tmp_path):
    """After 2 -> 3, rank 1 of 3 checkpoints mid-epoch; resumed at 3 it continues with the
    batches an uninterrupted rank would take (the exclusions travel in its position)."""
    url = write_store(tmp_path / "store", [5, 3, 6, 4, 2])
    settings = SETTINGS["padded"]
    old = Ranks(url, settings, 2)
    old.take(0, 2)
    old.take(1, 1)
    start = StreamPosition.of(elastic_position(old.positions(), old.reader, old.shards, seed=5))
    old.close()
    resized = Ranks(url, settings, 3, start=start)
    resized.take(1, 1)
    saved = resized.streams[1].position
    assert saved.epoch == start.epoch and str(saved.epoch) in saved.excluded  # kept while in its epoch
    resized.take(1, 6)
    after = [ids for _, ids in resized.taken[1:]]
    again = BatchStream(StoreReader(url), resized.shards, settings, seed=5, rank=1, world=3, start=saved, prefetch=1)
    try:
        replay = []
        for _ in range(6):
            next(again)
            replay.append(list(again.last_ids))
    finally:
        again.close()
        resized.close()
    assert replay == after


def test_a_checkpoint_without_trained_ids_resumes_only_at_its_own_size():
    with pytest.raises(InputError, match="predates elastic resume.*its own train.num_workers"):
        elastic_position([{"epoch": 0, "batches": 3}, {"epoch": 0, "batches": 2}], None, [], seed=1)


def deepspeed_steps(rank: int, url: str, out: str) -> None:
    """One process (gloo, world 1): DeepSpeed ZeRO-1 trains 5 steps uninterrupted; and 3
    steps, a checkpoint, a fresh engine loading it as a resized resume (the consolidated
    optimizer only), 2 steps. Writes both runs' losses and final weights to `out`."""
    import os

    import torch.distributed as dist

    from eagle3.target_head import TargetHead
    from eagle3.training import LoopConfig, OptimConfig, train_step
    from eagle3.ttt import TTTConfig
    from tests.helpers import random_draft, tiny_draft_config
    from workflows.core.config import compose
    from workflows.train.trainer import DeepSpeedStep

    port = os.environ["ELASTIC_TEST_PORT"]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo", rank=0, world_size=1)
    train = compose(["train.zero_stage=1", "train.compute_dtype=float32", "train.batch_size=2"]).train
    cfg = LoopConfig(steps=5, ttt=TTTConfig(length=2, attention="dense"), optim=OptimConfig(lr=1e-2))
    head = TargetHead(torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(1)))
    batches = []
    stream = BatchStream(StoreReader(url), StoreReader(url).shard_names("train"), SETTINGS["padded"], seed=3)
    batches = [to_device(next(stream), torch.device("cpu")) for _ in range(5)]
    stream.close()

    def engine():
        return DeepSpeedStep(random_draft(tiny_draft_config(), dtype=torch.float32), train, 1, torch.device("cpu"))

    def steps(opt, chosen, noise):
        return [train_step(opt, head, [b], 1e-2, cfg, noise)["loss"] for b in chosen]

    whole = engine()
    want = steps(whole, batches, torch.Generator().manual_seed(5))
    first, noise = engine(), torch.Generator().manual_seed(5)  # the noise goes on as the Trainer's does
    got = steps(first, batches[:3], noise)
    first.save(Path(out))
    second = engine()
    second.load(Path(out), resized=True)
    got += steps(second, batches[3:], noise)
    torch.save(
        {
            "want": want,
            "got": got,
            "whole": {k: v.detach().clone() for k, v in whole.module.state_dict().items()},
            "resumed": {k: v.detach().clone() for k, v in second.module.state_dict().items()},
        },
        f"{out}/result.pt",
    )
    dist.destroy_process_group()


def test_a_resized_resume_of_deepspeed_continues_its_optimizer_exactly(tmp_path, monkeypatch):
    """DeepSpeed ZeRO-1's consolidated optimizer copy (workflows.train.elastic) holds all of
    Adam's state: 3 steps, the copy loaded into a fresh engine, 2 steps = 5 steps whole, bit
    for bit (losses and weights). Across world sizes, tests/test_train_scale.py."""
    import torch.multiprocessing as mp

    from tests.helpers import free_port

    url = write_store(tmp_path / "store", [5, 3, 6, 4, 2])
    monkeypatch.setenv("ELASTIC_TEST_PORT", str(free_port()))
    mp.spawn(deepspeed_steps, args=(url, str(tmp_path)), nprocs=1)
    result = torch.load(tmp_path / "result.pt", weights_only=True)
    assert result["got"] == result["want"] and len(set(result["want"])) == 5
    assert all(torch.equal(result["whole"][k], result["resumed"][k]) for k in result["whole"])
    assert (tmp_path / "optimizer_full.safetensors").exists()


@pytest.mark.parametrize(
    "settings, message",
    [
        (["train.min_workers=3"], r"train.min_workers=3 is more than train.num_workers=2"),
        (["train.min_workers=1"], r"train.min_workers=1: an elastic group .* train.max_failures >= 1"),
    ],
)
def test_an_elastic_group_the_schema_cannot_honour_is_refused_naming_the_settings(settings, message):
    from eagle3.schema import ConfigError
    from workflows.core.config import compose

    with pytest.raises(ConfigError, match=message):
        compose(settings)


@pytest.mark.parametrize("source, backend", [("stream", "auto"), ("store", "local")], ids=["stream", "local"])
def test_elastic_scaling_is_refused_where_the_world_size_cannot_change(source, backend):
    from eagle3.schema import ConfigError
    from workflows.core.config import compose
    from workflows.train.stage import backend_of

    train = compose(["train.min_workers=1", "train.max_failures=1", f"train.backend={backend}"]).train
    with pytest.raises(ConfigError, match=rf"train.min_workers=1 .* train.data_source={source} with train.backend="):
        backend_of(train, source)
    assert backend_of(compose(["train.min_workers=1", "train.max_failures=1"]).train, "store") == "deepspeed"
