"""Stage `vocab`: the draft vocabulary from the train split's answer tokens.

Writes `<run_dir>/vocab/vocab.safetensors` (d2t int64, t2d bool) and `vocab.json`
(sizes, coverage of the counted tokens, ids filled for lack of data).
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eagle3.vocab import DraftVocab, build_draft_vocab
from workflows.common import atomic_dir, log, mark_done, read_json, stage_is_done, write_json_atomic
from eagle3.schema import ConfigError
from workflows.config import FullConfig, auto_draft_vocab_size
from workflows.generate import read_samples


def count_answer_tokens(samples: list[dict], vocab_size: int) -> torch.Tensor:
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for row in samples:
        ids = torch.tensor(row["input_ids"], dtype=torch.long)
        mask = torch.tensor(row["loss_mask"], dtype=torch.bool)
        if ids.numel() and int(ids.max()) >= vocab_size:
            raise ValueError(
                f"sample {row['id']}: token id {int(ids.max())} is outside the target vocab "
                f"({vocab_size}); the corpus was tokenized with another tokenizer"
            )
        counts += torch.bincount(ids[mask], minlength=vocab_size)
    return counts


def run(cfg: FullConfig) -> Path:
    out = cfg.run_path / "vocab"
    samples = [r for r in read_samples(cfg.run_path) if r["split"] == "train"]
    key = {"draft_vocab_size": cfg.draft.draft_vocab_size, "vocab_size": cfg.target.vocab_size,
           "generate": read_json(cfg.run_path / "generate" / "DONE.json")["key"]}
    if stage_is_done(out, key):
        log(f"vocab: reusing {out}")
        return out
    counts = count_answer_tokens(samples, cfg.target.vocab_size)
    distinct = int((counts > 0).sum())
    size = cfg.draft.draft_vocab_size or auto_draft_vocab_size(cfg.target.vocab_size, distinct)
    if size > cfg.target.vocab_size:
        raise ConfigError(f"draft.draft_vocab_size={size} exceeds the target's vocab_size={cfg.target.vocab_size}")
    vocab = build_draft_vocab(counts, size, warn=lambda m: log(f"vocab: {m}"))
    summary = {
        "draft_vocab_size": size, "chosen": "config" if cfg.draft.draft_vocab_size else "auto",
        "target_vocab_size": cfg.target.vocab_size,
        "distinct_tokens_seen": distinct, "counted_tokens": int(counts.sum()),
        "covered_fraction": vocab.covered_fraction, "filled": vocab.filled,
    }
    with atomic_dir(out) as tmp:
        save_file({"d2t": vocab.d2t, "t2d": vocab.t2d}, str(tmp / "vocab.safetensors"))
        write_json_atomic(tmp / "vocab.json", summary)
    mark_done(out, key, summary)
    log(f"vocab: {summary}")
    return out


def load_vocab(run_dir: Path) -> tuple[DraftVocab, dict]:
    folder = run_dir / "vocab"
    if not (folder / "DONE.json").exists():
        raise FileNotFoundError(f"{folder}: the vocab stage has not finished; run stages=[vocab] first")
    t = load_file(str(folder / "vocab.safetensors"))
    summary = read_json(folder / "vocab.json")
    return DraftVocab(d2t=t["d2t"], t2d=t["t2d"], covered_fraction=summary["covered_fraction"],
                      filled=summary["filled"]), summary
