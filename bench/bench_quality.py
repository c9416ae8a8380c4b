"""Draft quality ablation: train the same data for the same steps under each setting, then
score it on a validation split of the *train* prompts (the held-out split never chooses).

    python -m bench.bench_quality --overrides +experiment=specforge_smollm2 --grid long \
        --steps 3690 --seeds 0 1 [--patience 2] [--finalists 3] [--decode-prompts 12]

The run folder of the overrides must have finished its capture stage (e.g. `python -m
workflows.full +experiment=specforge_smollm2 stages=[target,generate,capture,vocab]`).

Data: the store's train samples, split by a hash of the sample id into fit (90%) and
validation (10%). The draft vocabulary is counted on the fit part. Each trial composes the
run's config with its own overrides (Hydra, as `python -m workflows.full` would), trains
with the reference loop (eagle3.training.train_in_memory: the same step as the train
stage's plain backend, batches in a seeded order reshuffled every epoch) and walks the
validation part every `--eval-every` steps (default once an epoch). It stops early after
`--patience` walks without a new best (the learning rates stay those of the full
`--steps` horizon), and is scored with the weights of its best walk:

* per-step accuracy and acceptance rate sum_v min(p, q) (teacher-forced), offline walk,
  the step of the best walk and the steps run;
* for the finalists only (the grid's first setting and the `--finalists` best others by
  mean walk), decoded acceptance of the reference speculative decoder, chain (k =
  evaluate.num_steps) and tree (SGLang's default 5 steps, topk 4, 8 draft tokens),
  checked lossless against greedy decoding, on `--decode-prompts` validation prompts, or
  (`--decode-on heldout`) on the run's held-out prompts, as the evaluate stage decodes them:
  the finalists are chosen on the validation split either way, so the held-out prompts
  only report the finalists' figures, as a test set does;
* training tokens/s.

One trial at a time by default, with every core (`--jobs N` shares the cores out between N
trials: on two cores two single-thread trials contend for memory bandwidth and caches;
`--threads` sets the count outright, e.g. to add one more trial beside running ones).
A trial's figures depend on its thread count (the order of the sums), and each trial
records it: resume a trial with the count it started with.
Each finished trial is kept in `<out>/../trials/` (its figures and trained weights), so a
rerun, or one with more settings or seeds, trains only what is new; a trial killed mid-run
goes on from its last walk (`<trial>.resume.pt`, written at each walk). Each setting runs once
per seed; the table gives mean and spread (min-max) over seeds. Written to
`<run_dir>/ablation/ablation.{json,md}`; the evaluate stage's report includes the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import multiprocessing
import os
import random
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from bench.quality_grids import GRIDS, TREE
from bench.quality_report import finalists, line, markdown, summarise


def is_validation(sample_id: str, fraction: float) -> bool:
    # Salted: the held-out split hashes the bare id the same way (workflows.generate.ingest),
    # so the train samples left over all hash above its fraction; unsalted, a validation
    # fraction below that would pick none of them.
    digest = hashlib.sha256(f"validation:{sample_id}".encode()).hexdigest()
    return int(digest[:8], 16) / 0xFFFFFFFF < fraction


def load_split(overrides: list[str], fraction: float, fit_samples: int = 0):
    """(cfg, target path, fit samples, validation samples, final_is_normed, store key) of the
    run's store; the key (a hash of the store's provenance) tells a rerun whether the trials
    it kept were trained on this store. `fit_samples` > 0 keeps that many fit samples (the
    same ones for every trial and seed; the validation part is unchanged): how a family's
    quality grows with the data, at equal steps."""
    from workflows.core.config import compose
    from workflows.core.layout import RunLayout
    from workflows.core.targets import prepare_for

    cfg = compose(overrides)
    layout = RunLayout.of(cfg)
    layout.require_done("capture")
    # Every drafter family of the grid reads its own layers: the store holds their union
    # (capture.families); a trial's draft picks its own columns (`trial_aux`).
    reader = layout.open_store()
    train_shards = set(reader.shard_names("train"))
    ids = sorted(i for i, (shard, _) in reader.index.items() if shard in train_shards)
    samples = [reader.sample(i) for i in ids]
    fit = [s for s in samples if not is_validation(s["id"], fraction)]
    val = [s for s in samples if is_validation(s["id"], fraction)]
    if not fit or not val:
        raise SystemExit(f"{layout.store_url}: {len(fit)} fit / {len(val)} validation samples; need both")
    if fit_samples > len(fit):
        raise SystemExit(f"--fit-samples {fit_samples}: {layout.store_url} has {len(fit)} fit samples")
    if fit_samples:  # a fixed subset: the first by a salted hash of the id, not by source order
        fit = sorted(fit, key=lambda s: hashlib.sha256(f"fit:{s['id']}".encode()).hexdigest())[:fit_samples]
        fit.sort(key=lambda s: s["id"])
    key = hashlib.sha256(json.dumps(reader.provenance, sort_keys=True, default=str).encode()).hexdigest()[:12]
    target = prepare_for(cfg, log=lambda *_: None)
    _DATA["store_ids"], _DATA["hidden"] = list(reader.provenance["capture_layer_ids"]), reader.provenance["hidden_size"]
    return cfg, target, fit, val, bool(reader.provenance.get("final_is_normed", True)), key


def heldout_decode_rows(cfg, limit: int, max_new_tokens: int) -> list[dict]:
    """The run's held-out prompts as the evaluate stage decodes them (its `heldout_rows`:
    the first answer, cut to `max_new_tokens`), in the decoder's terms."""
    from workflows.core.layout import RunLayout
    from workflows.evaluate.stage import heldout_rows

    return as_decode_rows(heldout_rows(RunLayout.of(cfg), limit, max_new_tokens))


def as_decode_rows(rows: list[dict]) -> list[dict]:
    """{input_ids, loss_mask} rows whose mask marks one answer after the prompt -> {prompt,
    answer_len}: the prompt is what precedes the answer."""
    out = []
    for r in rows:
        start = r["loss_mask"].index(1)
        out.append({"prompt": list(r["input_ids"][:start]), "answer_len": len(r["input_ids"]) - start})
    return out


def own_layers(samples: list[dict], ids: list[int]) -> list[dict]:
    """The samples with the aux states of the capture ids `ids` only, of those the store
    holds (a store of several families' layers; storage.reader.aux_slots refuses a missing one)."""
    import torch

    from storage.reader import aux_slots

    slots, h = aux_slots(_DATA["store_ids"], ids, "the bench's store"), _DATA["hidden"]
    if slots is None:
        return samples
    return [{**s, "aux": torch.cat([s["aux"][:, k * h : (k + 1) * h] for k in slots], dim=-1)} for s in samples]


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


def load_into_worker(overrides: list[str], fraction: float, fit_samples: int, threads: int) -> None:
    exit_with_parent()
    _, _, _DATA["fit"], _DATA["val"], _DATA["final_is_normed"], _ = load_split(overrides, fraction, fit_samples)
    _DATA["threads"] = threads


def exit_with_parent(every_s: float = 2.0) -> None:
    """End this pool worker when the bench that started it is gone: a killed parent
    (SIGTERM, SIGKILL) leaves its spawned workers running, reparented, holding the cores for
    the rest of their trials."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every_s)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="exit-with-parent").start()


def trial_key(args: dict) -> str:
    """What a trial's figures depend on: a rerun with the same key reuses its files."""
    keyed = {k: args[k] for k in ("base", "overrides", "seed", "steps", "eval_every", "patience", "fraction", "store")}
    if args.get("fit_samples"):  # only when set: the keys of whole-split trials stay as they were
        keyed["fit_samples"] = args["fit_samples"]
    return hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:12]


def trial_stem(args: dict) -> str:
    slug = "".join(c if c.isalnum() or c in "=.-" else "_" for c in args["name"])
    return f"{slug}-seed{args['seed']}-{trial_key(args)}"


def trial_file(args: dict, ext: str) -> Path:
    """<trials>/<setting>-seed<s>-<key>.<ext> (a setting's name may hold dots: no with_suffix)."""
    return Path(args["trials_dir"]) / f"{trial_stem(args)}.{ext}"


def built_trial(args: dict):
    """(cfg, draft at its seeded initialisation, target head, vocab coverage) of one trial."""
    from eagle3.vocab import build_draft_vocab, count_tokens
    from workflows.core.config import auto_draft_vocab_size, compose
    from workflows.core.precision import resolve
    from workflows.core.target_weights import read_target_head
    from workflows.train.trainer import build_draft

    cfg = compose([*args["base"], *args["overrides"], f"seed={args['seed']}", f"train.steps={args['steps']}"])
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, compute_dtype=resolve(cfg.train.compute_dtype)))
    fit = _DATA["fit"]
    counts = sum(count_tokens(s["input_ids"], s["loss_mask"], cfg.target.vocab_size) for s in fit)
    size = cfg.draft.draft_vocab_size or auto_draft_vocab_size(cfg.target.vocab_size, int((counts > 0).sum()))
    vocab = build_draft_vocab(counts, size, warn=lambda *_: None)
    draft = build_draft(cfg.draft, cfg.target, args["target"], vocab, seed=cfg.seed, init_from=cfg.train.init_from)
    return cfg, draft, read_target_head(Path(args["target"]), _DATA["final_is_normed"]), vocab.covered_fraction


def validation_cfg(cfg):
    """The trial's loop settings, scored at the served number of steps (evaluate.num_steps)."""
    k = cfg.evaluate.num_steps
    return dataclasses.replace(
        cfg.train, acceptance_k=k, ttt=dataclasses.replace(cfg.train.ttt, length=max(k, cfg.train.ttt.length))
    )


def run_trial(args: dict) -> dict:
    """Train one (setting, seed) on the fit samples, evaluating the validation walk every
    `eval_every` steps; stop after `patience` evaluations without a new best (0: never);
    report, and save, the weights of the best evaluation."""
    import torch
    from safetensors.torch import save_file

    from eagle3.target_features import collate_samples
    from eagle3.training import evaluate, train_in_memory

    torch.set_num_threads(_DATA.get("threads", torch.get_num_threads()))
    cfg, draft, head, covered = built_trial(args)
    fit, val = own_layers(_DATA["fit"], cfg.draft_capture_ids), own_layers(_DATA["val"], cfg.draft_capture_ids)
    b = cfg.train.batch_size
    rng = random.Random(args["seed"])
    order: list[dict] = []
    epoch_batches = [collate_samples(fit[i : i + b]) for i in range(0, len(fit), b)]
    while len(order) < cfg.train.steps:  # a fresh shuffle each epoch, as the stream does
        order += rng.sample(epoch_batches, len(epoch_batches))
    eval_every = args["eval_every"] or len(epoch_batches)  # default: once an epoch
    val_cfg = validation_cfg(cfg)
    val_batches = [collate_samples(val[i : i + 4]) for i in range(0, len(val), 4)]
    # [steps done, walk, step-0 acceptance rate] at each walk, and the weights of the best
    # one: restored, with the loop's state, from a killed trial's last walk
    walks: list = []
    kept: dict = {}
    partial, resumable = trial_file(args, "partial.json"), trial_file(args, "resume.pt")
    resume = None
    if resumable.exists():  # written by this bench (weights_only: tensors and plain data)
        try:
            saved = torch.load(resumable, weights_only=True)
        except Exception as e:  # noqa: BLE001 (any unreadable file gets the same advice)
            raise SystemExit(f"{resumable}: unreadable ({e}); delete it to train this trial from step 0") from e
        draft.load_state_dict(saved["weights"], strict=False)
        walks, kept, resume = [tuple(w) for w in saved["walks"]], saved["kept"], saved["loop"]
        print(f"    {args['name']} seed {args['seed']}: resumed at step {resume['step']}", flush=True)
    start = resume["step"] if resume else 0
    seconds_before = saved["train_s"] if resume else 0.0  # training time of the killed runs
    t0 = time.perf_counter()

    def stopped(done: int, best: dict) -> bool:
        return bool(args["patience"]) and done - best["step"] >= args["patience"] * eval_every

    def at_walk(done: int, best: dict, last_eval: dict, loop: dict) -> None:
        # Evaluating changes nothing in training (no noise, no RNG draw): the weights at a
        # step are those of a run that never evaluated.
        if best["step"] == done:  # the weights evaluated: the average's with train.ema_decay
            evaluated = loop["average"]["average"] if "average" in loop else dict(trainable(draft))
            kept.update(step=done, weights={n: p.detach().clone() for n, p in evaluated.items()})
        walks.append((done, last_eval["acceptance_walk"], last_eval["step_alpha"][0]))
        train_s = seconds_before + time.perf_counter() - t0
        state = {"weights": dict(trainable(draft)), "walks": walks, "kept": kept, "loop": loop, "train_s": train_s}
        torch.save(state, str(resumable) + ".tmp")
        os.replace(str(resumable) + ".tmp", resumable)
        # After the resume state: a walk the curve shows is one a rerun goes on from
        write_json(partial, {"name": args["name"], "seed": args["seed"], "steps": cfg.train.steps, "curve": walks})
        print(
            f"    {args['name']} seed {args['seed']}: step {done}/{cfg.train.steps} walk {walks[-1][1]:.3f} "
            f"(best {best['acceptance_walk']:.3f} at {best['step']}), {time.perf_counter() - t0:.0f} s",
            flush=True,
        )

    # checkpoint_every = eval_every: the loop checkpoints right after each walk (and its stop)
    train_cfg = dataclasses.replace(cfg.train, eval_every=eval_every, log_every=eval_every, checkpoint_every=eval_every)
    if not (resume and (start == cfg.train.steps or stopped(start, resume["best"]))):  # killed before its end
        train_in_memory(
            draft,
            head,
            order[: cfg.train.steps],
            train_cfg,
            val_batches,
            eval_cfg=val_cfg,
            stop=lambda done, state: stopped(done, state.best),
            checkpoint=at_walk,
            resume=resume,
        )
    train_s = seconds_before + time.perf_counter() - t0
    curve = walks
    done = curve[-1][0]
    best_step = max(curve, key=lambda c: c[1])[0]  # the first of equal walks, as LoopState.best
    # The best walk's weights, as evaluated (a run resumed at its end holds the raw ones)
    draft.load_state_dict(kept["weights"], strict=False)
    ev = evaluate(draft, head, val_batches, val_cfg)
    tokens = sum(int(x["attention_mask"].sum()) for x in order[:done])
    k = cfg.evaluate.num_steps
    out = {
        "name": args["name"],
        "seed": args["seed"],
        "overrides": args["overrides"],
        "steps": cfg.train.steps,
        "steps_done": done,
        "best_step": best_step,
        "curve": curve,
        "train_tokens_per_s": tokens / train_s,
        "step_acc": ev["step_acc"][:k],
        "step_alpha": ev["step_alpha"][:k],
        "acceptance_walk": ev["acceptance_walk"],
        "vocab_covered": covered,
        "threads": torch.get_num_threads(),  # the figures depend on it (reduction order)
    }
    weights = trial_file(args, "safetensors")
    save_file(dict(trainable(draft)), str(weights) + ".tmp")
    os.replace(str(weights) + ".tmp", weights)
    write_json(trial_file(args, "json"), out)  # last: the trial's mark of done
    partial.unlink(missing_ok=True)
    resumable.unlink(missing_ok=True)
    return out


def trainable(draft):
    """The trained tensors (not the target's frozen embeddings, rebuilt by `built_trial`)."""
    return [(n, p.detach().contiguous()) for n, p in draft.named_parameters() if p.requires_grad]


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def decode_trial(args: dict, result: dict) -> dict:
    """Decoded acceptance of a trained trial (its saved weights), chain and tree, each
    checked lossless against the greedy answers."""
    import torch
    from safetensors.torch import load_file

    from eagle3.families import family_of
    from eagle3.spec_decode import SpeculativeDecoder
    from workflows.core.engine_spec import EngineSpec
    from workflows.core.engines import HFEngine

    torch.set_num_threads(_DATA.get("threads", torch.get_num_threads()))
    cfg, draft, _, _ = built_trial(args)
    draft.load_state_dict(load_file(str(trial_file(args, "safetensors"))), strict=False)
    k = cfg.evaluate.num_steps
    engine = HFEngine(EngineSpec(args["target"], dtype="float32", capture_ids=cfg.draft_capture_ids))
    model, draft = engine.model, draft.float().eval()
    family = family_of(draft)
    eos = [engine.tokenizer.eos_token_id]
    out = dict(result)
    for label, (steps, topk, ndt) in (("chain", (k, 1, k + 1)), ("tree", TREE)):
        if topk > 1 and not family.trees:  # a block draft proposes one chain per pass
            continue
        dec = SpeculativeDecoder(model, family.drafter(draft, False), cfg.draft_capture_ids, steps, topk, ndt, eos)
        gained = passes = 0
        lossless = True
        for row, plain in zip(args["decode"], args["greedy"]):
            res = dec.generate(row["prompt"], row["answer_len"])
            lossless &= res.tokens == plain
            gained, passes = gained + res.gained, passes + res.target_forwards
        dec.target.close()
        out[f"decoded_{label}"] = gained / passes
        out[f"lossless_{label}"] = bool(lossless)
    out["decoded_on"] = args["decode_key"]
    write_json(trial_file(args, "json"), out)
    return out


def greedy_answers(target: str, capture_ids: list[int], rows: list[dict]) -> list[list[int]]:
    """Plain greedy answers of the decoded prompts, once: every trial is checked against them."""
    from eagle3.spec_decode import greedy_decode
    from workflows.core.engine_spec import EngineSpec
    from workflows.core.engines import HFEngine

    engine = HFEngine(EngineSpec(target, dtype="float32", capture_ids=capture_ids))
    eos = [engine.tokenizer.eos_token_id]
    return [greedy_decode(engine.model, r["prompt"], r["answer_len"], eos)[0] for r in rows]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--overrides", nargs="*", default=[], help="Hydra overrides selecting the run (its store)")
    ap.add_argument("--grid", choices=sorted(GRIDS), default="knobs")
    ap.add_argument("--only", nargs="*", default=None, help="run only these settings of the grid")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--validation-fraction", type=float, default=0.1)
    ap.add_argument("--fit-samples", type=int, default=0, help="train on this many of the fit samples (0: all of them)")
    ap.add_argument("--eval-every", type=int, default=0, help="validation walk every N steps (0: once an epoch)")
    ap.add_argument("--patience", type=int, default=2, help="stop after N walks with no new best (0: never)")
    ap.add_argument("--decode-prompts", type=int, default=12, help="0: no decoding")
    ap.add_argument("--decode-tokens", type=int, default=96)
    ap.add_argument(
        "--decode-on",
        choices=["validation", "heldout"],
        default="validation",
        help="the prompts the finalists are decoded on: the validation split, or the run's held-out "
        "prompts (reported only: the finalists are chosen on validation)",
    )
    ap.add_argument("--finalists", type=int, default=3, help="decode the baseline and the N best other settings")
    ap.add_argument("--jobs", type=int, default=1, help="trials at a time; the cores are shared out between them")
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="threads per trial (0: the cores shared out by --jobs, or every core for a trial left alone); "
        "a trial's figures depend on it, so resume one with the count it started with",
    )
    ap.add_argument("--out", type=Path, default=None, help="default: <run_dir>/ablation/ablation.{json,md}")
    a = ap.parse_args(argv)
    cfg, target, fit, val, final_is_normed, store_key = load_split(a.overrides, a.validation_fraction, a.fit_samples)
    grid = [g for g in GRIDS[a.grid] if a.only is None or g[0] in a.only]
    out = a.out or cfg.run_path / "ablation" / "ablation"
    trials_dir = out.parent / "trials"
    trials_dir.mkdir(parents=True, exist_ok=True)
    threads = a.threads or max(1, (os.cpu_count() or 1) // a.jobs)
    shared = {
        "base": a.overrides,
        "steps": a.steps,
        "target": str(target),
        "eval_every": a.eval_every,
        "patience": a.patience,
        "fraction": a.validation_fraction,
        "fit_samples": a.fit_samples,
        "store": store_key,
        "trials_dir": str(trials_dir),
    }
    trials = [{**shared, "name": n, "overrides": o, "seed": s} for n, o in grid for s in a.seeds]
    done = {}
    for t in trials:  # a rerun reuses every finished trial (same settings, steps, split, rule)
        if trial_file(t, "json").exists() and trial_file(t, "safetensors").exists():
            done[trial_stem(t)] = json.loads(trial_file(t, "json").read_text())
    todo = [t for t in trials if trial_stem(t) not in done]
    print(
        f"bench_quality: {len(fit)} fit / {len(val)} validation samples, {len(grid)} settings x "
        f"{len(a.seeds)} seeds, {a.steps} steps each (patience {a.patience}), {len(todo)} to train "
        f"({len(done)} reused from {trials_dir}), {a.jobs} at a time, {threads} thread(s) each",
        flush=True,
    )
    _DATA.update(fit=fit, val=val, final_is_normed=final_is_normed, threads=threads)
    for r in run_all(run_trial, todo, a, threads):
        done[trial_stem(r[0])] = r[1]
        print(f"  {line(r[1])}", flush=True)
    results = [done[trial_stem(t)] for t in trials]
    rows = []
    if a.decode_prompts:
        rows = (
            decode_rows(val, a.decode_prompts, a.decode_tokens)
            if a.decode_on == "validation"
            else heldout_decode_rows(cfg, a.decode_prompts, a.decode_tokens)
        )
    chosen = finalists(results, grid, a.finalists) if rows else []
    if chosen:
        decode_key = hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:12]
        to_decode = [t for t in trials if t["name"] in chosen and done[trial_stem(t)].get("decoded_on") != decode_key]
        print(f"bench_quality: decoding {len(rows)} {a.decode_on} prompts for {chosen}", flush=True)
        if to_decode:
            greedy = greedy_answers(str(target), cfg.draft_capture_ids, rows)
            for t in to_decode:
                t.update(decode=rows, greedy=greedy, decode_key=decode_key)
            for r in run_all(decode_one, to_decode, a, threads):
                done[trial_stem(r[0])] = r[1]
                print(f"  {line(r[1])}", flush=True)
        results = [done[trial_stem(t)] for t in trials]
    table = summarise(results, grid, decode_key if chosen else None)
    meta = {
        "grid": a.grid,
        "steps": a.steps,
        "seeds": a.seeds,
        "patience": a.patience,
        "fit": len(fit),
        "val": len(val),
        "store": cfg.run_path.name,
        "decoded": len(rows),
        "decoded_on": a.decode_on,
        "finalists": chosen,
        "k": cfg.evaluate.num_steps,
        "command": "python -m bench.bench_quality " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    write_json(out.with_suffix(".json"), {"meta": meta, "table": table, "trials": results})
    out.with_suffix(".md").write_text(markdown(table, meta))
    print(markdown(table, meta))


def decode_one(args: dict) -> dict:
    return decode_trial(args, json.loads(trial_file(args, "json").read_text()))


def run_all(fn, trials: list[dict], a, threads: int):
    """(trial, fn(trial)) in order: `--jobs` at a time in a pool of workers with `threads`
    each, and what is left over when fewer than `--jobs` remain in this process, with every
    core unless `--threads` says otherwise (no start-up of another interpreter, no core left
    idle)."""
    pooled = len(trials) - len(trials) % a.jobs if a.jobs > 1 else 0
    if pooled:
        yield from run_pooled(fn, trials[:pooled], a, threads)
    _DATA["threads"] = a.threads or os.cpu_count() or 1
    for t in trials[pooled:]:
        yield t, fn(t)


def run_pooled(fn, trials: list[dict], a, threads: int):
    # Spawned, not forked: this process has run torch (greedy answers, int8 dequantised on
    # read), and a fork of a process whose OpenMP pool has started can deadlock in the child
    # (the int8 trials sat idle at --jobs 2 when forked).
    with ProcessPoolExecutor(
        a.jobs,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=load_into_worker,
        initargs=(a.overrides, a.validation_fraction, a.fit_samples, threads),
    ) as pool:
        yield from zip(trials, pool.map(fn, trials))


if __name__ == "__main__":
    main()
