"""Held-out evaluation from the store: loss, per-step accuracy, walk acceptance, broken down.

Besides the totals (eagle3.training.evaluate's figures), two breakdowns say where a draft
is weak: per-step accuracy by the row's position in its sample (`evaluate.length_buckets`
as edges: long contexts are where drafts usually fall off), and walk acceptance by the
sample's prompt length (tokens before the first trained token). Batches hold one sample
per row (workflows.train.data.eval_batches), so a row is a sample.
"""

from __future__ import annotations

import torch

from eagle3.families import family_of
from eagle3.metrics import acceptance
from eagle3.training import autocast_for, forward_batch
from eagle3.ttt import step_weights
from workflows.train.data import to_device


def bucket_names(edges: list[int]) -> list[str]:
    bounds = [0, *edges]
    return [f"{a}-{b}" for a, b in zip(bounds, bounds[1:])] + [f"{edges[-1]}+"]


def bucket_of(value: int, edges: list[int]) -> int:
    for i, edge in enumerate(edges):
        if value < edge:
            return i
    return len(edges)


@torch.no_grad()
def evaluate_heldout(draft, head, batches, loop_cfg, edges: list[int], device) -> dict:
    draft.eval()
    length = family_of(draft).trained_steps(draft.cfg, loop_cfg.ttt)  # TTT steps, or a block's slots
    names = bucket_names(edges)
    hits = torch.zeros(length, dtype=torch.float64)
    sf_hits = torch.zeros(length, dtype=torch.float64)
    sf_counts = torch.zeros(length, dtype=torch.float64)
    sf_sample_sum = torch.zeros(length, dtype=torch.float64)  # per-sample rates, summed
    sf_samples = torch.zeros(length, dtype=torch.float64)  # samples with a scored row at that step
    alphas = torch.zeros(length, dtype=torch.float64)
    counts = torch.zeros(length, dtype=torch.float64)
    pos_hits = torch.zeros(len(names), length, dtype=torch.float64)
    pos_counts = torch.zeros(len(names), length, dtype=torch.float64)
    total, by_prompt, loss_sum, n_batches, n_samples = None, {}, 0.0, 0, 0
    for batch in batches:
        batch = to_device(batch, device)
        with autocast_for(loop_cfg.compute_dtype, device):
            s = forward_batch(draft, head, batch, loop_cfg.ttt, train=False, objective=loop_cfg.objective)
        loss_sum += float(s.loss)
        n_batches += 1
        n_samples += batch["input_ids"].shape[0]  # one sample per row (eval_batches)
        w, c = s.weights.double().cpu(), s.correct.double().cpu()
        hits += (c * w).sum((0, 1))
        sf_w = (
            step_weights(
                batch["loss_mask"], batch["attention_mask"], length, segment_ids=batch.get("segment_ids"), rows="input"
            )
            .double()
            .cpu()
        )
        sf_hits += (c * sf_w).sum((0, 1))
        sf_counts += sf_w.sum((0, 1))
        row_hits, row_counts = (c * sf_w).sum(1), sf_w.sum(1)  # [B, L]: one sample per row
        sf_sample_sum += (row_hits / row_counts.clamp_min(1)).sum(0)  # a row without scored rows adds 0
        sf_samples += (row_counts > 0).sum(0)
        alphas += s.step_alpha_t.double().cpu() * w.sum((0, 1))
        counts += w.sum((0, 1))
        positions = batch["position_ids"].cpu()
        for i in range(len(names)):
            lo = 0 if i == 0 else edges[i - 1]
            hi = edges[i] if i < len(edges) else None
            sel = (positions >= lo) & (positions < hi if hi is not None else True)
            pos_hits[i] += (c * w * sel[..., None]).sum((0, 1))
            pos_counts[i] += (w * sel[..., None]).sum((0, 1))
        correct, loss_mask, attn = s.correct.cpu(), batch["loss_mask"].cpu(), batch["attention_mask"].cpu()
        segments = batch["segment_ids"].cpu()
        for b in range(correct.shape[0]):
            acc = acceptance(
                correct[b : b + 1],
                loss_mask[b : b + 1],
                attn[b : b + 1],
                loop_cfg.acceptance_k,
                segment_ids=segments[b : b + 1],
            )
            total = acc if total is None else total.merge(acc)
            trained = loss_mask[b].nonzero()
            prompt_len = int(trained[0]) if len(trained) else int(attn[b].sum())
            key = names[bucket_of(prompt_len, edges)]
            by_prompt[key] = acc if key not in by_prompt else by_prompt[key].merge(acc)
    if total is None:
        raise ValueError("held-out evaluation got no batch")

    def rate(h, n):
        return [float(a / b) if b else float("nan") for a, b in zip(h.tolist(), n.tolist())]

    return {
        **total.as_dict(),
        "loss": loss_sum / n_batches,
        "eval_samples": n_samples,
        "step_acc": rate(hits, counts),
        # The same accuracy over SpecForge 0.2.0's scored rows (eagle3.ttt.step_weights, rows="input").
        "step_acc_specforge_rows": rate(sf_hits, sf_counts),
        # ...averaged per sample instead of pooled over tokens: SpecForge's own figure, which
        # averages per batch and was reported at batch 1 (docs/results.md, the equal-data comparison).
        "step_acc_specforge_per_sample": rate(sf_sample_sum, sf_samples),
        "step_alpha": rate(alphas, counts),  # mean sum_v min(p_target, p_draft) per step
        "step_acc_by_position": {
            names[i]: rate(pos_hits[i], pos_counts[i]) for i in range(len(names)) if pos_counts[i, 0] > 0
        },
        "acceptance_walk_by_prompt_length": {
            k: {"acceptance_walk": v.walk, "passes": v.passes}
            for k, v in sorted(by_prompt.items(), key=lambda kv: names.index(kv[0]))
        },
    }
