"""The reference decoder's figures for the evaluate stage: the offline walk over TTT
outputs, decoding against plain decoding (greedy: token for token, with each divergence
explained; sampled: pooled over seeds with a standard error), and the offline expectation
at a sampling temperature."""

from __future__ import annotations

import torch

from eagle3.families import family_of
from eagle3.metrics import Acceptance, SlotCounts, acceptance, expected_acceptance_length, ratio_interval
from eagle3.spec_decode import SpeculativeDecoder, greedy_decode
from eagle3.training import acceptance_rates_at, forward_batch
from eagle3.ttt import TTTConfig
from workflows.core.config import EvaluateSection
from workflows.core.log import log


@torch.no_grad()
def offline_acceptance(draft, head, groups, batches, k: int) -> tuple[Acceptance, list[Acceptance]]:
    """Walk acceptance overall and per row, from teacher-forced TTT outputs."""
    draft.eval()
    total, per_row = Acceptance(k=k), []
    for group, batch in zip(groups, batches):
        scores = forward_batch(draft, head, batch, TTTConfig(length=k), train=False, steps=k)
        for i in range(len(group)):
            acc = acceptance(
                scores.correct[i : i + 1], batch["loss_mask"][i : i + 1], batch["attention_mask"][i : i + 1], k
            )
            per_row.append(acc)
            total = total.merge(acc)
    return total, per_row


TIE_ULPS = 4  # a top-2 margin within this many units in the last place of the top logit is a tie


def divergence(prompt_id, decoded: list[int], greedy: list[int], margins: list[tuple[float, float]], dtype) -> dict:
    """Where speculative decoding left plain greedy decoding on one prompt, and why it may
    have: the target's top-2 logit margin there (plain decoding's), against the resolution
    of the dtype at that logit. The verify pass and one-token decoding run other kernels on
    other shapes, so in bf16 a near-tie can flip: a `numerical tie`. A wider margin that
    still flipped is a `defect` (wrong masks, positions or caches), as is any flip in fp32
    unless its margin is below fp32's own resolution."""
    at = next((i for i, (a, b) in enumerate(zip(decoded, greedy)) if a != b), min(len(decoded), len(greedy)))
    top, margin = margins[at] if at < len(margins) else (float("nan"), float("nan"))
    resolution = TIE_ULPS * torch.finfo(dtype).eps * max(1.0, abs(top))
    return {
        "prompt": prompt_id,
        "position": at,
        "decoded": decoded[at] if at < len(decoded) else None,
        "greedy": greedy[at] if at < len(greedy) else None,
        "top_logit": top,
        "top2_margin": margin,
        "resolution": resolution,
        "dtype": str(dtype).removeprefix("torch."),
        "kind": "numerical tie" if margin <= resolution else "defect",
    }


def decode_all(
    model,
    draft,
    rows,
    capture_ids,
    num_steps,
    topk,
    num_draft_tokens,
    eos,
    sglang_compatible: bool = False,
    temperature: float = 0.0,
    seed: int = 0,
    plain: bool = True,
) -> dict:
    """The reference decoder on each row's prompt, for its answer's length, against plain
    decoding: greedy at temperature 0 (then `lossless` is token for token), else sampled
    from generators seeded by `seed` (then only the distributions agree, and `lossless` and
    `text_agreement` are None). `plain=False` skips plain decoding (no speed-up, no
    comparison): what a sampled acceptance figure needs."""
    sample = torch.Generator(device=model.device).manual_seed(seed)
    decoder = SpeculativeDecoder(
        model,
        family_of(draft).drafter(draft, sglang_compatible),
        capture_ids,
        num_steps,
        topk,
        num_draft_tokens,
        eos,
        temperature=temperature,
        generator=sample,
    )
    plain_sample = torch.Generator(device=model.device).manual_seed(seed + 1)
    gained = forwards = accepted_uncut = 0
    slots = SlotCounts.zeros(num_steps)
    spec_s = plain_s = 0.0
    drafted = 0  # draft tokens sent to verification (fewer than k a pass where a DSpark draft's confidence cuts)
    lossless, agree, total, per_row, greedy, divergences = True, 0, 0, [], [], []
    try:
        for r in rows:
            s = r["loss_mask"].index(1)
            prompt, answer = r["input_ids"][:s], r["input_ids"][s:]
            res = decoder.generate(prompt, len(answer))
            if plain:
                margins = [] if temperature == 0 else None  # top-2 margins explain a greedy divergence only
                reference, t_plain = greedy_decode(
                    model, prompt, len(answer), eos, margins=margins, temperature=temperature, generator=plain_sample
                )
                greedy.append(reference)
                lossless &= res.tokens == reference
                if temperature == 0 and res.tokens != reference:
                    divergences.append(divergence(r["id"], res.tokens, reference, margins, model.dtype))
                agree += sum(a == b for a, b in zip(reference, answer))
                plain_s += t_plain
            total += len(answer)
            gained, forwards = gained + res.gained, forwards + res.target_forwards
            accepted_uncut += res.accepted_uncut
            drafted += res.drafted
            slots = slots.merge(res.slots)
            spec_s += res.seconds
            per_row.append(
                {
                    "id": r["id"],
                    "prompt_tokens": s,
                    "acceptance": res.acceptance_length,
                    "gained": res.gained,
                    "passes": res.target_forwards,
                    "tokens": len(res.tokens),
                    "accepted_uncut": res.accepted_uncut,
                }
            )
    finally:
        decoder.target.close()
    tokens = sum(p["tokens"] for p in per_row)
    return {
        "acceptance": gained / forwards if forwards else float("nan"),
        "target_forwards": forwards,
        # SGLang's figure: completion tokens (the prefill's token included) / verify passes.
        "acceptance_sglang": tokens / forwards if forwards else float("nan"),
        # vLLM's figure: (accepted drafts + passes) / passes, accepted drafts counted before the
        # cut at the answer's length (vLLM counts them so).
        "acceptance_vllm": (accepted_uncut + forwards) / forwards if forwards else float("nan"),
        "per_position_acceptance": slots.rate,
        "verified_per_pass": drafted / forwards if forwards else float("nan"),
        "lossless": bool(lossless) if temperature == 0 and plain else None,
        "divergences": divergences,
        "text_agreement": (agree / total if total else float("nan")) if temperature == 0 and plain else None,
        "tokens_per_s_spec": tokens / spec_s,
        "tokens_per_s_plain": tokens / plain_s if plain else float("nan"),
        "speedup": plain_s / spec_s if plain else float("nan"),
        "per_row": per_row,
        "greedy": greedy,
    }


def decode_sampled(
    model, draft, rows, ids, num_steps, topk, num_draft_tokens, eos, temperature: float, seeds: list[int]
) -> dict:
    """The reference decoder sampling at `temperature`, once per seed: acceptance pooled over
    prompts and seeds, with its standard error, per definition (ours, SGLang's, vLLM's)."""
    runs = {"tokens_per_pass": [], "sglang": [], "vllm": []}
    for seed in seeds:
        dec = decode_all(
            model,
            draft,
            rows,
            ids,
            num_steps,
            topk,
            num_draft_tokens,
            eos,
            sglang_compatible=topk > 1,
            temperature=temperature,
            seed=seed,
            plain=False,
        )
        for p in dec["per_row"]:
            runs["tokens_per_pass"].append((p["gained"], p["passes"]))
            runs["sglang"].append((p["tokens"], p["passes"]))
            runs["vllm"].append((p["accepted_uncut"] + p["passes"], p["passes"]))
    return {name: dict(zip(("value", "standard_error"), ratio_interval(pairs))) for name, pairs in runs.items()}


def at_temperature(e: EvaluateSection, model, draft, head, rows, batches, ids, eos) -> dict:
    """Acceptance when the target samples at `evaluate.temperature`: the offline expectation
    from the per-step acceptance rates of the draft's own guesses (eagle3.training.
    acceptance_rates_at, eagle3.metrics.expected_acceptance_length), and the reference
    decoder sampling once per seed of `evaluate.seeds`, pooled over prompts and seeds with
    a standard error (eagle3.metrics.ratio_interval) in each engine's definition."""
    k = e.num_steps
    sums = counts = 0
    for batch in batches:
        s, c = acceptance_rates_at(draft, head, batch, k, e.temperature)
        sums, counts = sums + s, counts + c
    rates = (sums / counts.clamp_min(1)).tolist()
    figures = decode_sampled(model, draft, rows, ids, k, e.topk, e.num_draft_tokens, eos, e.temperature, e.seeds)
    log(
        f"evaluate: at temperature {e.temperature:g}: offline expectation {expected_acceptance_length(rates):.3f}, "
        f"decoded {figures['tokens_per_pass']['value']:.3f} "
        f"+- {1.96 * figures['tokens_per_pass']['standard_error']:.3f} "
        f"({len(e.seeds)} seeds x {len(rows)} prompts)"
    )
    return {
        "temperature": e.temperature,
        "seeds": list(e.seeds),
        "per_step_acceptance_rate_offline": rates,
        "acceptance_offline_expected": expected_acceptance_length(rates),
        "decoded": figures,
    }
