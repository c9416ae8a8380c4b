"""Stage `evaluate`: does the offline acceptance predict decoding? `<run_dir>/report/`.

For the same held-out answers and the same k draft tokens per target pass:

* **offline**: the training-time-test outputs of the draft, walked as greedy decoding
  walks the text (`eagle3.metrics`): the figure training reports;
* **decoded**: the reference speculative decoder (`eagle3.spec_decode`) with the
  exported draft on the answers' prompts, checked token for token against plain greedy
  decoding (`lossless`), timed against it (`speedup_decoded`).

When the evaluated drafting is a tree (`evaluate.topk > 1`), it is decoded a second time
with SGLang's draft attention (`Eagle3Drafter(sglang_compatible=True)`: from depth 3 on a
draft token attends to the frontier rank's KV slots, not its ancestors; see
`eagle3.spec_decode`), reported under `sglang_draft_attention`: the figure to compare with
SGLang's served accept length.

`parity_ratio = acceptance_offline / acceptance_decoded`; 1.0 means the offline figure
predicts decoding. Each answer is cut to `evaluate.max_new_tokens` on both sides, and
the target and draft run in `evaluate.dtype` on both sides, so a gap means the draft
behaves differently when decoding (or that the target's own greedy text differs from
the stored one: `text_agreement` says how often).

Precision: by default (`auto`) the figures are computed in the serving dtype (the export's,
`target.dtype`) wherever this machine runs it fast; the offline walk is then computed in
float32 too, and the report flags a gap above 2%. On a CPU without bf16 units (bf16 there
ran 30-60x slower than fp32) the evaluation runs in float32 and says so.

The draft scored is the one the train stage of this run produced: its export (the weights
as served, in the serving dtype) when the export was made from it, else its own weights.

    python -m workflows.evaluate target=tiny run_dir=runs/tiny
"""
from __future__ import annotations

import bisect
from pathlib import Path

import torch

from eagle3.metrics import Acceptance, SlotCounts, acceptance, assistant_spans
from eagle3.modeling import Eagle3Draft
from eagle3.schema import to_dict
from eagle3.spec_decode import Eagle3Drafter, SpeculativeDecoder, greedy_decode
from eagle3.target_head import TargetHead
from eagle3.training import forward_batch
from eagle3.ttt import TTTConfig
from workflows.core.cli import log, stage_main
from workflows.core.config import FullConfig
from workflows.core.draft_files import load_draft_config, load_draft_weights
from workflows.core.engines import EngineSpec, HFEngine
from workflows.core.errors import InputError
from workflows.core.layout import RunLayout
from workflows.core.markers import atomic_dir, mark_done, read_json, read_marker, stage_is_done, write_json_atomic
from workflows.core.provenance import identity_for
from workflows.core.sglang import speculative_args


def heldout_rows(layout: RunLayout, limit: int, max_new_tokens: int) -> list[dict]:
    """Held-out conversations cut to their first answer's first `max_new_tokens` tokens."""
    rows = sorted((r for r in layout.read_corpus() if r["split"] == "heldout"), key=lambda r: r["id"])
    if not rows:
        raise InputError(f"{layout.corpus_shards}: the corpus has no held-out sample (raise data.heldout_fraction)")
    out = []
    for r in rows:
        spans = assistant_spans(torch.tensor(r["loss_mask"]))
        if not spans or spans[0][0] < 1 or spans[0][1] - spans[0][0] < 2:
            continue  # no answer to decode after a prompt
        s, e = spans[0][0], min(spans[0][1], spans[0][0] + max_new_tokens)
        out.append({"id": r["id"], "input_ids": r["input_ids"][:e], "loss_mask": [0] * s + [1] * (e - s)})
        if len(out) == limit:
            break
    return out


@torch.no_grad()
def offline_acceptance(draft, head, groups, batches, k: int) -> tuple[Acceptance, list[Acceptance]]:
    """Walk acceptance overall and per row, from teacher-forced TTT outputs."""
    draft.eval()
    total, per_row = Acceptance(k=k), []
    for group, batch in zip(groups, batches):
        scores = forward_batch(draft, head, batch, TTTConfig(length=k), train=False)
        for i in range(len(group)):
            acc = acceptance(scores.correct[i : i + 1], batch["loss_mask"][i : i + 1],
                             batch["attention_mask"][i : i + 1], k)
            per_row.append(acc)
            total = total.merge(acc)
    return total, per_row


def decode_all(model, draft, rows, capture_ids, num_steps, topk, num_draft_tokens, eos,
               sglang_compatible: bool = False) -> dict:
    decoder = SpeculativeDecoder(model, Eagle3Drafter(draft, sglang_compatible), capture_ids, num_steps, topk,
                                 num_draft_tokens, eos)
    gained = forwards = 0
    slots = SlotCounts.zeros(num_steps)
    spec_s = plain_s = 0.0
    lossless, agree, total, per_row = True, 0, 0, []
    try:
        for r in rows:
            s = r["loss_mask"].index(1)
            prompt, answer = r["input_ids"][:s], r["input_ids"][s:]
            plain, t_plain = greedy_decode(model, prompt, len(answer), eos)
            res = decoder.generate(prompt, len(answer))
            lossless &= res.tokens == plain
            agree += sum(a == b for a, b in zip(plain, answer))
            total += len(answer)
            gained, forwards = gained + res.gained, forwards + res.target_forwards
            slots = slots.merge(res.slots)
            spec_s, plain_s = spec_s + res.seconds, plain_s + t_plain
            per_row.append({"id": r["id"], "prompt_tokens": s, "acceptance": res.acceptance_length,
                            "gained": res.gained, "passes": res.target_forwards, "tokens": len(res.tokens)})
    finally:
        decoder.target.close()
    tokens = sum(p["tokens"] for p in per_row)
    return {
        "acceptance": gained / forwards if forwards else float("nan"), "target_forwards": forwards,
        # SGLang's figure: completion tokens (the prefill's token included) / verify passes.
        "acceptance_sglang": tokens / forwards if forwards else float("nan"),
        "per_position_acceptance": slots.rate,
        "lossless": bool(lossless), "text_agreement": agree / total if total else float("nan"),
        "tokens_per_s_spec": tokens / spec_s, "tokens_per_s_plain": tokens / plain_s,
        "speedup": plain_s / spec_s, "per_row": per_row,
    }


def by_bucket(prompt_lengths: list[int], values: list[tuple[int, int]], edges: list[int]) -> dict:
    """Acceptance (sum tokens / sum passes) per prompt-length bucket '<=edge' / '>last'."""
    names = [f"<={e}" for e in edges] + [f">{edges[-1]}"]
    sums = {n: [0, 0] for n in names}
    for length, (tok, passes) in zip(prompt_lengths, values):
        n = names[bisect.bisect_left(edges, length)]
        sums[n][0] += tok
        sums[n][1] += passes
    return {n: (t / p if p else None) for n, (t, p) in sums.items() if p}


def load_draft_for_eval(cfg: FullConfig, layout: RunLayout, model, dtype: torch.dtype) -> tuple[Eagle3Draft, str]:
    """The draft this run's train stage produced: its export (the weights as served) when
    the export stage made it from that very draft, else the trained weights."""
    folder = layout.require_draft()
    draft = Eagle3Draft(load_draft_config(folder))
    draft.load_target_embeddings(model.get_input_embeddings().weight.float())
    export = read_marker(layout.stage_dir("export")) or {}
    source = folder / "draft.safetensors"
    if export.get("summary", {}).get("train_key") == layout.done_key("train"):
        source = layout.sglang_export / "model.safetensors"
    elif export:
        log(f"evaluate: {layout.sglang_export} was exported from an older draft; scoring {source} instead")
    load_draft_weights(folder, draft, file=source)
    return draft.to(dtype).eval(), str(source)


def plot(report: dict, folder: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    fig, ax = plt.subplots(figsize=(6, 3.5))
    k = len(report["per_position_acceptance"])
    xs = list(range(1, k + 1))
    ax.bar([x - 0.2 for x in xs], report["per_position_acceptance_offline"], 0.4, label="offline (walk)")
    ax.bar([x + 0.2 for x in xs], report["per_position_acceptance"], 0.4, label="decoded")
    ax.set(xlabel="draft position", ylabel="P(accepted | reached)", title="Acceptance by draft position", ylim=(0, 1))
    ax.legend()
    files.append("per_position.png")
    fig.tight_layout(), fig.savefig(folder / files[-1], dpi=100), plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    buckets = list(report["acceptance_by_prompt_length_decoded"])
    ax.bar([i - 0.2 for i in range(len(buckets))],
           [report["acceptance_by_prompt_length_offline"].get(b) or 0 for b in buckets], 0.4, label="offline")
    ax.bar([i + 0.2 for i in range(len(buckets))],
           [report["acceptance_by_prompt_length_decoded"][b] for b in buckets], 0.4, label="decoded")
    ax.set_xticks(range(len(buckets)), buckets)
    ax.set(xlabel="prompt tokens", ylabel="tokens per target pass", title="Acceptance by prompt length")
    ax.legend()
    files.append("by_prompt_length.png")
    fig.tight_layout(), fig.savefig(folder / files[-1], dpi=100), plt.close(fig)

    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar(["plain greedy", "speculative"], [report["tokens_per_s_plain"], report["tokens_per_s_decoded"]])
    ax.set(ylabel="tokens/s (batch 1, CPU)", title=f"Reference decoder: x{report['speedup_decoded']:.2f}")
    files.append("speed.png")
    fig.tight_layout(), fig.savefig(folder / files[-1], dpi=100), plt.close(fig)
    return files


def markdown(r: dict, plots: list[str]) -> str:
    lines = [
        "# EAGLE-3 acceptance report", "",
        f"Draft `{r['draft']}` on target `{r['target']}`; {r['prompts']} held-out answers "
        f"(up to {r['max_new_tokens']} tokens each), k = {r['num_steps']} draft tokens per pass, topk = {r['topk']}.", "",
        "| figure | value |", "|---|---|",
        f"| acceptance offline (walk over TTT outputs) | {r['acceptance_offline']:.3f} |",
        f"| acceptance offline, per-position average (overestimates) | {r['acceptance_offline_per_position_average']:.3f} |",
        f"| acceptance decoded (tokens per target pass) | {r['acceptance_decoded']:.3f} |",
        f"| acceptance decoded, SGLang's definition (completion tokens / verify passes, the prefill's token "
        f"included; compare served `accept_length` with this) | {r['acceptance_decoded_sglang_definition']:.3f} |",
        f"| parity ratio offline / decoded | {r['parity_ratio']:.3f} |",
        f"| lossless (decoded == plain greedy on every prompt) | {r['lossless']} |",
        f"| target's greedy text == stored answer | {r['text_agreement']:.3f} |",
        f"| tokens/s plain / speculative | {r['tokens_per_s_plain']:.1f} / {r['tokens_per_s_decoded']:.1f} |",
        f"| speed-up of the reference decoder | {r['speedup_decoded']:.2f} |",
    ]
    if "sglang_draft_attention" in r:
        s = r["sglang_draft_attention"]
        lines.append(f"| acceptance decoded with SGLang's tree-draft attention (frontier-rank KV slots): tokens per "
                     f"pass / SGLang's definition / lossless | {s['acceptance_decoded']:.3f} / "
                     f"{s['acceptance_decoded_sglang_definition']:.3f} / {s['lossless']} |")
    if "acceptance_decoded_tree" in r:
        lines.append(f"| tree (topk={r['tree_topk']}, num_draft_tokens={r['tree_num_draft_tokens']}): acceptance / "
                     f"speed-up / lossless | {r['acceptance_decoded_tree']:.3f} / {r['speedup_decoded_tree']:.2f} / "
                     f"{r['lossless_tree']} |")
    for c, b in r.get("served_benchmark", {}).get("results", {}).items():
        lines.append(f"| served ({r['served_benchmark']['api']}), concurrency {c}: tokens/s, accept length | "
                     f"{b['tokens_per_s_mean']:.1f}, {b['accept_length']} |")
    lines += ["", "Per-position acceptance (P(accepted | reached)), offline vs decoded: "
              f"{[round(x, 3) for x in r['per_position_acceptance_offline']]} vs "
              f"{[round(x, 3) for x in r['per_position_acceptance']]}", ""]
    if "acceptance_offline_float32" in r:
        flag = " **(more than 2% apart)**" if r["dtype_gap_flagged"] else ""
        lines.append(f"| acceptance offline in {r['dtype']} / in float32{flag} | {r['acceptance_offline']:.3f} / "
                     f"{r['acceptance_offline_float32']:.3f} |")
    lines += [f"These figures hold for SGLang serving with `{' '.join(r['serve_args'])}` "
              f"(`python -m workflows.tools.serve` defaults to them). Target and draft computed in {r['dtype']}: "
              f"{r.get('dtype_reason', '')}; served in {r.get('serving_dtype', r['dtype'])}.", ""]
    if "ablation" in r:
        lines += [r["ablation"], ""]
    lines += [f"![{p}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def ablation_file(layout: RunLayout) -> Path:
    """The table `python -m bench.bench_quality` writes into the run folder (may not exist)."""
    return layout.root / "ablation" / "ablation.md"


def ablation_mtime(layout: RunLayout) -> int | None:
    path = ablation_file(layout)
    return path.stat().st_mtime_ns if path.exists() else None


DTYPE_GAP = 0.02  # the offline walk in the serving dtype and in fp32 may differ this much silently


def offline_in_fp32(cfg: FullConfig, layout: RunLayout, target_path: Path, ids, rows, k: int, walk: float) -> dict:
    engine = HFEngine(EngineSpec(str(target_path), dtype="float32", layer_ids=ids,
                                 trust_remote_code=cfg.target.trust_remote_code))
    draft, _ = load_draft_for_eval(cfg, layout, engine.model, torch.float32)
    groups = [rows[i : i + 4] for i in range(0, len(rows), 4)]
    fp32, _ = offline_acceptance(draft, TargetHead.from_hf(engine.model), groups,
                                 engine.training_batches(groups, "capture held-out (fp32)"), k)
    gap = abs(walk - fp32.walk) / fp32.walk
    if gap > DTYPE_GAP:
        log(f"evaluate: WARNING the offline walk is {walk:.3f} in {cfg.target.dtype} but {fp32.walk:.3f} in float32 "
            f"({gap:.1%} apart, above {DTYPE_GAP:.0%})")
    return {"acceptance_offline_float32": fp32.walk, "dtype_gap": gap, "dtype_gap_flagged": gap > DTYPE_GAP}


def evaluation_dtype(cfg: FullConfig) -> tuple[str, str]:
    """(dtype the evaluation runs in, why): evaluate.dtype, or for auto the serving dtype
    when this machine computes it fast (workflows.core.precision), else float32."""
    from workflows.core.precision import cpu_choice

    serving, requested = cfg.target.dtype, cfg.evaluate.dtype
    if requested != "auto":
        return requested, f"evaluate.dtype={requested}" + (f" (serving: {serving})" if requested != serving else "")
    if serving == "float32":
        return "float32", "the serving dtype"
    fast, why = cpu_choice()
    if fast == serving:
        return serving, f"the serving dtype ({why})"
    return "float32", (f"not the serving dtype {serving}: it runs slowly on this CPU ({why}); "
                       f"set evaluate.dtype={serving} to force it")


def run(cfg: FullConfig, target_path: Path) -> Path:
    e = cfg.evaluate
    layout = RunLayout.of(cfg)
    out = layout.stage_dir("evaluate")
    served = layout.benchmark_file  # python -m workflows.tools.benchmark --out ...
    key = {"evaluate": to_dict(e), "target": identity_for(cfg, target_path), **layout.chain("train"),
           "export": layout.done_key("export"), "served": served.stat().st_mtime_ns if served.exists() else None,
           "ablation": ablation_mtime(layout)}
    if stage_is_done(out, key):
        log(f"evaluate: reusing {out}")
        return out
    torch.manual_seed(cfg.seed)
    dtype_name, dtype_why = evaluation_dtype(cfg)
    log(f"evaluate: computing in {dtype_name}: {dtype_why}")
    dtype = getattr(torch, dtype_name)
    ids = load_draft_config(layout.require_draft()).capture_layer_ids
    engine = HFEngine(EngineSpec(str(target_path), dtype=dtype_name, layer_ids=ids,
                                 trust_remote_code=cfg.target.trust_remote_code))
    model, tokenizer = engine.model, engine.tokenizer
    cfg.target.check_against_hf_config(model.config)
    draft, source = load_draft_for_eval(cfg, layout, model, dtype)
    rows = heldout_rows(layout, e.max_prompts, e.max_new_tokens)
    groups = [rows[i : i + 4] for i in range(0, len(rows), 4)]
    batches = engine.training_batches(groups, "capture held-out")
    head = TargetHead.from_hf(model)
    k = e.num_steps
    offline, offline_rows = offline_acceptance(draft, head, groups, batches, k)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    log(f"evaluate: decoding {len(rows)} held-out prompts, k={k}, topk={e.topk}")
    dec = decode_all(model, draft, rows, ids, k, e.topk, e.num_draft_tokens, eos)
    prompt_lengths = [r["loss_mask"].index(1) for r in rows]
    report = {
        "target": str(target_path), "draft": source, "prompts": len(rows), "max_new_tokens": e.max_new_tokens,
        "num_steps": k, "topk": e.topk, "num_draft_tokens": e.num_draft_tokens or k + 1, "dtype": dtype_name,
        "dtype_reason": dtype_why, "serving_dtype": cfg.target.dtype,
        "serve_args": speculative_args(k, e.topk, e.num_draft_tokens or k + 1),
        "acceptance_definitions": {
            "acceptance_decoded": "tokens produced by verify passes / verify passes (the prefill's token excluded)",
            "acceptance_decoded_sglang_definition": "completion tokens / verify passes, the prefill's token "
                                                    "included: SGLang's accept length"},
        "acceptance_decoded_sglang_definition": dec["acceptance_sglang"],
        "acceptance_offline": offline.walk, "acceptance_offline_per_position_average": offline.per_position_average,
        "acceptance_decoded": dec["acceptance"], "parity_ratio": offline.walk / dec["acceptance"],
        "lossless": dec["lossless"], "text_agreement": dec["text_agreement"],
        "per_position_acceptance": dec["per_position_acceptance"],
        "per_position_acceptance_offline": offline.per_slot_rate,
        "acceptance_by_prompt_length_offline": by_bucket(
            prompt_lengths, [(a.tokens, a.passes) for a in offline_rows], e.length_buckets),
        "acceptance_by_prompt_length_decoded": by_bucket(
            prompt_lengths, [(p["gained"], p["passes"]) for p in dec["per_row"]], e.length_buckets),
        "speedup_decoded": dec["speedup"], "tokens_per_s_decoded": dec["tokens_per_s_spec"],
        "tokens_per_s_plain": dec["tokens_per_s_plain"], "target_forwards_decoded": dec["target_forwards"],
        "offline_walk_passes": offline.passes, "per_prompt_decoded": dec["per_row"],
    }
    if dtype_name != "float32":  # the same walk in fp32: does precision move the figure?
        report.update(offline_in_fp32(cfg, layout, target_path, ids, rows, k, offline.walk))
    if served.exists():
        report["served_benchmark"] = read_json(served)
    ablation = ablation_file(layout)
    if ablation.exists():
        report["ablation"] = ablation.read_text()
    if e.topk > 1:  # the served tree, drafted as SGLang drafts it (differs from depth 3 on)
        sg = decode_all(model, draft, rows, ids, k, e.topk, e.num_draft_tokens, eos, sglang_compatible=True)
        report["sglang_draft_attention"] = {
            "acceptance_decoded": sg["acceptance"], "acceptance_decoded_sglang_definition": sg["acceptance_sglang"],
            "lossless": sg["lossless"], "per_position_acceptance": sg["per_position_acceptance"]}
    if e.tree_topk > 1:
        tree = decode_all(model, draft, rows, ids, k, e.tree_topk, e.tree_num_draft_tokens, eos)
        report.update({"tree_topk": e.tree_topk, "tree_num_draft_tokens": e.tree_num_draft_tokens,
                       "acceptance_decoded_tree": tree["acceptance"], "speedup_decoded_tree": tree["speedup"],
                       "lossless_tree": tree["lossless"]})
    with atomic_dir(out) as tmp:
        plots = plot(report, tmp)
        write_json_atomic(tmp / "report.json", report)
        (tmp / "report.md").write_text(markdown(report, plots))
    mark_done(out, key, {k: report[k] for k in ("acceptance_offline", "acceptance_decoded", "parity_ratio",
                                                 "lossless", "speedup_decoded")})
    log(f"evaluate: acceptance offline {offline.walk:.3f} decoded {dec['acceptance']:.3f} parity "
        f"{report['parity_ratio']:.3f} lossless {dec['lossless']} speed-up {dec['speedup']:.2f} -> {out}")
    return out


main = stage_main(run)


if __name__ == "__main__":
    main()
