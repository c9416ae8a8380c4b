"""Training batches streamed from the store: each worker reads only its own shards.

Per epoch `e` the split's shards are shuffled with a seed of (train seed, e) and dealt out
round-robin: worker `r` of `W` reads shards `r, r+W, ...` of that order, whole, one at a
time (storage.reader), samples shuffled inside each shard. With fewer shards than workers,
every worker reads every shard and keeps every W-th sample instead. A window of samples is
then turned into batches, either packed (samples concatenated into rows of at most
`max_seq_len` tokens, attention kept inside each sample: eagle3.target_features.
pack_samples) or padded (length-sorted groups of `batch_size` samples); the window's
batches are visited in a seeded order.

Everything is a function of (seed, epoch, rank, world size), so a position, (epoch, batches
taken in it), is all a checkpoint needs to continue the same stream; the stream never ends
(epochs follow one another), so every worker always has a next batch and the workers'
collective calls stay in step. A background thread keeps `prefetch` batches ready, so the
step does not wait on storage.

Elastic resume (a checkpoint of W workers resumed on W' != W): the position also holds the
ids each rank trained in its current epoch. `elastic_position` turns the W saved positions
into one start for every new rank: the earliest epoch any rank was in, with the samples
already trained in it (and in any later epoch a rank had reached) excluded; the new ranks
deal the rest of that epoch among themselves as any epoch is dealt, so that every sample of
an epoch trains once, none twice. The exclusions travel in the position until their epoch
ends, so a later same-size resume replays the same deal.

States stay as the store holds them through batching: from an int8 store, int8 `aux`/`final`
with their float32 scales (padded and packed alike), so half the bytes are pinned and cross
to the device; `to_device` dequantises them there, right after the copy (on a CPU-only run
the CPU), the same bf16 values as the CPU reader's (storage.states.dequantize).
"""

from __future__ import annotations

import itertools
import queue
import random
import threading
from dataclasses import dataclass, field
from typing import Iterator

from eagle3.target_features import collate_samples, pack_samples
from storage.reader import sample_order
from storage.states import decode_batch
from workflows.core.errors import InputError


@dataclass
class BatchSettings:
    batch_size: int = 4  # samples per batch when padding
    packing: bool = True
    max_seq_len: int = 2048  # tokens per packed row; longer samples are truncated (counted)
    rows_per_batch: int = 1  # packed rows per batch
    window: int = 256  # samples batched together (sorted / packed) before their order is shuffled
    pad_id: int = 0


@dataclass
class StreamPosition:
    epoch: int = 0
    batches: int = 0  # batches already taken from this epoch
    trained: list[str] = field(default_factory=list)  # ids of those batches' samples
    # epoch -> ids trained there by an earlier world size (elastic resume): left out of its deal
    excluded: dict[str, list[str]] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"epoch": self.epoch, "batches": self.batches, "trained": self.trained, "excluded": self.excluded}

    @classmethod
    def of(cls, state: dict) -> "StreamPosition":
        """A saved position; one saved before `trained` existed resumes at the same world only."""
        return cls(state["epoch"], state["batches"], list(state.get("trained", [])), dict(state.get("excluded", {})))


@dataclass
class StreamCounts:
    """What the stream did, for the run's report."""

    samples: int = 0
    tokens: int = 0
    truncated: int = 0


def my_shards(shards: list[str], seed: int, epoch: int, rank: int, world: int) -> tuple[list[str], bool]:
    """(shards this worker reads in `epoch`, whether it must stride over samples instead)."""
    order = sorted(shards)
    random.Random(f"shards:{seed}:{epoch}").shuffle(order)
    if len(order) >= world:
        return order[rank::world], False
    return order, True


def window_batches(samples: list[dict], s: BatchSettings, rng: random.Random) -> list[tuple[dict, list[str], int]]:
    """A window's batches in the seeded order, each with the ids of its samples and how many
    of them were cut to `max_seq_len` (counted when the batch is trained, not when its
    window is made: a prefetching loader makes windows ahead of training)."""
    if s.packing:
        packed = pack_samples(samples, s.max_seq_len, s.pad_id, s.rows_per_batch)
        groups = [packed.rows[i : i + s.rows_per_batch] for i in range(0, len(packed.rows), s.rows_per_batch)]
        members = [[samples[k] for row in group for k in row] for group in groups]
        batches = [
            (batch, [x["id"] for x in group], sum(len(x["input_ids"]) > s.max_seq_len for x in group))
            for batch, group in zip(packed.batches, members)
        ]
    else:
        cut = []
        for x in samples:
            if len(x["input_ids"]) > s.max_seq_len:
                x = {k: (v[: s.max_seq_len] if k != "id" else v) for k, v in x.items()}
                x["truncated"] = True
            cut.append(x)
        cut.sort(key=lambda x: (len(x["input_ids"]), x["id"]))  # little padding inside a batch
        groups = [cut[i : i + s.batch_size] for i in range(0, len(cut), s.batch_size)]
        batches = [
            (
                collate_samples([{k: v for k, v in x.items() if k != "truncated"} for x in group], s.pad_id),
                [x["id"] for x in group],
                sum("truncated" in x for x in group),
            )
            for group in groups
        ]
    rng.shuffle(batches)  # draws on the length alone: the same order whatever a batch holds
    return batches


class SamplesInMemory:
    """Samples held in this process, read like the store's shards (storage.reader.StoreReader's
    `iter_samples`, `url`, `skipped`): online states go through the same batching, stream
    and held-out evaluation as states from the store."""

    def __init__(self, shards: dict[str, list[dict]], url: str):
        self.shards, self.url = shards, url
        self.skipped: dict[str, str] = {}  # nothing to skip: no file behind these samples

    def iter_samples(self, names: list[str], seed: int | None = None, dequantize: bool = True) -> Iterator[dict]:
        # `dequantize`: StoreReader's; these states are bf16 already.
        for name in names:
            samples = self.shards[name]
            for k in sample_order(len(samples), name, seed):
                yield samples[k]


class BatchStream:
    """An endless, resumable stream of one worker's training batches (see module doc).
    With `pin`, the prefetch thread pins each batch in page-locked memory, so that the copy
    to the GPU can overlap the step (`.to(device, non_blocking=True)`)."""

    def __init__(
        self,
        reader,
        shards: list[str],
        settings: BatchSettings,
        seed: int,
        rank: int = 0,
        world: int = 1,
        start: StreamPosition | None = None,
        prefetch: int = 4,
        pin: bool = False,
    ):
        if not shards:
            raise InputError(f"store {reader.url}: no committed shard to train on")
        self.reader, self.shards, self.settings = reader, list(shards), settings
        self.seed, self.rank, self.world, self.pin = seed, rank, world, pin
        self.position = StreamPosition.of(start.as_dict()) if start else StreamPosition()
        # The producer's own copy: the consumer's position drops an exclusion once past its epoch
        self._excluded = {int(e): set(ids) for e, ids in self.position.excluded.items()}
        self.counts = StreamCounts()
        self.last_ids: list[str] = []  # the samples of the batch last handed out
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, prefetch))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, name="batch-prefetch", daemon=True)
        self._thread.start()

    def epoch_batches(self, epoch: int) -> Iterator[tuple[dict, list[str], int]]:
        names, stride = my_shards(self.shards, self.seed, epoch, self.rank, self.world)
        rng = random.Random(f"batches:{self.seed}:{epoch}:{self.rank}")
        excluded = self._excluded.get(epoch, set())
        window: list[dict] = []
        for k, sample in enumerate(self.reader.iter_samples(names, seed=hash_seed(self.seed, epoch), dequantize=False)):
            if (stride and k % self.world != self.rank) or sample["id"] in excluded:
                continue
            window.append(sample)
            if len(window) == self.settings.window:
                yield from window_batches(window, self.settings, rng)
                window = []
        if window:
            yield from window_batches(window, self.settings, rng)

    def _produce(self) -> None:
        try:
            epoch, skip = self.position.epoch, self.position.batches
            while not self._stop.is_set():
                n = 0
                for n, (batch, ids, truncated) in enumerate(self.epoch_batches(epoch), start=1):
                    if n <= skip:  # already trained on before the checkpoint
                        continue
                    if self.pin:
                        batch = {k: v.pin_memory() for k, v in batch.items()}
                    self._put(("batch", epoch, n, (batch, ids, truncated)))
                    if self._stop.is_set():
                        return
                if n == 0 and epoch not in self._excluded:  # (an epoch's rest may be none of this rank's)
                    raise InputError(
                        f"store {self.reader.url}: worker {self.rank} of {self.world} got no "
                        f"sample from shards {self.shards[:4]}...; fewer samples than workers?"
                    )
                epoch, skip = epoch + 1, 0
        except BaseException as exc:  # handed to the consumer, raised there
            self._put(("error", 0, 0, exc))

    def _put(self, item) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.2)
                return
            except queue.Full:
                continue

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        kind, epoch, n, payload = self._queue.get()
        if kind == "error":
            raise payload
        payload, ids, truncated = payload
        p = self.position
        trained = (p.trained if epoch == p.epoch else []) + ids
        # an exclusion lasts until its epoch is over (a same-size resume replays its deal)
        excluded = {e: v for e, v in p.excluded.items() if int(e) >= epoch}
        self.position = StreamPosition(epoch, n, trained, excluded)
        self.last_ids = ids
        self.counts.truncated += truncated
        tokens = int(payload["attention_mask"].sum())
        self.counts.samples += int(payload["segment_ids"].max(dim=-1).values.add(1).sum())
        self.counts.tokens += tokens
        return payload

    def close(self) -> None:
        self._stop.set()


def shard_ids(reader) -> dict[str, list[str]]:
    """Each shard's sample ids in stored order, from the shards' metadata (no state read)."""
    by_shard: dict[str, list[tuple[int, str]]] = {}
    for sid, (shard, k) in reader.index.items():
        by_shard.setdefault(shard, []).append((k, sid))
    return {name: [sid for _, sid in sorted(rows)] for name, rows in by_shard.items()}


def epoch_deal(ids_of: dict[str, list[str]], shards: list[str], seed: int, epoch: int, rank: int, world: int):
    """The ids rank `rank` of `world` is dealt in `epoch`, as BatchStream deals them (in any
    order); `ids_of`: shard_ids of the store."""
    names, stride = my_shards(shards, seed, epoch, rank, world)
    ids = []
    for name in names:
        stored = ids_of.get(name, [])
        ids += [stored[k] for k in sample_order(len(stored), name, hash_seed(seed, epoch))]
    return ids[rank::world] if stride else ids


def elastic_position(saved: list[dict], reader, shards: list[str], seed: int) -> dict:
    """One start for every rank of a new world size from the positions the W ranks of the
    old one saved (module doc): the earliest epoch a rank was in, with every sample a rank
    had trained in that epoch or a later one excluded."""
    if any("trained" not in p for p in saved):
        raise InputError(
            "this checkpoint predates elastic resume (its positions do not list the samples trained): "
            "resume it with its own train.num_workers"
        )
    world, first = len(saved), min(p["epoch"] for p in saved)
    ids_of = shard_ids(reader) if any(p["epoch"] > first for p in saved) else {}
    excluded: dict[str, set[str]] = {}
    for rank, p in enumerate(saved):
        for epoch in range(first, p["epoch"]):  # the epochs this rank had finished
            excluded.setdefault(str(epoch), set()).update(epoch_deal(ids_of, shards, seed, epoch, rank, world))
        excluded.setdefault(str(p["epoch"]), set()).update(p["trained"])
        for e, ids in p.get("excluded", {}).items():  # an earlier resize's, still open
            if int(e) >= first:
                excluded.setdefault(e, set()).update(ids)
    return {"epoch": first, "batches": 0, "trained": [], "excluded": {e: sorted(v) for e, v in excluded.items()}}


def to_device(batch: dict, device, non_blocking: bool = False) -> dict:
    """A batch of `BatchStream` or `eval_batches` on `device`, ready for the step: copied as
    stored (int8 states with their scales where the store is int8), then dequantised there."""
    return decode_batch({k: v.to(device, non_blocking=non_blocking) for k, v in batch.items()})


def hash_seed(seed: int, epoch: int) -> int:
    """One integer seed per (train seed, epoch) for the within-shard shuffle."""
    return (seed * 1_000_003 + epoch) % (2**31)


def eval_batches(
    reader, shards: list[str], batch_size: int, max_seq_len: int, pad_id: int, max_samples: int | None = None
) -> Iterator[dict]:
    """Held-out batches: one sample per row (so per-sample figures are per row), in store
    order; the first `max_samples` samples only (None: all), so that an evaluation every
    `eval_every` steps costs the same at any corpus size. States as stored (`to_device`)."""
    group: list[dict] = []
    samples = reader.iter_samples(shards, dequantize=False)
    if max_samples is not None:
        samples = itertools.islice(samples, max_samples)
    for sample in samples:
        if len(sample["input_ids"]) > max_seq_len:
            sample = {k: (v[:max_seq_len] if k != "id" else v) for k, v in sample.items()}
        group.append(sample)
        if len(group) == batch_size:
            yield collate_samples(group, pad_id)
            group = []
    if group:
        yield collate_samples(group, pad_id)
