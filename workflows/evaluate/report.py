"""The evaluate stage's report: acceptance by prompt length, the plots, report.md."""

from __future__ import annotations

import bisect
from pathlib import Path

from eagle3.metrics import SlotCounts


def by_bucket(prompt_lengths: list[int], values: list[tuple[int, int]], edges: list[int]) -> dict:
    """Acceptance (sum tokens / sum passes) per prompt-length bucket '<=edge' / '>last'."""
    names = [f"<={e}" for e in edges] + [f">{edges[-1]}"]
    sums = {n: [0, 0] for n in names}
    for length, (tok, passes) in zip(prompt_lengths, values):
        n = names[bisect.bisect_left(edges, length)]
        sums[n][0] += tok
        sums[n][1] += passes
    return {n: (t / p if p else None) for n, (t, p) in sums.items() if p}


def by_group(names: list[str], offline: list[tuple[int, int]], decoded: list[tuple[int, int]]) -> dict:
    """Acceptance (sum tokens / sum passes), offline and decoded, per group of prompts (their
    dataset, or their kind: `tools` when the conversation carries tool calls or results)."""
    sums: dict[str, list[int]] = {}
    for name, (ot, op), (dt, dp) in zip(names, offline, decoded):
        s = sums.setdefault(name, [0, 0, 0, 0, 0])
        s[0] += 1
        s[1], s[2], s[3], s[4] = s[1] + ot, s[2] + op, s[3] + dt, s[4] + dp
    return {
        name: {"prompts": n, "offline": ot / op if op else None, "decoded": dt / dp if dp else None}
        for name, (n, ot, op, dt, dp) in sorted(sums.items())
    }


def prompt_kind(messages: list[dict]) -> str:
    """`tools` for a conversation with tool calls or tool results, else `chat`."""
    return "tools" if any(m.get("role") == "tool" or m.get("tool_calls") for m in messages) else "chat"


def served_per_position(counters: dict) -> list[float] | None:
    """An engine's acceptance by draft position in the report's own measure, P(slot i accepted
    | slot i reached) (eagle3.metrics.SlotCounts.rate), from counters that give the drafts
    accepted at each position over all drafts (vLLM's `num_accepted_tokens_per_pos`): slot i is
    reached where slots 0..i-1 were accepted, so its rate is accepted[i] / accepted[i-1], with
    accepted[-1] = num_drafts. None where the engine gives no such counters (SGLang). vLLM
    counts a pass's accepted drafts before the answer is cut at its length, the reference
    decoder up to the cut: only each answer's last pass may count differently."""
    accepted, drafts = counters.get("accepted_per_position") or [], counters.get("num_drafts") or 0
    if not accepted or not drafts:
        return None
    return SlotCounts([drafts, *accepted[:-1]], list(accepted)).rate


def per_position_series(report: dict) -> list[tuple[str, list[float]]]:
    """(label, P(accepted | reached) by draft position) for the plot and report.md: offline,
    decoded, then each engine that served with per-position counters."""
    series = [
        ("offline (walk)", report["per_position_acceptance_offline"]),
        ("decoded", report["per_position_acceptance"]),
    ]
    for engine, check in report.get("served", {}).items():
        if check.get("per_position_acceptance"):
            series.append((f"served by {check.get('engine', engine)}", check["per_position_acceptance"]))
    return series


def plot(report: dict, folder: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    fig, ax = plt.subplots(figsize=(6.5, 4))
    series = per_position_series(report)
    width = 0.8 / len(series)
    for n, (label, rates) in enumerate(series):
        xs = [i + 1 + (n - (len(series) - 1) / 2) * width for i in range(len(rates))]
        ax.bar(xs, rates, width, label=label)
    k = max(len(rates) for _, rates in series)
    ax.set_xticks(range(1, k + 1))  # draft positions 1..k, never fractions
    ax.set_xlim(0.5, k + 0.5)  # every position shown, one never reached (no bars) too
    ax.set(xlabel="draft position", ylabel="P(accepted | reached)", title="Acceptance by draft position", ylim=(0, 1))
    ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=len(series), frameon=False)
    files.append("per_position.png")
    fig.tight_layout(), fig.savefig(folder / files[-1], dpi=100), plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    buckets = list(report["acceptance_by_prompt_length_decoded"])
    ax.bar(
        [i - 0.2 for i in range(len(buckets))],
        [report["acceptance_by_prompt_length_offline"].get(b) or 0 for b in buckets],
        0.4,
        label="offline",
    )
    ax.bar(
        [i + 0.2 for i in range(len(buckets))],
        [report["acceptance_by_prompt_length_decoded"][b] for b in buckets],
        0.4,
        label="decoded",
    )
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
        "# EAGLE-3 acceptance report",
        "",
        f"Draft `{r['draft']}` on target `{r['target']}`; {r['prompts']} held-out answers "
        f"(up to {r['max_new_tokens']} tokens each), k = {r['num_steps']} draft tokens per pass, topk = {r['topk']}.",
        "",
        "| figure | value |",
        "|---|---|",
        f"| acceptance offline (walk over TTT outputs) | {r['acceptance_offline']:.3f} |",
        "| acceptance offline, per-position average (overestimates) | "
        f"{r['acceptance_offline_per_position_average']:.3f} |",
        f"| acceptance decoded (tokens per target pass) | {r['acceptance_decoded']:.3f} |",
        f"| acceptance decoded, SGLang's definition (completion tokens / verify passes, the prefill's token "
        f"included; compare served `accept_length` with this) | {r['acceptance_decoded_sglang_definition']:.3f} |",
        f"| parity ratio offline / decoded | {r['parity_ratio']:.3f} |",
        f"| draft tokens verified per pass (fewer than k where a DSpark draft's confidence cut the chain) | "
        f"{r.get('verified_per_pass', float('nan')):.2f} |",
        f"| lossless (decoded == plain greedy on every prompt) | {r['lossless']} |",
        *[
            f"| diverged from greedy: prompt {d['prompt']} at token {d['position']} "
            f"({d['decoded']} for {d['greedy']}), "
            f"target's top-2 margin {d['top2_margin']:.3g} vs {d['dtype']} resolution {d['resolution']:.3g} | "
            f"{d['kind']} |"
            for d in r.get("divergences", [])
        ],
        f"| target's greedy text == stored answer | {r['text_agreement']:.3f} |",
        f"| tokens/s plain / speculative | {r['tokens_per_s_plain']:.1f} / {r['tokens_per_s_decoded']:.1f} |",
        f"| speed-up of the reference decoder | {r['speedup_decoded']:.2f} |",
    ]
    if "sglang_draft_attention" in r:
        s = r["sglang_draft_attention"]
        lines.append(
            f"| acceptance decoded with SGLang's tree-draft attention (frontier-rank KV slots): tokens per "
            f"pass / SGLang's definition / lossless | {s['acceptance_decoded']:.3f} / "
            f"{s['acceptance_decoded_sglang_definition']:.3f} / {s['lossless']} |"
        )
    if "acceptance_decoded_tree" in r:
        lines.append(
            f"| tree (topk={r['tree_topk']}, num_draft_tokens={r['tree_num_draft_tokens']}): acceptance / "
            f"speed-up / lossless | {r['acceptance_decoded_tree']:.3f} / {r['speedup_decoded_tree']:.2f} / "
            f"{r['lossless_tree']} |"
        )
    if "at_temperature" in r:
        t = r["at_temperature"]
        d = t["decoded"]["tokens_per_pass"]
        lines.append(
            f"| at temperature {t['temperature']:g}: offline expectation / decoded (+- 1.96 se, "
            f"{len(t['seeds'])} seeds) | {t['acceptance_offline_expected']:.3f} / {d['value']:.3f} +- "
            f"{1.96 * d['standard_error']:.3f} |"
        )
    for engine, c in r.get("served", {}).items():
        if "accept_length" in c:
            flag = "" if c["matches_prediction"] else " **(not as predicted)**"
            lines.append(
                f"| served by {c['engine']} ({c['device']}, {c['dtype']}): accept length in its definition / "
                f"predicted ({c['predicted_from']}) / ratio / identical to greedy{flag} | "
                f"{c['accept_length']:.3f} / {c['predicted']:.3f} / {c['served_over_predicted']:.3f} / "
                f"{c['identical_to_greedy']} of {c['prompts']} |"
            )
            if "without_draft" in c:
                w = c["without_draft"]
                lines.append(
                    f"| served by {c['engine']}: tokens/s with the draft / without / speed-up | "
                    f"{c['tokens_per_s']:.1f} / {w['tokens_per_s']:.1f} / {w['speedup']:.2f} |"
                )
            if c.get("sampled", {}).get("verify") == "argmax":
                t = c["sampled"]
                lines.append(
                    f"| served by {c['engine']} at temperature {t['temperature']:g}: accept length | "
                    f"{t['accept_length']:.3f} (not compared: it verifies by argmax on {c['device']}) |"
                )
            elif "range95" in c.get("sampled", {}):
                t = c["sampled"]
                lines.append(
                    f"| served by {c['engine']} at temperature {t['temperature']:g}: accept length / predicted "
                    f"(95% range of a second estimate) | {t['accept_length']:.3f} / {t['predicted']:.3f} "
                    f"({t['range95'][0]:.3f}-{t['range95'][1]:.3f}){'' if t['within'] else ' **outside**'} |"
                )
        else:
            lines.append(f"| served by {engine} | {c.get('skipped') or c['error'].splitlines()[0]} |")
    for c, b in r.get("served_benchmark", {}).get("results", {}).items():
        lines.append(
            f"| served ({r['served_benchmark']['api']}), concurrency {c}: tokens/s, accept length | "
            f"{b['tokens_per_s_mean']:.1f}, {b['accept_length']} |"
        )
    series = per_position_series(r)
    k = max(len(rates) for _, rates in series)
    lines += [
        "",
        "Acceptance by draft position, P(accepted | reached) (served: from the engine's own counters, "
        "which count each answer's last pass before the cut at its length):",
        "",
        "| draft position | " + " | ".join(label for label, _ in series) + " |",
        "|---|" + "---|" * len(series),
        *[
            f"| {i + 1} | " + " | ".join(f"{rates[i]:.3f}" if i < len(rates) else "-" for _, rates in series) + " |"
            for i in range(k)
        ],
        "",
    ]
    for field, what in (("acceptance_by_prompt_kind", "prompt kind"), ("acceptance_by_dataset", "dataset")):
        groups = r.get(field, {})
        if len(groups) > 1:  # one group repeats the headline
            lines += [f"| {what} | prompts | offline | decoded |", "|---|---|---|---|"]
            lines += [
                f"| {name} | {g['prompts']} | {g['offline'] or float('nan'):.3f} | {g['decoded'] or float('nan'):.3f} |"
                for name, g in groups.items()
            ]
            lines.append("")
    if "acceptance_offline_float32" in r:
        flag = " **(more than 2% apart)**" if r["dtype_gap_flagged"] else ""
        lines.append(
            f"| acceptance offline in {r['dtype']} / in float32{flag} | {r['acceptance_offline']:.3f} / "
            f"{r['acceptance_offline_float32']:.3f} |"
        )
    lines += [
        f"These figures hold for SGLang serving with `{' '.join(r['serve_args'])}` "
        f"(`python -m workflows.tools.serve` defaults to them). Target and draft computed in {r['dtype']}: "
        f"{r.get('dtype_reason', '')}; served in {r.get('serving_dtype', r['dtype'])}.",
        "",
    ]
    if "ablation" in r:
        lines += [r["ablation"], ""]
    lines += [f"![{p}]({p})" for p in plots]
    return "\n".join(lines) + "\n"
