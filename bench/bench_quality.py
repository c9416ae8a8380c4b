"""Draft quality ablation: train the same data for the same steps under each setting, then
score it on a validation split of the *train* prompts (the held-out split is never seen).

    python -m bench.bench_quality --overrides +experiment=specforge_smollm2 --grid knobs \
        --steps 400 --seeds 0 1 [--decode-prompts 12] [--jobs 2]

The run folder of the overrides must have finished its capture stage (e.g. `python -m
workflows.full +experiment=specforge_smollm2 stages=[target,generate,capture,vocab]`).

Data: the store's train samples, split by a hash of the sample id into fit (90%) and
validation (10%). The draft vocabulary is counted on the fit part. Each trial composes the
run's config with its own overrides (Hydra, as `python -m workflows.full` would), trains
with the reference loop (eagle3.training.train_in_memory: the same step as the train
stage's plain backend, batches in a seeded order reshuffled every epoch), then reports on
the validation part:

* per-step accuracy and acceptance rate sum_v min(p, q) (teacher-forced), offline walk;
* decoded acceptance of the reference speculative decoder, chain (k = evaluate.num_steps)
  and tree (SGLang's default 5 steps, topk 4, 8 draft tokens), checked lossless against
  greedy decoding, on `--decode-prompts` validation prompts;
* training tokens/s.

Trials run `--jobs` at a time, one thread each. Each setting runs once per seed; the table
gives mean and spread (min-max) over seeds. Written to `<run_dir>/ablation/ablation.{json,md}`;
the evaluate stage's report includes the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import multiprocessing
import os
import random
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

GRIDS = {
    # One knob at a time away from the run's own settings.
    "knobs": [
        ("base", []),
        ("objective=log_acceptance", ["train.objective.kind=log_acceptance"]),
        ("objective=kl_acceptance", ["train.objective.kind=kl_acceptance"]),
        ("fc_norm", ["draft.fc_norm=true"]),
        ("norm_before_fc", ["draft.norm_before_fc=true"]),
        ("noise=none", ["train.ttt.noise.kind=none"]),
        ("noise=gaussian 0.2", ["train.ttt.noise.std=0.2"]),
        ("ttt=5", ["train.ttt.length=5", "train.acceptance_k=5"]),
        ("decay=1.0", ["train.ttt.decay=1.0"]),
        ("positions=fixed", ["train.ttt.positions=fixed"]),  # SpecForge 0.2.0's unshifted RoPE
        ("draft_vocab=2048", ["draft.draft_vocab_size=2048"]),
        ("lr=3e-4", ["train.optim.lr=3e-4"]),
        ("lr=2e-3", ["train.optim.lr=2e-3"]),
        ("tokens=answer", ["train.objective.tokens=answer"]),  # the loss mask only (SpecForge)
        ("init_head=target", ["draft.init_head=target"]),
        ("rope_theta=10000", ["draft.rope_theta=10000"]),
    ],
    # Why the project trailed SpecForge 0.2.0 at equal data: each of SpecForge's settings alone.
    "specforge": [
        ("project", []),
        ("noise=none", ["train.ttt.noise.kind=none"]),
        ("betas=0.9,0.999", ["train.optim.betas=[0.9,0.999]"]),
        ("normalise=positions", ["train.objective.normalise=positions"]),
        ("skip_unreachable", ["train.objective.skip_unreachable=true"]),
        ("schedule=specforge", ["train.optim.warmup_steps=55", "train.optim.min_lr_ratio=0"]),
        ("positions=fixed", ["train.ttt.positions=fixed"]),
        ("tokens=answer", ["train.objective.tokens=answer"]),
        (
            "all specforge",
            [
                "train.ttt.noise.kind=none",
                "train.optim.betas=[0.9,0.999]",
                "train.objective.normalise=positions",
                "train.objective.skip_unreachable=true",
                "train.objective.tokens=answer",
                "train.optim.warmup_steps=55",
                "train.optim.min_lr_ratio=0",
            ],
        ),
    ],
}
TREE = (5, 4, 8)  # SGLang's default drafting for a Llama target: steps, topk, draft tokens


def is_validation(sample_id: str, fraction: float) -> bool:
    # Salted: the held-out split hashes the bare id the same way (workflows.generate.ingest),
    # so the train samples left over all hash above its fraction; unsalted, a validation
    # fraction below that would pick none of them.
    digest = hashlib.sha256(f"validation:{sample_id}".encode()).hexdigest()
    return int(digest[:8], 16) / 0xFFFFFFFF < fraction


def load_split(overrides: list[str], fraction: float):
    """(cfg, target path, fit samples, validation samples) of the run's store."""
    from workflows.core.config import compose
    from workflows.core.layout import RunLayout
    from workflows.core.targets import prepare_for

    cfg = compose(overrides)
    layout = RunLayout.of(cfg)
    layout.require_done("capture")
    reader = layout.open_store()
    train_shards = set(reader.shard_names("train"))
    ids = sorted(i for i, (shard, _) in reader.index.items() if shard in train_shards)
    samples = [reader.sample(i) for i in ids]
    fit = [s for s in samples if not is_validation(s["id"], fraction)]
    val = [s for s in samples if is_validation(s["id"], fraction)]
    if not fit or not val:
        raise SystemExit(f"{layout.store_url}: {len(fit)} fit / {len(val)} validation samples; need both")
    return cfg, prepare_for(cfg, log=lambda *_: None), fit, val, bool(reader.provenance.get("final_is_normed", True))


def decode_rows(samples: list[dict], limit: int, max_new_tokens: int) -> list[dict]:
    from eagle3.metrics import assistant_spans

    rows = []
    for s in sorted(samples, key=lambda s: s["id"]):
        spans = assistant_spans(s["loss_mask"])
        if spans and spans[0][0] >= 1 and spans[0][1] - spans[0][0] >= 2:
            start, end = spans[0][0], min(spans[0][1], spans[0][0] + max_new_tokens)
            rows.append({"prompt": s["input_ids"][:start].tolist(), "answer_len": end - start})
        if len(rows) == limit:
            break
    return rows


_DATA: dict = {}  # each worker process reads the store once (initializer), not per trial


def load_into_worker(overrides: list[str], fraction: float) -> None:
    _, _, _DATA["fit"], _DATA["val"], _DATA["final_is_normed"] = load_split(overrides, fraction)
    _DATA["worker"] = True


def run_trial(args: dict) -> dict:
    import torch

    if _DATA.get("worker"):  # one of --jobs processes: one core each
        torch.set_num_threads(1)
    from eagle3.spec_decode import Eagle3Drafter, SpeculativeDecoder
    from eagle3.target_features import collate_samples
    from eagle3.training import evaluate, train_in_memory
    from eagle3.vocab import build_draft_vocab, count_tokens
    from workflows.core.config import auto_draft_vocab_size, compose
    from workflows.core.engine_spec import EngineSpec
    from workflows.core.engines import HFEngine
    from workflows.core.precision import resolve
    from workflows.core.target_weights import read_target_head
    from workflows.train.trainer import build_draft

    name, seed = args["name"], args["seed"]
    cfg = compose([*args["base"], *args["overrides"], f"seed={seed}", f"train.steps={args['steps']}"])
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, compute_dtype=resolve(cfg.train.compute_dtype)))
    fit, val, final_is_normed = _DATA["fit"], _DATA["val"], _DATA["final_is_normed"]
    counts = sum(count_tokens(s["input_ids"], s["loss_mask"], cfg.target.vocab_size) for s in fit)
    size = cfg.draft.draft_vocab_size or auto_draft_vocab_size(cfg.target.vocab_size, int((counts > 0).sum()))
    vocab = build_draft_vocab(counts, size, warn=lambda *_: None)
    draft = build_draft(cfg.draft, cfg.target, args["target"], vocab, seed=cfg.seed, init_from=cfg.train.init_from)
    head = read_target_head(Path(args["target"]), final_is_normed)
    b = cfg.train.batch_size
    rng = random.Random(seed)
    order: list[dict] = []
    epoch_batches = [collate_samples(fit[i : i + b]) for i in range(0, len(fit), b)]
    while len(order) < cfg.train.steps:  # a fresh shuffle each epoch, as the stream does
        order += rng.sample(epoch_batches, len(epoch_batches))
    t0 = time.perf_counter()
    train_in_memory(draft, head, order[: cfg.train.steps], cfg.train)
    train_s = time.perf_counter() - t0
    tokens = sum(int(x["attention_mask"].sum()) for x in order[: cfg.train.steps])
    k = cfg.evaluate.num_steps
    eval_cfg = dataclasses.replace(
        cfg.train, acceptance_k=k, ttt=dataclasses.replace(cfg.train.ttt, length=max(k, cfg.train.ttt.length))
    )
    val_batches = [collate_samples(val[i : i + 4]) for i in range(0, len(val), 4)]
    ev = evaluate(draft, head, val_batches, eval_cfg)
    out = {
        "name": name,
        "seed": seed,
        "overrides": args["overrides"],
        "steps": cfg.train.steps,
        "train_tokens_per_s": tokens / train_s,
        "step_acc": ev["step_acc"][:k],
        "step_alpha": ev["step_alpha"][:k],
        "acceptance_walk": ev["acceptance_walk"],
        "vocab_covered": vocab.covered_fraction,
    }
    if args["decode"]:
        engine = HFEngine(EngineSpec(args["target"], dtype="float32", capture_ids=cfg.target.capture_ids))
        model = engine.model
        draft = draft.float().eval()
        eos = [engine.tokenizer.eos_token_id]
        for label, (steps, topk, ndt) in (("chain", (k, 1, k + 1)), ("tree", TREE)):
            dec = SpeculativeDecoder(model, Eagle3Drafter(draft), cfg.target.capture_ids, steps, topk, ndt, eos)
            gained = passes = 0
            lossless = True
            for row, plain in zip(args["decode"], args["greedy"]):
                res = dec.generate(row["prompt"], row["answer_len"])
                lossless &= res.tokens == plain
                gained, passes = gained + res.gained, passes + res.target_forwards
            dec.target.close()
            out[f"decoded_{label}"] = gained / passes
            out[f"lossless_{label}"] = bool(lossless)
    return out


def greedy_answers(target: str, capture_ids: list[int], rows: list[dict]) -> list[list[int]]:
    """Plain greedy answers of the decoded prompts, once: every trial is checked against them."""
    from eagle3.spec_decode import greedy_decode
    from workflows.core.engine_spec import EngineSpec
    from workflows.core.engines import HFEngine

    engine = HFEngine(EngineSpec(target, dtype="float32", capture_ids=capture_ids))
    eos = [engine.tokenizer.eos_token_id]
    return [greedy_decode(engine.model, r["prompt"], r["answer_len"], eos)[0] for r in rows]


def summarise(results: list[dict], grid: list[tuple[str, list[str]]]) -> list[dict]:
    rows = []
    for name, overrides in grid:
        rs = [r for r in results if r["name"] == name]
        if not rs:
            continue

        def stat(key):
            vals = [r[key] for r in rs if key in r]
            return (statistics.mean(vals), min(vals), max(vals)) if vals else None

        k = len(rs[0]["step_acc"])
        rows.append(
            {
                "name": name,
                "overrides": overrides,
                "seeds": [r["seed"] for r in rs],
                "decoded_chain": stat("decoded_chain"),
                "decoded_tree": stat("decoded_tree"),
                "lossless": all(r.get("lossless_chain", True) and r.get("lossless_tree", True) for r in rs),
                "acceptance_walk": stat("acceptance_walk"),
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
        f"`{meta['store']}`; decoded on {meta['decoded']} validation prompts (chain k={meta['k']}, "
        f"tree steps/topk/tokens {TREE}); mean (min-max) over seeds.",
        "",
        "| setting | decoded chain | decoded tree | lossless | offline walk | acc steps 0.. | alpha step 0 | "
        "train tok/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        acc = " ".join(f"{a:.3f}" for a in r["step_acc"])
        lines.append(
            f"| {r['name']} | {fmt(r['decoded_chain'])} | {fmt(r['decoded_tree'])} | {r['lossless']} | "
            f"{fmt(r['acceptance_walk'])} | {acc} | {r['alpha'][0]:.3f} | "
            f"{r['train_tokens_per_s'][0]:.0f} |"
        )
    lines += ["", "Command: `" + meta["command"] + "`", ""]
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--overrides", nargs="*", default=[], help="Hydra overrides selecting the run (its store)")
    ap.add_argument("--grid", choices=sorted(GRIDS), default="knobs")
    ap.add_argument("--only", nargs="*", default=None, help="run only these settings of the grid")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--validation-fraction", type=float, default=0.1)
    ap.add_argument("--decode-prompts", type=int, default=12, help="0: no decoding")
    ap.add_argument("--decode-tokens", type=int, default=96)
    ap.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 1)))
    ap.add_argument("--out", type=Path, default=None, help="default: <run_dir>/ablation/ablation.{json,md}")
    a = ap.parse_args(argv)
    cfg, target, fit, val, final_is_normed = load_split(a.overrides, a.validation_fraction)
    grid = [g for g in GRIDS[a.grid] if a.only is None or g[0] in a.only]
    rows = decode_rows(val, a.decode_prompts, a.decode_tokens) if a.decode_prompts else []
    greedy = greedy_answers(str(target), cfg.target.capture_ids, rows) if rows else []
    print(
        f"bench_quality: {len(fit)} fit / {len(val)} validation samples, {len(grid)} settings x "
        f"{len(a.seeds)} seeds, {a.steps} steps each, {len(rows)} decoded prompts, {a.jobs} at a time",
        flush=True,
    )
    shared = {"base": a.overrides, "steps": a.steps, "target": str(target), "decode": rows, "greedy": greedy}
    trials = [{**shared, "name": n, "overrides": o, "seed": s} for n, o in grid for s in a.seeds]
    results = []
    if a.jobs == 1:  # in this process: no start-up of another interpreter
        _DATA.update(fit=fit, val=val, final_is_normed=final_is_normed)
        pool, mapped = None, map(run_trial, trials)
    else:
        # Spawned, not forked: this process has run torch (greedy answers, int8 dequantised on
        # read), and a fork of a process whose OpenMP pool has started can deadlock in the
        # child (the int8 trials sat idle at --jobs 2 when forked).
        pool = ProcessPoolExecutor(
            a.jobs,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=load_into_worker,
            initargs=(a.overrides, a.validation_fraction),
        )
        mapped = pool.map(run_trial, trials)
    try:
        for r in mapped:
            print(
                f"  {r['name']:24s} seed {r['seed']}: walk {r['acceptance_walk']:.3f} "
                f"decoded chain {r.get('decoded_chain', float('nan')):.3f} "
                f"tree {r.get('decoded_tree', float('nan')):.3f} "
                f"acc0 {r['step_acc'][0]:.3f} alpha0 {r['step_alpha'][0]:.3f} "
                f"{r['train_tokens_per_s']:.0f} tok/s",
                flush=True,
            )
            results.append(r)
    finally:
        if pool is not None:
            pool.shutdown()
    table = summarise(results, grid)
    meta = {
        "grid": a.grid,
        "steps": a.steps,
        "seeds": a.seeds,
        "fit": len(fit),
        "val": len(val),
        "store": cfg.run_path.name,
        "decoded": len(rows),
        "k": cfg.evaluate.num_steps,
        "command": "python -m bench.bench_quality " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    out = a.out or cfg.run_path / "ablation" / "ablation"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "table": table, "trials": results}, indent=1))
    out.with_suffix(".md").write_text(markdown(table, meta))
    print(markdown(table, meta))


if __name__ == "__main__":
    main()
