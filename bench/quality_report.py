"""bench.bench_quality's report: from the trials' figures, the finalists to decode, each
setting's mean and spread over seeds, the markdown table and a trial's one-line summary."""

from __future__ import annotations

import statistics

from bench.quality_grids import TREE


def finalists(results: list[dict], grid: list[tuple[str, list[str]]], n: int) -> list[str]:
    """The grid's first setting (the baseline) and the `n` best others by mean walk."""
    walks = {
        name: statistics.mean(r["acceptance_walk"] for r in results if r["name"] == name)
        for name, _ in grid
        if any(r["name"] == name for r in results)
    }
    first = grid[0][0]
    ranked = sorted((w for w in walks if w != first), key=lambda w: -walks[w])
    return [w for w in [first, *ranked[:n]] if w in walks]


def summarise(results: list[dict], grid: list[tuple[str, list[str]]], decode_key: str | None = None) -> list[dict]:
    """Mean and spread over seeds of each setting; decoded figures only from decodes of this
    run's prompts (`decode_key`), not one a kept trial holds from other prompts."""
    rows = []

    def current(r: dict) -> bool:
        return r.get("decoded_on") == decode_key

    for name, overrides in grid:
        rs = [r for r in results if r["name"] == name]
        if not rs:
            continue

        def stat(key):
            vals = [r[key] for r in rs if key in r and (not key.startswith("decoded_") or current(r))]
            return (statistics.mean(vals), min(vals), max(vals)) if vals else None

        k = len(rs[0]["step_acc"])
        rows.append(
            {
                "name": name,
                "overrides": overrides,
                "seeds": [r["seed"] for r in rs],
                "decoded_chain": stat("decoded_chain"),
                "decoded_tree": stat("decoded_tree"),
                "lossless": all(r.get(f"lossless_{x}", True) for r in rs if current(r) for x in ("chain", "tree")),
                "acceptance_walk": stat("acceptance_walk"),
                "best_step": stat("best_step"),
                "steps_done": stat("steps_done"),
                "train_tokens_per_s": stat("train_tokens_per_s"),
                "step_acc": [statistics.mean(r["step_acc"][j] for r in rs) for j in range(k)],
                "alpha": [statistics.mean(r["step_alpha"][j] for r in rs) for j in range(k)],
            }
        )
    return rows


def markdown(rows: list[dict], meta: dict) -> str:
    def fmt(s):
        return "-" if s is None else f"{s[0]:.3f} ({s[1]:.3f}-{s[2]:.3f})"

    lines = [
        f"# Ablation: {meta['grid']} ({meta['steps']} steps, seeds {meta['seeds']})",
        "",
        f"Data: {meta['fit']} fit / {meta['val']} validation samples of the train split of "
        f"`{meta['store']}`; each trial stops after {meta['patience']} validation walks with no new "
        "best (0: never) and is scored with the weights of its best walk; decoded (the finalists: "
        f"{', '.join(meta['finalists']) or 'none'}) on {meta['decoded']} "
        f"{'held-out' if meta['decoded_on'] == 'heldout' else 'validation'} prompts "
        f"(chain k={meta['k']}, tree steps/topk/tokens {TREE}); mean (min-max) over seeds.",
        "",
        "| setting | decoded chain | decoded tree | lossless | offline walk | best step / steps run | "
        "acc steps 0.. | alpha step 0 | train tok/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        acc = " ".join(f"{a:.3f}" for a in r["step_acc"])
        lines.append(
            f"| {r['name']} | {fmt(r['decoded_chain'])} | {fmt(r['decoded_tree'])} | {r['lossless']} | "
            f"{fmt(r['acceptance_walk'])} | {r['best_step'][0]:.0f} / {r['steps_done'][0]:.0f} | {acc} | "
            f"{r['alpha'][0]:.3f} | {r['train_tokens_per_s'][0]:.0f} |"
        )
    lines += ["", "Command: `" + meta["command"] + "`", ""]
    return "\n".join(lines)


def line(r: dict) -> str:
    tree = f" tree {r['decoded_tree']:.3f}" if "decoded_tree" in r else ""  # a block draft drafts chains only
    decoded = f" decoded chain {r['decoded_chain']:.3f}{tree}" if "decoded_chain" in r else ""
    return (
        f"{r['name']:24s} seed {r['seed']}: walk {r['acceptance_walk']:.3f} (best at step {r['best_step']} of "
        f"{r['steps_done']}/{r['steps']}){decoded} acc0 {r['step_acc'][0]:.3f} alpha0 {r['step_alpha'][0]:.3f} "
        f"{r['train_tokens_per_s']:.0f} tok/s"
    )
