"""Stage `vocab`: the draft vocabulary from the train split's answer tokens.

Writes `<run_dir>/vocab/vocab.safetensors` (d2t int64, t2d bool) and `vocab.json`
(sizes, coverage of the counted tokens, ids filled for lack of data, and the coverage of the
held-out answers: a report only, the held-out split chooses nothing).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from eagle3.vocab import build_draft_vocab, covered_fraction
from workflows.core.cli import stage_main
from workflows.core.config import FullConfig, auto_draft_vocab_size
from workflows.core.errors import InputError
from workflows.core.layout import RunLayout
from workflows.core.log import log
from workflows.core.markers import atomic_dir, run_stage, write_json_atomic
from workflows.core.records import VocabSummary


def count_answer_tokens(samples: list[dict], vocab_size: int) -> torch.Tensor:
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for row in samples:
        ids = torch.tensor(row["input_ids"], dtype=torch.long)
        mask = torch.tensor(row["loss_mask"], dtype=torch.bool)
        if ids.numel() and int(ids.max()) >= vocab_size:
            raise InputError(
                f"corpus sample {row['id']}, field input_ids: token id {int(ids.max())} is outside the target vocab "
                f"({vocab_size}); the corpus was tokenized with another tokenizer"
            )
        counts += torch.bincount(ids[mask], minlength=vocab_size)
    return counts


def run(cfg: FullConfig, target_path: Path | None = None) -> Path:
    layout = RunLayout.of(cfg)
    out = layout.stage_dir("vocab")
    key = {
        "draft_vocab_size": cfg.draft.draft_vocab_size,
        "vocab_size": cfg.target.vocab_size,
        **layout.chain("generate"),
    }

    def build() -> dict:
        corpus = layout.read_corpus()
        samples = [r for r in corpus if r["split"] == "train"]
        counts = count_answer_tokens(samples, cfg.target.vocab_size)
        distinct = int((counts > 0).sum())
        size = cfg.draft.draft_vocab_size or auto_draft_vocab_size(cfg.target.vocab_size, distinct)
        vocab = build_draft_vocab(counts, size, warn=lambda m: log(f"vocab: {m}"))
        heldout = count_answer_tokens([r for r in corpus if r["split"] == "heldout"], cfg.target.vocab_size)
        heldout_covered = covered_fraction(vocab.t2d, heldout)
        summary = VocabSummary(
            draft_vocab_size=size,
            chosen="config" if cfg.draft.draft_vocab_size else "auto",
            target_vocab_size=cfg.target.vocab_size,
            distinct_tokens_seen=distinct,
            counted_tokens=int(counts.sum()),
            covered_fraction=vocab.covered_fraction,
            filled=vocab.filled,
            heldout_covered_fraction=heldout_covered,
        ).as_dict()
        with atomic_dir(out) as tmp:
            save_file({"d2t": vocab.d2t, "t2d": vocab.t2d}, str(tmp / layout.vocab_file.name))
            write_json_atomic(tmp / layout.vocab_summary_file.name, summary)
        log(f"vocab: {summary}")
        if heldout_covered is not None:
            log(
                f"vocab: the draft vocab holds {heldout_covered:.1%} of the held-out answers' tokens; the other "
                f"{1 - heldout_covered:.1%} can never be drafted (a larger draft.draft_vocab_size covers more)"
            )
        return summary

    return run_stage("vocab", out, key, build)


if __name__ == "__main__":  # built only when run: importing this module registers nothing with Hydra
    stage_main("vocab", run)()
