"""The GPU proof in one command: what only a GPU can show, run in one lent window.

    make gpu-wheels                                   # here: the wheels the GPU machine lacks
    python -m bench.gpu_suite --wheels .gpu-wheels    # there, with .gpu-wheels copied beside the checkout
    python -m bench.gpu_suite --dry-run               # anywhere: the same script at tiny shapes (CI)

The lent machine has torch, transformers, triton, numpy and safetensors, and none of Ray,
DeepSpeed, SGLang, Hydra or pytest; `--wheels` unpacks the carried wheels (SpecForge 0.2.0,
DeepSpeed 0.19.8 and their small dependencies, pytest, hypothesis) onto `sys.path` without
installing anything. Six sections, each timed and reported on its own (a failing one is
reported with its error and the next still runs):

1. `gpu_tests`: the `gpu`-marked tests that need only torch (flex against dense, forward and
   backward, on the device; flex memory linear in length; the store's batches pinned and on
   the device), by pytest in a child process (the dry run collects them only: CI runs them).
2. `deepspeed`: the DeepSpeed engine of the train stage (workflows.train.trainer.DeepSpeedStep,
   ZeRO 1, one rank over NCCL) against the plain optimizer, a few steps from the same
   weights on the same batches: the losses within the dtype's tolerance.
3. `capture`: HF capture (the capture stage's writer into a Zarr store) on the device,
   divided by the bare forward of the same engine on the same batches.
4. `decoder`: the reference speculative decoder on the device, lossless against greedy.
5. `dflash_step`: the DFlash block draft's training step (flex block attention) at the
   DFlash recipe's Qwen3-8B shapes (5 layers, blocks of 16, 512 anchors), T = 2048, 4096,
   beside SpecForge's own DFlash step from its wheel (bench.specforge_dflash_step).
6. `train_step`: our training step (eagle3.training.train_step, the one production runs)
   beside SpecForge 0.2.0's (bench.specforge_step) at Llama-3.1-8B draft shapes, TTT 7,
   batch 1, bf16, T = 2048, 4096, 8192: tokens/s, peak GiB, MFU against a bf16 matmul
   measured in the same run, and each variant's wall time with its compilation
   (bench.bench_train_gpu). Last, as the longest: it starts no length it expects to end past
   `--budget-s` (420 s) and reports the lengths it skipped; `--variants` adds the memory
   variants (loss in blocks, MLP recomputed) to the default `ours compiled`.

Writes one JSON (`--out`, default `$OUT/gpu_suite.json` where the machine provides
`$OUT`) and prints a table. The first H200 run (2026-12-04): gpu_tests 51 s, deepspeed
16 s, capture 56 s, decoder 4 s; train_step, with all four variants, finished T=2048 and
not T=4096 in the 450 s it had.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.bench_train_gpu import LLAMA8B, QWEN3_8B_DFLASH

ROOT = Path(__file__).resolve().parents[1]

VARIANTS = ("ours", "blocks", "lean", "compiled")  # of our training step; see variants()

TINY = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=512, draft_vocab=128, target_hidden=64)
TINY_DFLASH = {**TINY, "num_layers": 2, "num_target_layers": 3, "block_size": 4, "num_anchors": 8}


@dataclass
class Plan:
    """What each section runs, at full size on a GPU or at tiny shapes for the dry run."""

    device: torch.device
    shapes: dict
    seqs: list[int]
    ttt: int
    steps: int
    dtype: str
    capture_model: dict | None  # a random Llama for the capture ratio (None: the tiny preset)
    capture_samples: int
    capture_length: int
    loss_block_rows: int  # the second variant of our step: train.objective.loss_block_rows
    # gpu_tests: run them (on the GPU), or only collect them (the dry run: CI runs the same
    # tests itself on the CPU, so the rehearsal checks the selection, not the tests twice).
    run_gpu_tests: bool = True
    partial: Path | None = None  # where train_step writes its rows as they finish (a timeout keeps them)
    # train_step's variants of our step (see variants()). The first H200 run (2026-12-04)
    # spent 450 s on T=2048 alone with all four, mostly compiling; the memory variants
    # (blocks, lean) were the slowest and matter only where memory is short, so a lent
    # window runs them only when asked (--variants).
    variant_names: tuple[str, ...] = ("ours", "compiled")
    # train_step starts no sequence length it expects to finish past this many seconds
    # (the next length costs about twice the last), so that one lent window holds the suite.
    budget_s: float = 420.0
    # dflash_step: the block draft's training step at DFlash's Qwen3-8B recipe, these lengths.
    dflash_shapes: dict | None = None
    dflash_seqs: tuple[int, ...] = ()

    @classmethod
    def full(cls) -> "Plan":
        return cls(
            torch.device("cuda"),
            LLAMA8B,
            [2048, 4096, 8192],
            ttt=7,
            steps=4,
            dtype="bfloat16",
            capture_model=dict(
                hidden_size=2048,
                intermediate_size=5632,
                num_hidden_layers=16,
                num_attention_heads=16,
                num_key_value_heads=8,
            ),
            capture_samples=64,
            capture_length=1024,
            loss_block_rows=2048,
            dflash_shapes=QWEN3_8B_DFLASH,
            dflash_seqs=(2048, 4096),
        )

    @classmethod
    def dry(cls) -> "Plan":
        return cls(
            torch.device("cpu"),
            TINY,
            [64],
            ttt=3,
            steps=2,
            dtype="float32",
            capture_model=None,
            capture_samples=8,
            capture_length=48,
            loss_block_rows=16,
            run_gpu_tests=False,
            variant_names=VARIANTS,
            dflash_shapes=TINY_DFLASH,
            dflash_seqs=(64,),
        )


# ---------------------------------------------------------------------------- wheels
def unpack_wheels(folder: Path) -> Path:
    """Every wheel in `folder`, unpacked into one temporary site folder put first on
    sys.path and PYTHONPATH (child processes too). A wheel is a zip of its installed files;
    unpacking it is all `pip install --no-deps` would do for these pure and binary wheels,
    minus scripts, which the suite does not use."""
    site = Path(tempfile.mkdtemp(prefix="gpu-suite-site-"))
    wheels = sorted(folder.glob("*.whl"))
    if not wheels:
        raise SystemExit(f"{folder}: no wheel; run `make gpu-wheels` here first")
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            z.extractall(site)
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return site


# ---------------------------------------------------------------------------- sections
def gpu_tests(plan: Plan) -> dict:
    """The torch-only `gpu` tests, in a child process (pytest's own run, its own exit code)."""
    files = ["tests/test_attention_scale.py", "tests/test_device_batches.py", "tests/test_dflash.py"]
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *files]
    if not plan.run_gpu_tests:
        cmd.append("--collect-only")
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    tail = (done.stdout + done.stderr).strip().splitlines()
    summary = tail[-1] if tail else ""
    result = {"ok": done.returncode == 0, "summary": summary}
    if done.returncode != 0:
        result["output_tail"] = "\n".join(tail[-40:])
    return result


def train_step(plan: Plan) -> dict:
    """Ours beside SpecForge's, per sequence length (bench.bench_train_gpu, bench.specforge_step)."""
    from bench.bench_train_gpu import draft_config, matmul_tflops, run_one, step_flops
    from bench.specforge_step import build_specforge_step

    s, dev = plan.shapes, plan.device
    cfg = draft_config(s)
    peak = matmul_tflops(dev, n=8192 if dev.type == "cuda" else 256, reps=10 if dev.type == "cuda" else 2)
    rows, started, last_s = [], time.perf_counter(), 0.0
    for seq in plan.seqs:
        spent = time.perf_counter() - started
        if rows and spent + 2 * last_s > plan.budget_s:
            rows.append({"seq": seq, "skipped": f"budget: {spent:.0f} s spent, the last length took {last_s:.0f} s"})
            continue
        row, seq_started = {"seq": seq}, time.perf_counter()
        for name, settings in variants(plan):
            t0 = time.perf_counter()
            try:
                ours = run_one(cfg, seq, plan.ttt, dev, plan.steps, dtype=plan.dtype, **settings)
                row.update(
                    {
                        f"{name}_tokens_per_s": ours["tokens_per_s"],
                        f"{name}_peak_gib": ours["peak_gib"],
                        f"{name}_mfu": ours["tflops"] / peak,
                    }
                )
            except torch.OutOfMemoryError:
                row[name] = "out of memory"
            except Exception as exc:  # a variant that fails (compilation) is reported; the others run
                if name == "ours":
                    raise
                row[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
            row[f"{name}_wall_s"] = time.perf_counter() - t0  # with its warm-up and compilation
            free(dev)
        t0 = time.perf_counter()
        try:
            step = build_specforge_step(**s, seq=seq, ttt=plan.ttt, device=dev, dtype=plan.dtype)
            sf = time_steps(step, dev, plan.steps)
            row.update(
                specforge_tokens_per_s=seq / sf["seconds"],
                specforge_peak_gib=sf["peak_gib"],
                specforge_mfu=step_flops(cfg, seq, plan.ttt) / sf["seconds"] / 1e12 / peak,
                specforge_backend=getattr(step, "backend", "?"),
            )
            del step
        except torch.OutOfMemoryError:
            row["specforge"] = "out of memory"
        row["specforge_wall_s"] = time.perf_counter() - t0
        free(dev)
        last_s = time.perf_counter() - seq_started
        if "ours_tokens_per_s" in row and "specforge_tokens_per_s" in row:
            row["speedup"] = row["ours_tokens_per_s"] / row["specforge_tokens_per_s"]
        rows.append(row)
        if plan.partial is not None:
            plan.partial.write_text(json.dumps(rows, indent=1, default=str))
    ok = all("ours_tokens_per_s" in r for r in rows if "skipped" not in r)
    return {
        "ok": ok,
        "matmul_tflops": peak,
        "shapes": s,
        "ttt": plan.ttt,
        "dtype": plan.dtype,
        "loss_block_rows": plan.loss_block_rows,
        "rows": rows,
    }


def dflash_step(plan: Plan) -> dict:
    """The DFlash block draft's training step (eagle3.training.train_step on a DFlashDraft:
    flex block attention on CUDA) at the DFlash recipe's Qwen3-8B shapes, beside SpecForge's
    own DFlash step built from its wheel (bench.specforge_dflash_step), per sequence length:
    tokens/s, peak GiB, MFU. Each side reported on its own: one failing leaves the other."""
    from bench.bench_train_gpu import dflash_config, dflash_step_flops, matmul_tflops, run_one

    s, dev = plan.dflash_shapes, plan.device
    cfg = dflash_config(s)
    peak = matmul_tflops(dev, n=8192 if dev.type == "cuda" else 256, reps=10 if dev.type == "cuda" else 2)
    rows = []
    for seq in plan.dflash_seqs:
        row = {"seq": seq}
        t0 = time.perf_counter()
        try:
            ours = run_one(cfg, seq, cfg.block_size - 1, dev, plan.steps, dtype=plan.dtype)
            row.update(
                ours_tokens_per_s=ours["tokens_per_s"], ours_peak_gib=ours["peak_gib"], ours_mfu=ours["tflops"] / peak
            )
        except torch.OutOfMemoryError:
            row["ours"] = "out of memory"
        row["ours_wall_s"] = time.perf_counter() - t0
        free(dev)
        t0 = time.perf_counter()
        try:
            from bench.specforge_dflash_step import build_specforge_dflash_step

            step = build_specforge_dflash_step(**s, seq=seq, device=dev, dtype=plan.dtype)
            sf = time_steps(step, dev, plan.steps)
            row.update(
                specforge_tokens_per_s=seq / sf["seconds"],
                specforge_peak_gib=sf["peak_gib"],
                specforge_mfu=dflash_step_flops(cfg, seq) / sf["seconds"] / 1e12 / peak,
                specforge_backend=getattr(step, "backend", "?"),
            )
            del step
        except torch.OutOfMemoryError:
            row["specforge"] = "out of memory"
        except Exception as exc:  # SpecForge's side failing says why; ours still stands
            row["specforge"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        row["specforge_wall_s"] = time.perf_counter() - t0
        free(dev)
        if "ours_tokens_per_s" in row and "specforge_tokens_per_s" in row:
            row["speedup"] = row["ours_tokens_per_s"] / row["specforge_tokens_per_s"]
        rows.append(row)
    return {
        "ok": all("ours_tokens_per_s" in r for r in rows),
        "matmul_tflops": peak,
        "shapes": s,
        "dtype": plan.dtype,
        "rows": rows,
    }


def variants(plan: Plan) -> list[tuple[str, dict]]:
    """Our step as the train stage runs it by default; with the loss in blocks; lean (the
    loss in blocks and the MLP recomputed: the least memory); with the decoder layer
    compiled. (name, bench.bench_train_gpu.run_one's settings), those the plan names."""
    blocks = {"loss_block_rows": plan.loss_block_rows}
    every = {
        "ours": {},
        "blocks": blocks,
        "lean": {**blocks, "activation_checkpointing": "mlp"},
        "compiled": {"compile_layer": True},
    }
    return [(name, every[name]) for name in plan.variant_names]


def time_steps(step, device: torch.device, steps: int) -> dict:
    step()  # warm-up (and compilation)
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    seconds = (time.perf_counter() - started) / steps
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    return {"seconds": seconds, "peak_gib": peak}


def deepspeed_vs_plain(plan: Plan) -> dict:
    """DeepSpeedStep and PlainOptimizer from the same weights over the same batches."""
    import torch.distributed as dist

    from bench.bench_train_gpu import draft_config, random_batch
    from eagle3.modeling import Eagle3Draft
    from eagle3.training import PlainOptimizer, lr_at
    from eagle3.training import train_step as one_step
    from eagle3.ttt import TTTConfig
    from workflows.core.config import TrainSection
    from workflows.train.trainer import DeepSpeedStep

    dev = plan.device
    shapes = {
        **plan.shapes,
        "vocab": min(plan.shapes["vocab"], 32000),
        "hidden": min(plan.shapes["hidden"], 1024),
        "target_hidden": min(plan.shapes["target_hidden"], 1024),
        "intermediate": min(plan.shapes["intermediate"], 2816),
        "heads": min(plan.shapes["heads"], 8),
        "draft_vocab": min(plan.shapes["draft_vocab"], 8000),
    }
    cfg = draft_config(shapes)
    seq = min(plan.seqs[0], 1024)
    batches = [random_batch(cfg, seq, dev, seed=k) for k in range(3)]
    head = random_head(cfg, dev)
    train = TrainSection(
        batch_size=1,
        grad_accum=1,
        zero_stage=1,
        compute_dtype=plan.dtype,
        ttt=TTTConfig(length=plan.ttt),
        steps=len(batches),
    )
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        # Port 0: the one rank's TCP store binds a port the OS picks. A port found free and handed on
        # can be taken in between (CI lost a run to EADDRINUSE that way).
        MASTER_PORT="0",
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
    )
    if dev.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", rank=0, world_size=1)
    try:
        losses = {}
        for name in ("plain", "deepspeed"):
            torch.manual_seed(0)
            draft = Eagle3Draft(cfg).to(dev)
            opt = DeepSpeedStep(draft, train, 1, dev) if name == "deepspeed" else PlainOptimizer(draft, train.optim)
            g = torch.Generator(device=dev).manual_seed(0)
            losses[name] = [
                one_step(opt, head, [b], lr_at(k, train.steps, train.optim), train, g)["loss"]
                for k, b in enumerate(batches)
            ]
            del opt, draft
            free(dev)
    finally:
        dist.destroy_process_group()
    # bf16: DeepSpeed holds bf16 weights (fp32 masters), the plain step autocasts fp32 weights.
    rtol = 2e-2 if plan.dtype == "bfloat16" else 1e-4
    worst = max(abs(a - b) / max(abs(b), 1e-9) for a, b in zip(losses["deepspeed"], losses["plain"]))
    return {
        "ok": worst <= rtol and all(math.isfinite(v) for v in losses["deepspeed"]),
        "losses": losses,
        "worst_relative_difference": worst,
        "tolerance": rtol,
        "dtype": plan.dtype,
        "seq": seq,
    }


def capture_ratio(plan: Plan) -> dict:
    """HF capture into a store over the bare forward, same engine, same micro-batches."""
    from bench.bench_capture import measure, tiny_target

    target = tiny_target()
    if plan.capture_model is not None:
        target = random_llama(target, plan.capture_model)
    figures = measure(
        target,
        samples=plan.capture_samples,
        length=plan.capture_length,
        device=str(plan.device),
        dtype=plan.dtype,
        repeats=2,
    )
    return {"ok": True, **figures}


def decoder(plan: Plan) -> dict:
    """The reference decoder on the device, float64 (no rounding decides an argmax): the
    speculative output equals greedy decoding token for token, on random models."""
    from eagle3.spec_decode import Eagle3Drafter, SpeculativeDecoder, greedy_decode
    from tests.helpers import random_draft, tiny_draft_config, tiny_hf_llama

    dev = plan.device
    target = tiny_hf_llama(num_layers=6, hidden=24, vocab=97).to(dev)
    draft = random_draft(tiny_draft_config(), seed=0, dtype=torch.float64).to(dev)
    decoder_ = SpeculativeDecoder(target, Eagle3Drafter(draft), [0, 2, 4], num_steps=3)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 97, (8,), generator=g).tolist() for _ in range(4)]
    same, gained, forwards = 0, 0, 0
    for prompt in prompts:
        got = decoder_.generate(prompt, 32)
        want, _ = greedy_decode(target, prompt, 32)
        same += got.tokens == want
        gained, forwards = gained + got.gained, forwards + got.target_forwards
    return {
        "ok": same == len(prompts),
        "identical_to_greedy": f"{same}/{len(prompts)}",
        "acceptance_length": gained / forwards,
        "device": str(dev),
    }


# The quick sections first: the first H200 window ran out inside train_step, which had run
# second, and the three after it needed a second call.
SECTIONS = {
    "gpu_tests": gpu_tests,
    "deepspeed": deepspeed_vs_plain,
    "capture": capture_ratio,
    "decoder": decoder,
    "dflash_step": dflash_step,
    "train_step": train_step,
}


# ---------------------------------------------------------------------------- helpers
def random_head(cfg, device):
    from eagle3.target_head import TargetHead

    g = torch.Generator(device="cpu").manual_seed(1)
    return TargetHead((torch.randn(cfg.vocab_size, cfg.target_hidden_size, generator=g) * 0.02).to(device))


def random_llama(like: Path, shape: dict) -> Path:
    """A random Llama of `shape` beside the tiny preset's tokenizer: real capture sizes
    without downloading a checkpoint."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(tempfile.mkdtemp(prefix="gpu-suite-target-"))
    config = AutoConfig.from_pretrained(like)
    for k, v in {**shape, "vocab_size": 32000, "tie_word_embeddings": False}.items():
        setattr(config, k, v)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
    for file in like.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            (folder / file.name).write_bytes(file.read_bytes())
    return folder


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def table(results: dict) -> str:
    lines = ["| section | ok | seconds | figures |", "|---|---|---|---|"]
    for name, r in results.items():
        figures = {k: v for k, v in r.items() if k not in ("ok", "seconds", "rows", "error", "output_tail", "losses")}
        lines.append(f"| {name} | {r.get('ok')} | {r.get('seconds', float('nan')):.0f} | {short(figures)} |")
    step = results.get("train_step", {})
    if step.get("rows"):
        lines += [
            "",
            "| seq | step | tokens/s | peak GiB | MFU | tokens/s ÷ SpecForge's | wall s |",
            "|---|---|---|---|---|---|---|",
        ]
        names = {
            "ours": "ours",
            "blocks": f"ours, loss in blocks of {step['loss_block_rows']}",
            "lean": "ours, loss in blocks and MLP recomputed",
            "compiled": "ours, decoder layer compiled",
            "specforge": "SpecForge 0.2.0",
        }
        for r in step["rows"]:
            if "skipped" in r:
                lines.append(f"| {r['seq']} | skipped | {r['skipped']} | | | | |")
                continue
            for key, name in names.items():
                if f"{key}_wall_s" not in r:  # a variant this run did not ask for
                    continue
                tps = r.get(f"{key}_tokens_per_s")
                ratio = tps / r["specforge_tokens_per_s"] if tps and r.get("specforge_tokens_per_s") else None
                lines.append(
                    f"| {r['seq']} | {name} | {fmt(tps, '.0f') if tps else r.get(key, '-')} | "
                    f"{fmt(r.get(f'{key}_peak_gib'))} | {fmt(r.get(f'{key}_mfu'), '.0%')} | "
                    f"{fmt(ratio, '.2f')} | {fmt(r.get(f'{key}_wall_s'), '.0f')} |"
                )
    blocks = results.get("dflash_step", {})
    if blocks.get("rows"):
        lines += [
            "",
            f"DFlash block draft, {blocks['shapes'].get('num_layers')} layers, blocks of "
            f"{blocks['shapes'].get('block_size')}, {blocks['shapes'].get('num_anchors')} anchors ({blocks['dtype']}):",
            "",
            "| seq | step | tokens/s | peak GiB | MFU | tokens/s ÷ SpecForge's | wall s |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in blocks["rows"]:
            for key, name in (("ours", "ours"), ("specforge", "SpecForge's DFlash")):
                tps = r.get(f"{key}_tokens_per_s")
                ratio = tps / r["specforge_tokens_per_s"] if tps and r.get("specforge_tokens_per_s") else None
                lines.append(
                    f"| {r['seq']} | {name} | {fmt(tps, '.0f') if tps else r.get(key, '-')} | "
                    f"{fmt(r.get(f'{key}_peak_gib'))} | {fmt(r.get(f'{key}_mfu'), '.0%')} | "
                    f"{fmt(ratio, '.2f')} | {fmt(r.get(f'{key}_wall_s'), '.0f')} |"
                )
    return "\n".join(lines)


def fmt(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def short(figures: dict) -> str:
    text = json.dumps(figures, default=str)
    return text if len(text) < 300 else text[:297] + "..."


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (what CI runs)")
    ap.add_argument("--wheels", type=Path, default=None, help="a folder of wheels to unpack onto sys.path first")
    ap.add_argument("--only", nargs="*", choices=list(SECTIONS), default=list(SECTIONS))
    ap.add_argument("--seqs", type=int, nargs="*", default=None, help="train_step's sequence lengths (a rerun's)")
    ap.add_argument("--variants", nargs="*", choices=VARIANTS, default=None)
    ap.add_argument("--budget-s", type=float, default=None, help="train_step's time budget in seconds")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if a.wheels is not None:
        unpack_wheels(a.wheels)
    if not a.dry_run and not torch.cuda.is_available():
        raise SystemExit("no GPU visible to torch; run with --dry-run for the CPU rehearsal")
    plan = Plan.dry() if a.dry_run else Plan.full()
    plan.seqs = a.seqs or plan.seqs
    plan.variant_names = tuple(a.variants or plan.variant_names)
    plan.budget_s = plan.budget_s if a.budget_s is None else a.budget_s
    out = a.out or Path(os.environ.get("OUT", ".")) / "gpu_suite.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    plan.partial = out.with_name("gpu_suite.train_step.partial.json")
    results = {
        "environment": {
            "device": torch.cuda.get_device_name() if plan.device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "dry_run": a.dry_run,
            "ok": True,
            "seconds": 0.0,
        }
    }
    for name in a.only:
        started = time.perf_counter()
        try:
            results[name] = SECTIONS[name](plan)
        except Exception as exc:  # reported, and the next section still runs
            results[name] = {
                "ok": False,
                "error": f"{type(exc).__name__}: {exc}",
                "output_tail": traceback.format_exc()[-3000:],
            }
        results[name]["seconds"] = time.perf_counter() - started
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1, default=str))  # what finished survives a timeout
        print(f"[gpu_suite] {name}: ok={results[name]['ok']} in {results[name]['seconds']:.0f} s", flush=True)
    print(table(results))
    print(f"[gpu_suite] wrote {out}")
    failed = [n for n in a.only if not results[n]["ok"]]
    for n in failed:
        print(
            f"[gpu_suite] {n} failed: {results[n].get('error') or results[n].get('summary')}\n"
            f"{results[n].get('output_tail', '')}"
        )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
