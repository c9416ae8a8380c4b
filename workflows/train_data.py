"""Training batches read from the capture stage's store (train.data_source=store).

The store is opened with the fields this config implies (capture ids and convention,
hidden size, layer count, tokenizer and chat-template hashes, what `final` holds): one
that contradicts them is refused, naming the field. Each sample's tokens must equal the
corpus row the trainer was given, so a store captured from another corpus is refused too.
"""
from __future__ import annotations

from pathlib import Path

from eagle3.layer_ids import CONVENTION
from eagle3.target_features import FINAL_IS_NORMED
from storage.reader import StoreReader, collate
from storage.store import StoreError
from workflows.config import FullConfig


def expected_provenance(cfg: FullConfig, target_path: Path) -> dict:
    from workflows.target import target_provenance

    tp = target_provenance(target_path)
    return {"num_layers": cfg.target.num_layers, "hidden_size": cfg.target.hidden_size,
            "capture_layer_ids": cfg.target.capture_ids, "layer_id_convention": CONVENTION,
            "final_is_normed": FINAL_IS_NORMED, "tokenizer_sha256": tp["tokenizer_sha256"],
            "chat_template_sha256": tp["chat_template_sha256"]}


def store_key(cfg: FullConfig) -> dict:
    """What identifies the store's content for the train stage's done-marker."""
    from workflows.capture import store_url
    from workflows.common import read_json

    done = read_json(cfg.run_path / "capture" / "DONE.json") if (cfg.run_path / "capture" / "DONE.json").exists() else {}
    return {"url": store_url(cfg), "capture_key": done.get("key")}


def store_batches(cfg: FullConfig, target_path: Path, groups_list: list[list[list[dict]]], pad_id: int) -> list:
    """For each list of sample groups, the training batches read from the store."""
    from workflows.capture import store_url

    url = store_url(cfg)
    reader = StoreReader(url, cfg.capture.storage_options, expect=expected_provenance(cfg, target_path))
    out = []
    for groups in groups_list:
        batches = []
        for group in groups:
            samples = []
            for row in group:
                if row["id"] not in reader.index:
                    raise StoreError(f"store {url}: sample {row['id']!r} of the corpus was never captured; "
                                     "rerun stages=[capture]")
                s = reader.sample(row["id"])
                if s["input_ids"].tolist() != list(row["input_ids"]):
                    raise StoreError(f"store {url}: sample {row['id']!r} holds other tokens than the corpus "
                                     "(captured from another generate run?); recapture into a new store")
                samples.append(s)
            batches.append(collate(samples, pad_id))
        out.append(batches)
    return out
