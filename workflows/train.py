"""Stage `train`: train the EAGLE-3 draft with training-time test on the target's states.

This version runs in one process: the target computes the captured states of every
training batch once ("online" capture, kept in memory as the store would keep them),
then the flat loop of `eagle3.training` trains the draft. Checkpoints every
`train.checkpoint_every` steps; a rerun with the same config resumes from the last one
(weights, optimizer, step, noise RNG). Outputs in `<run_dir>/train/`:

    checkpoint/      the last checkpoint (see workflows.checkpoint)
    draft/           the final draft weights, config and provenance
    metrics.jsonl    one record per logged step
    metrics.json     final held-out evaluation: per-step accuracy, simulated acceptance
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from eagle3.modeling import Eagle3Draft
from eagle3.target_features import capture_batch
from eagle3.target_head import TargetHead
from eagle3.training import evaluate, train_in_memory
from workflows import checkpoint as ckpt
from workflows.common import atomic_dir, code_version, config_hash, log, mark_done, stage_is_done, write_json_atomic
from workflows.config import FullConfig
from workflows.generate import read_samples
from workflows.vocab import load_vocab


def make_batches(samples: list[dict], batch_size: int, seed: int) -> list[list[dict]]:
    """Length-sorted batches (little padding), visited in a seeded random order."""
    ordered = sorted(samples, key=lambda r: (len(r["input_ids"]), r["id"]))
    batches = [ordered[i : i + batch_size] for i in range(0, len(ordered), batch_size)]
    random.Random(seed).shuffle(batches)
    return batches


@torch.no_grad()
def capture_all(model, groups: list[list[dict]], layer_ids: list[int], pad_id: int, desc: str) -> list[dict]:
    from tqdm import tqdm

    out = []
    for group in tqdm(groups, desc=desc, unit="batch"):
        batch = capture_batch(model, [r["input_ids"] for r in group], [r["loss_mask"] for r in group],
                              layer_ids, pad_id=pad_id)
        out.append(batch)
    return out


def build_draft(cfg: FullConfig, target_model, vocab) -> Eagle3Draft:
    draft_cfg = cfg.draft.build(cfg.target, vocab.d2t.numel())
    torch.manual_seed(cfg.seed)
    draft = Eagle3Draft(draft_cfg)
    draft.load_target_embeddings(target_model.get_input_embeddings().weight.float())
    draft.set_vocab_mapping(vocab.d2t, vocab.t2d)
    return draft


class Tracker:
    """stdout + metrics.jsonl, and W&B when `tracking.wandb` (offline by default)."""

    def __init__(self, cfg: FullConfig, folder: Path):
        self.file = open(folder / "metrics.jsonl", "a")
        self.run = None
        if cfg.tracking.wandb and cfg.tracking.mode != "disabled":
            import wandb
            from eagle3.schema import to_dict

            self.run = wandb.init(project=cfg.tracking.project, dir=str(cfg.run_path), mode=cfg.tracking.mode,
                                  config=json.loads(json.dumps(to_dict(cfg), default=str)), reinit="finish_previous")

    def __call__(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        ev = record.get("eval", {})
        msg = f"step {record['step'] + 1}: loss {record['loss']:.4f} acc0 {record['step_acc'][0]:.3f}"
        if ev:
            msg += f" | eval acc0 {ev['step_acc'][0]:.3f} acceptance(walk, k={ev['k']}) {ev['acceptance_walk']:.3f}"
        log(msg)
        if self.run is not None:
            flat = {"train/loss": record["loss"], "train/lr": record["lr"], "train/grad_norm": record["grad_norm"]}
            flat.update({f"train/acc_{j}": a for j, a in enumerate(record["step_acc"])})
            if ev:
                flat["eval/acceptance_walk"] = ev["acceptance_walk"]
                flat["eval/acceptance_per_position_average"] = ev["acceptance_per_position_average"]
                flat.update({f"eval/acc_{j}": a for j, a in enumerate(ev["step_acc"])})
            self.run.log(flat, step=record["step"] + 1)

    def close(self, summary: dict) -> None:
        self.file.close()
        if self.run is not None:
            self.run.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float))})
            self.run.finish()


def run(cfg: FullConfig, target_path: Path) -> Path:
    from workflows.target import load_target, target_provenance

    out = cfg.run_path / "train"
    samples = read_samples(cfg.run_path)
    vocab, vocab_summary = load_vocab(cfg.run_path)
    from eagle3.schema import to_dict

    key = {"train": to_dict(cfg.train), "draft": to_dict(cfg.draft), "seed": cfg.seed,
           "target": target_provenance(target_path), "vocab": vocab_summary,
           "capture_layer_ids": cfg.target.capture_ids}
    source = cfg.train.data_source
    if source == "auto":
        source = "store" if (cfg.run_path / "capture" / "DONE.json").exists() else "online"
    if source == "store":
        from workflows.train_data import store_key

        key["store"] = store_key(cfg)
    if stage_is_done(out, key):
        log(f"train: reusing {out}")
        return out
    out.mkdir(parents=True, exist_ok=True)
    # A checkpoint may be resumed with another step budget or logging cadence, nothing else.
    resume_key = config_hash({**key, "train": {k: v for k, v in key["train"].items()
                                               if k not in ("steps", "log_every", "checkpoint_every")}})
    train_rows = [r for r in samples if r["split"] == "train"]
    eval_rows = [r for r in samples if r["split"] == "heldout"]
    if not train_rows:
        raise ValueError(f"{cfg.run_path}/generate/samples.parquet has no train-split samples")
    if not eval_rows:
        log("train: no held-out samples (data.heldout_fraction too small?); evaluating on train data")
        eval_rows = train_rows

    model, tokenizer = load_target(target_path, dtype=cfg.train.capture_dtype,
                                   trust_remote_code=cfg.target.trust_remote_code)
    cfg.target.check_against_hf_config(model.config)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = cfg.target.capture_ids
    train_groups = make_batches(train_rows, cfg.train.batch_size, cfg.seed)
    eval_groups = make_batches(eval_rows, cfg.train.batch_size, cfg.seed)
    if source == "store":
        from workflows.train_data import store_batches

        train_batches, eval_batches = store_batches(cfg, target_path, [train_groups, eval_groups], pad_id)
    else:
        train_batches = capture_all(model, train_groups, ids, pad_id, "capture train")
        eval_batches = capture_all(model, eval_groups, ids, pad_id, "capture held-out")
    head = TargetHead.from_hf(model)
    draft = build_draft(cfg, model, vocab)
    del model  # the target's layers are no longer needed; keep memory for training

    provenance = ckpt.provenance_record(cfg, target_provenance(target_path), vocab_summary, code_version())
    resume = ckpt.load_resume_state(out / "checkpoint", resume_key)
    if resume is not None:
        ckpt.load_draft_weights(out / "checkpoint", draft)
        log(f"train: resuming from step {resume['step']} ({out / 'checkpoint'})")

    def save(step, optimizer, generator):
        ckpt.save_checkpoint(out / "checkpoint", draft, provenance, step, optimizer, generator, resume_key)

    tracker = Tracker(cfg, out)
    n_params = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    log(f"train: {len(train_rows)} train / {len(eval_rows)} held-out samples, {n_params / 1e6:.2f}M trainable "
        f"draft parameters, {cfg.train.steps} steps, TTT length {cfg.train.ttt.length}")
    train_in_memory(draft, head, train_batches, cfg.train, eval_batches=eval_batches, log=tracker,
                    resume=resume, checkpoint=save, checkpoint_every=cfg.train.checkpoint_every)
    final = evaluate(draft, head, eval_batches, cfg.train)
    final.update({"steps": cfg.train.steps, "eval_samples": len(eval_rows), "train_samples": len(train_rows),
                  "acceptance_walk_is": "tokens per target pass walking the held-out text (predicts decoding)",
                  "acceptance_per_position_average_is": "1 + leading correct averaged over every position "
                                                        "(overestimates; for comparison only)"})
    with atomic_dir(out / "draft") as tmp:
        ckpt.save_draft(tmp, draft, provenance)
    write_json_atomic(out / "metrics.json", final)
    tracker.close(final)
    mark_done(out, key, {k: final[k] for k in ("acceptance_walk", "acceptance_per_position_average", "k")})
    log(f"train: held-out acceptance (walk, k={final['k']}) {final['acceptance_walk']:.3f}; "
        f"per-position average {final['acceptance_per_position_average']:.3f}; step acc "
        f"{[round(a, 3) for a in final['step_acc']]}")
    return out
