"""Where a trainer's batches come from: one interface, three sources.

A batch source is opened for one rank and then hands out that rank's training batches,
endlessly (a source that never runs dry keeps the ranks' collective calls in step), says
where it is for the checkpoint (a plain dict, `state()`, given back to `open` on resume),
makes the held-out batches rank 0 evaluates, and counts what it handed out:

    source.open(settings, seed, rank, world, state, prefetch, pin)
    source.next_batch() -> dict                   a batch as stored (workflows.train.data.to_device)
    source.state() -> dict                        the position, for loop_rank<r>.json
    source.elastic_position(saved, seed) -> dict  a start for another world size (store path)
    source.epoch -> int                           the epoch the last batch came from
    source.heldout_batches(batch_size, max_seq_len, pad_id, max_samples) -> Iterator[dict]
    source.counts() -> dict                       samples, tokens, truncated (and the source's own)
    source.skipped -> dict                        corrupt shards passed over
    source.close()

`ShardSource` reads named shards through a reader: the store's (storage.reader.StoreReader)
or states held in memory (`SamplesInMemory`, the online path), batched by
workflows.train.data.BatchStream. The streaming source (workflows.train.stream_source)
receives the states from engine actors through Ray Data.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Iterator

from workflows.train.data import BatchSettings, BatchStream, StreamPosition, elastic_position, eval_batches


class ShardSource:
    """Batches of named, re-readable shards (a store, or shards held in memory)."""

    def __init__(self, reader, train_shards: list[str], heldout_shards: list[str], ledger: Path | None = None):
        """`ledger`: a folder where each rank records the ids of every batch it trains
        (`rank<r>.jsonl`: epoch, batch, ids, worker host:pid; a resumed batch's line is written
        again, the last line of each epoch and batch counts), as the stream's ledger."""
        self.reader, self.train_shards, self.heldout_shards = reader, list(train_shards), list(heldout_shards)
        self.stream: BatchStream | None = None
        self.ledger, self._ledger = ledger, None

    @property
    def url(self) -> str:
        return self.reader.url

    @property
    def skipped(self) -> dict:
        return self.reader.skipped

    def open(
        self,
        settings: BatchSettings,
        seed: int,
        rank: int,
        world: int,
        state: dict | None,
        prefetch: int,
        pin: bool,
    ) -> None:
        self.stream = BatchStream(
            self.reader,
            self.train_shards,
            settings,
            seed,
            rank,
            world,
            start=StreamPosition.of(state) if state else None,
            prefetch=prefetch,
            pin=pin,
        )
        if self.ledger is not None:
            self.ledger.mkdir(parents=True, exist_ok=True)
            self._ledger = open(self.ledger / f"rank{rank}.jsonl", "a")
            self._worker = f"{socket.gethostname()}:{os.getpid()}"

    def next_batch(self) -> dict:
        batch = next(self.stream)
        if self._ledger is not None:
            p = self.stream.position
            line = {"epoch": p.epoch, "batch": p.batches, "ids": self.stream.last_ids, "worker": self._worker}
            self._ledger.write(json.dumps(line) + "\n")
            self._ledger.flush()
        return batch

    def elastic_position(self, saved: list[dict], seed: int) -> dict:
        """The start of every rank of a new world size (workflows.train.data.elastic_position)."""
        return elastic_position(saved, self.reader, self.train_shards, seed)

    def state(self) -> dict:
        return self.stream.position.as_dict()

    @property
    def epoch(self) -> int:
        return self.stream.position.epoch

    def heldout_batches(self, batch_size: int, max_seq_len: int, pad_id: int, max_samples: int) -> Iterator[dict]:
        # No held-out shard (a tiny corpus): evaluate on the train shards, as before.
        shards = self.heldout_shards or self.train_shards
        return eval_batches(self.reader, shards, batch_size, max_seq_len, pad_id, max_samples=max_samples)

    def counts(self) -> dict:
        c = self.stream.counts
        return {"samples": c.samples, "tokens": c.tokens, "truncated": c.truncated}

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
        if self._ledger is not None:
            self._ledger.close()
            self._ledger = None
