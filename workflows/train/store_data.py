"""Training batches read from the capture stage's store (train.data_source=store).

The store is opened expecting the capture contract this config implies (workflows.core.
provenance: target path and weights, layers and convention, hidden size, tokenizer and
chat template, what `final` holds, engine backend and dtype): one that contradicts it is
refused, naming the field. Each sample's tokens must equal the corpus row the trainer was
given, so a store captured from another corpus is refused too.
"""
from __future__ import annotations

from eagle3.target_features import collate_samples
from storage.store import StoreError
from workflows.core.layout import RunLayout
from workflows.core.provenance import capture_contract


def store_batches(cfg, identity: dict, groups_list: list[list[list[dict]]], pad_id: int) -> list:
    """For each list of sample groups, the training batches read from the store."""
    layout = RunLayout.of(cfg)
    reader = layout.open_store(expect=capture_contract(cfg, identity))
    out = []
    for groups in groups_list:
        batches = []
        for group in groups:
            samples = []
            for row in group:
                if row["id"] not in reader.index:
                    raise StoreError(f"store {layout.store_url}: sample {row['id']!r} of the corpus was never "
                                     "captured; rerun stages=[capture]")
                s = reader.sample(row["id"])
                if s["input_ids"].tolist() != list(row["input_ids"]):
                    raise StoreError(f"store {layout.store_url}: sample {row['id']!r} holds other tokens than the "
                                     "corpus (captured from another generate run?); recapture into a new store")
                samples.append(s)
            batches.append(collate_samples(samples, pad_id))
        out.append(batches)
    return out
