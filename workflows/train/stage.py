"""Stage `train`: train the EAGLE-3 draft with training-time test on the target's states.

The target states come from the capture stage's store (`train.data_source=store`, the
default once capture has finished in the run folder), or are computed here by the target
("online", kept in memory). The flat loop of `eagle3.training` then trains the draft in
this process. Checkpoints every `train.checkpoint_every` steps; a rerun with the same
config resumes from the last one (weights, optimizer, step, noise RNG). Outputs in
`<run_dir>/train/`:

    checkpoint/      the last checkpoint (see workflows.train.checkpoint)
    draft/           the final draft weights, config and provenance
    metrics.jsonl    one record per logged step
    metrics.json     final held-out evaluation: per-step accuracy, simulated acceptance
"""
from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import torch

from eagle3.modeling import Eagle3Draft
from eagle3.schema import to_dict
from eagle3.target_head import TargetHead
from eagle3.training import evaluate, train_in_memory
from workflows.core.cli import log
from workflows.core.config import FullConfig
from workflows.core.draft_files import load_draft_weights, save_draft
from workflows.core.engines import EngineSpec, HFEngine
from workflows.core.errors import InputError
from workflows.core.layout import RunLayout
from workflows.core.markers import (
    atomic_dir,
    clear_done,
    config_hash,
    mark_done,
    stage_is_done,
    write_json_atomic,
)
from workflows.core.precision import resolve
from workflows.core.provenance import draft_provenance, identity_for
from workflows.train import checkpoint as ckpt
from workflows.train.store_data import store_batches
from workflows.train.tracking import Tracker

# Settings a checkpoint may be resumed with changed: the step budget and the cadences.
RESUMABLE_CHANGES = ("steps", "log_every", "checkpoint_every")


def make_batches(samples: list[dict], batch_size: int, seed: int) -> list[list[dict]]:
    """Length-sorted batches (little padding), visited in a seeded random order."""
    ordered = sorted(samples, key=lambda r: (len(r["input_ids"]), r["id"]))
    batches = [ordered[i : i + batch_size] for i in range(0, len(ordered), batch_size)]
    random.Random(seed).shuffle(batches)
    return batches


def build_draft(cfg: FullConfig, target_model, vocab) -> Eagle3Draft:
    draft_cfg = cfg.draft.build(cfg.target, vocab.d2t.numel())
    torch.manual_seed(cfg.seed)
    draft = Eagle3Draft(draft_cfg)
    draft.load_target_embeddings(target_model.get_input_embeddings().weight.float())
    draft.set_vocab_mapping(vocab.d2t, vocab.t2d)
    return draft


def data_source(cfg: FullConfig, layout: RunLayout) -> str:
    if cfg.train.data_source != "auto":
        return cfg.train.data_source
    return "store" if layout.done_key("capture") is not None else "online"


def run(cfg: FullConfig, target_path: Path) -> Path:
    # "auto" settles here, on this machine; the key and the loop see the dtype really used.
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, compute_dtype=resolve(cfg.train.compute_dtype)))
    layout = RunLayout.of(cfg)
    out = layout.stage_dir("train")
    samples = layout.read_corpus()
    vocab, vocab_summary = layout.read_vocab()
    identity = identity_for(cfg, target_path)
    source = data_source(cfg, layout)
    key = {"train": to_dict(cfg.train), "draft": to_dict(cfg.draft), "seed": cfg.seed, "target": identity,
           "capture_layer_ids": cfg.target.capture_ids,
           **layout.chain("generate", "vocab", *(["capture"] if source == "store" else []))}
    if stage_is_done(out, key):
        log(f"train: reusing {out}")
        return out
    clear_done(out)
    out.mkdir(parents=True, exist_ok=True)
    resume_key = config_hash({**key, "train": {k: v for k, v in key["train"].items() if k not in RESUMABLE_CHANGES}})
    train_rows = [r for r in samples if r["split"] == "train"]
    eval_rows = [r for r in samples if r["split"] == "heldout"]
    if not train_rows:
        raise InputError(f"{layout.corpus_shards}: the corpus has no train-split sample")
    if not eval_rows:
        log("train: no held-out samples (data.heldout_fraction too small?); evaluating on train data")
        eval_rows = train_rows

    engine = HFEngine(EngineSpec(str(target_path), dtype=resolve(cfg.train.capture_dtype),
                                 layer_ids=cfg.target.capture_ids, trust_remote_code=cfg.target.trust_remote_code))
    cfg.target.check_against_hf_config(engine.model.config)
    train_groups = make_batches(train_rows, cfg.train.batch_size, cfg.seed)
    eval_groups = make_batches(eval_rows, cfg.train.batch_size, cfg.seed)
    if source == "store":
        train_batches, eval_batches = store_batches(cfg, identity, [train_groups, eval_groups], engine.pad_id)
    else:
        train_batches = engine.training_batches(train_groups, "capture train")
        eval_batches = engine.training_batches(eval_groups, "capture held-out")
    head = TargetHead.from_hf(engine.model)
    draft = build_draft(cfg, engine.model, vocab)
    del engine  # the target's layers are no longer needed; keep memory for training

    provenance = draft_provenance(cfg, identity, vocab_summary)
    resume = ckpt.load_resume_state(layout.checkpoint_dir, resume_key)
    if resume is not None:
        load_draft_weights(layout.checkpoint_dir, draft)
        log(f"train: resuming from step {resume['step']} ({layout.checkpoint_dir})")

    def save(step, optimizer, generator):
        ckpt.save_checkpoint(layout.checkpoint_dir, draft, provenance, step, optimizer, generator, resume_key)

    tracker = Tracker(cfg, out, resume_step=resume["step"] if resume else 0)
    n_params = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    log(f"train: {len(train_rows)} train / {len(eval_rows)} held-out samples ({source}), {n_params / 1e6:.2f}M "
        f"trainable draft parameters, {cfg.train.steps} steps, TTT length {cfg.train.ttt.length}")
    train_in_memory(draft, head, train_batches, cfg.train, eval_batches=eval_batches, log=tracker,
                    resume=resume, checkpoint=save, checkpoint_every=cfg.train.checkpoint_every)
    final = evaluate(draft, head, eval_batches, cfg.train)
    final.update({"steps": cfg.train.steps, "eval_samples": len(eval_rows), "train_samples": len(train_rows),
                  "acceptance_walk_is": "tokens per target pass walking the held-out text (predicts decoding)",
                  "acceptance_per_position_average_is": "1 + leading correct averaged over every position "
                                                        "(overestimates; for comparison only)"})
    with atomic_dir(layout.draft_dir) as tmp:
        save_draft(tmp, draft, provenance)
    write_json_atomic(out / "metrics.json", final)
    tracker.close(final)
    mark_done(out, key, {k: final[k] for k in ("acceptance_walk", "acceptance_per_position_average", "k")})
    log(f"train: held-out acceptance (walk, k={final['k']}) {final['acceptance_walk']:.3f}; "
        f"per-position average {final['acceptance_per_position_average']:.3f}; step acc "
        f"{[round(a, 3) for a in final['step_acc']]}")
    return out
