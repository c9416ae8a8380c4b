"""SpecForge 0.2.0's offline EAGLE-3 training step, built from SpecForge's own classes, for side-by-side timing.

    python -m bench.specforge_step --wheel /tmp/wheels/specforge-0.2.0-py3-none-any.whl --tiny

What one ``step()`` does is exactly one ``TrainerCore.train_step`` of SpecForge's trainer, fed with a batch shaped the
way SpecForge's offline EAGLE-3 reader hands it over. Nothing of SpecForge's maths is re-implemented here; this file
only builds the objects (random weights, random features) and calls them. The pieces, as laid out in the wheel:

* ``specforge/modeling/auto.py`` ``AutoDraftModel.from_config`` resolves ``LlamaForCausalLMEagle3``
  (``specforge/modeling/draft/llama3_eagle.py``) from a draft config JSON read by ``AutoDraftModelConfig.from_file``;
  ``attention_backend`` picks its attention class (``sdpa`` -> LlamaAttention, ``flex_attention`` ->
  LlamaFlexAttention, ``fa``, ``usp``; SpecForge's config default is ``flex_attention``). As SpecForge's
  ``build_eagle3_draft`` (``specforge/algorithms/model_providers.py``) does, the embedding is frozen and the draft is
  cast to the run dtype (``model.torch_dtype``, default bfloat16): the weights themselves are bf16, no autocast.
* ``specforge/algorithms/eagle3/model.py`` ``OnlineEagle3Model`` is SpecForge's one EAGLE-3 wrapper for both online
  and offline training (there is no separate offline class in 0.2.0). It turns target logits into the draft-vocab
  teacher (a ``torch.compile``d ``_compute_target_p``), projects the three concatenated aux hidden states with
  ``fc``, and unrolls the TTT loop ``length`` times (a ``DynamicCache`` for flex attention, a list cache for sdpa),
  with the Triton ``LogSoftmaxLoss`` (``specforge/core/loss.py``) per position. Its forward also calls
  ``torch.cuda.empty_cache()`` every step; that cost is SpecForge's and is timed with it.
* ``specforge/training/strategies/base.py`` ``Eagle3TrainStrategy`` (built through ``build_step`` in
  ``specforge/algorithms/eagle3/providers.py``): for offline features (``target_repr == "hidden_state"``) it runs
  the frozen ``TargetHead`` (``specforge/modeling/target/target_head.py``) over the stored last target hidden state,
  after ``TargetHead.preprocess`` shifts input ids / target by one, and weighs the TTT losses by ``0.8 ** i``.
  So the target lm-head matmul (seq x target_hidden x vocab, bf16, no grad) IS part of SpecForge's step.
* ``specforge/training/backend.py`` ``FSDPTrainingBackend`` + ``specforge/optimizer.py`` ``BF16Optimizer``: plain
  ``loss.backward()``, then the optimizer step: global grad norm, clip to ``max_grad_norm`` (0.5), AdamW
  (lr 1e-4, weight decay 0) on fp32 master copies, cosine-with-warmup LR step, copy back to the bf16 weights and
  drop the grads. The trainer's defaults come from ``TrainingConfig`` in ``specforge/config/schema.py``.
* ``specforge/training/controller.py`` ``TrainerCore.train_step`` chains forward/loss -> backward -> step and
  reduces the per-position metrics (several ``.item()`` host syncs, as in SpecForge's loop).
* ``specforge/algorithms/eagle3/data.py`` ``normalize_offline_sample`` maps stored features to the batch tensors
  (it also zeroes the last loss-mask position, so "all ones" becomes ones except the last token).

SpecForge's real single-GPU run additionally wraps the model in FSDP (``SHARD_GRAD_OP``, one rank) after
``init_distributed``; ``wrapper="fsdp"`` reproduces that, ``wrapper="none"`` (the default) calls the same backend
with ``wrap=False`` so the timing is not charged with one-rank FSDP hooks. Not timed: data loading, the
``TrainerController`` logging/checkpointing around ``train_step``.

On the CPU (the CI dry run) two things cannot run as on a GPU, and the step reports what it used instead:
``step.loss_impl`` is ``"reference"`` when SpecForge's own reference loss ``_compute_loss`` (same file as the
Triton kernel, same value) stands in for the Triton kernel, and ``step.backend`` names the attention backend:
``sdpa`` (SpecForge's other supported backend) on the CPU, because torch's flex_attention has no CPU backward.

Importing SpecForge's flex-attention module raises torch._dynamo's ``recompile_limit`` to 64 process-wide, which
also applies to anything else compiled in the same process.

SpecForge is importable from its wheel alone: its package ``__init__`` files are import-light, and the modules this
step needs import only torch, transformers (+ huggingface_hub, safetensors) and triton -- not sglang, ray, deepspeed,
datasets, pydantic or yunchang. ``step.specforge_modules`` lists the SpecForge modules that were imported.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import json
import os
import shutil
import sys
import tempfile
import time
import types
import zipfile
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch

# The SpecForge modules the step calls into, in import order; everything else they pull in is listed by
# specforge_modules() after the build.
NEEDED_MODULES = (
    "specforge.modeling.auto",
    "specforge.modeling.draft.llama3_eagle",
    "specforge.modeling.target.target_head",
    "specforge.algorithms.eagle3.model",
    "specforge.algorithms.eagle3.providers",
    "specforge.algorithms.eagle3.data",
    "specforge.training.strategies.base",
    "specforge.training.backend",
    "specforge.training.controller",
    "specforge.optimizer",
    "specforge.distributed",
    "specforge.core.loss",
    "specforge.runtime.contracts",
)
HEAVY_PACKAGES = ("sglang", "ray", "deepspeed", "datasets", "yunchang", "flash_attn", "pydantic")
DRAFT_ARCH = "LlamaForCausalLMEagle3"
TINY = {
    "hidden": 64,
    "heads": 4,
    "kv_heads": 2,
    "head_dim": 16,
    "intermediate": 128,
    "vocab": 512,
    "draft_vocab": 128,
    "target_hidden": 64,
    "seq": 64,
    "ttt": 3,
}


# ---------------------------------------------------------------- import SpecForge from its wheel


def _unpack_wheel(wheel: str) -> Path:
    """Extract the (pure-Python) wheel once into a cache dir keyed by its hash.

    A real directory rather than zipimport: Triton's @jit and inductor read source files through the file system.
    """
    data = Path(wheel).read_bytes()
    root = Path(tempfile.gettempdir()) / f"specforge-wheel-{hashlib.sha256(data).hexdigest()[:16]}"
    if not (root / "specforge" / "__init__.py").exists():
        staging = Path(tempfile.mkdtemp(prefix="specforge-unpack-", dir=root.parent))
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(staging)
        try:
            staging.rename(root)  # atomic: a concurrent unpacker either wins or finds ours
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
    return root


def _wheel_version(root: Path) -> str:
    for meta in root.glob("specforge-*.dist-info/METADATA"):
        for line in meta.read_text().splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    return "unknown"


def load_specforge(wheel: str | None = None) -> types.SimpleNamespace:
    """Import the SpecForge modules the step needs, from ``wheel`` if given, else from the installed package.

    Only the submodules in NEEDED_MODULES are imported; SpecForge's package __init__ files import nothing heavy,
    so no stand-in modules are needed.
    """
    version = "installed"
    if wheel:
        root = _unpack_wheel(wheel)
        loaded = sys.modules.get("specforge")
        if loaded is not None and not str(getattr(loaded, "__file__", "")).startswith(str(root)):
            raise RuntimeError(f"another specforge is already imported from {loaded.__file__}")
        if str(root) not in sys.path:
            sys.path.insert(0, str(root))
        version = _wheel_version(root)
    mods = {name: importlib.import_module(name) for name in NEEDED_MODULES}
    return types.SimpleNamespace(
        version=version,
        location=str(Path(mods["specforge.modeling.auto"].__file__).parents[2]),
        AutoDraftModel=mods["specforge.modeling.auto"].AutoDraftModel,
        AutoDraftModelConfig=mods["specforge.modeling.auto"].AutoDraftModelConfig,
        TargetHead=mods["specforge.modeling.target.target_head"].TargetHead,
        OnlineEagle3Model=mods["specforge.algorithms.eagle3.model"].OnlineEagle3Model,
        eagle3_model_module=mods["specforge.algorithms.eagle3.model"],
        build_step=mods["specforge.algorithms.eagle3.providers"].build_step,
        normalize_offline_sample=mods["specforge.algorithms.eagle3.data"].normalize_offline_sample,
        FSDPTrainingBackend=mods["specforge.training.backend"].FSDPTrainingBackend,
        ParallelConfig=mods["specforge.training.backend"].ParallelConfig,
        TrainerCore=mods["specforge.training.controller"].TrainerCore,
        BF16Optimizer=mods["specforge.optimizer"].BF16Optimizer,
        init_distributed=mods["specforge.distributed"].init_distributed,
        reference_loss=mods["specforge.core.loss"]._compute_loss,
        TrainBatch=mods["specforge.runtime.contracts"].TrainBatch,
    )


def specforge_modules() -> list[str]:
    """The SpecForge modules imported in this process (what actually runs)."""
    return sorted(m for m in sys.modules if m == "specforge" or m.startswith("specforge."))


def heavy_modules_loaded() -> list[str]:
    return sorted(p for p in HEAVY_PACKAGES if p in sys.modules)


# ---------------------------------------------------------------- model, head, batch


def _write_configs(
    workdir: Path, *, hidden, heads, kv_heads, head_dim, intermediate, vocab, draft_vocab, target_hidden, seq, ttt
) -> tuple[Path, Path]:
    """A draft config JSON in SpecForge's configs/*-eagle3.json shape, and a target config dir for TargetHead."""
    draft = {
        "architectures": [DRAFT_ARCH],
        "model_type": "llama",
        "hidden_act": "silu",
        "attention_bias": False,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate,
        "num_hidden_layers": 1,
        "vocab_size": vocab,
        "draft_vocab_size": draft_vocab,
        "target_hidden_size": target_hidden,
        # The rotary cache covers max_position_embeddings + 20; keep seq + ttt inside it so no rebuild is timed.
        "max_position_embeddings": max(2048, seq + ttt),
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    target = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": target_hidden,
        "vocab_size": vocab,
        "num_attention_heads": 1,
        "num_key_value_heads": 1,
        "num_hidden_layers": 1,
        "intermediate_size": 4 * target_hidden,
    }
    draft_file = workdir / "draft_config.json"
    draft_file.write_text(json.dumps(draft))
    target_dir = workdir / "target"
    target_dir.mkdir()
    (target_dir / "config.json").write_text(json.dumps(target))
    return draft_file, target_dir


def _install_vocab_map(draft, vocab: int, draft_vocab: int, gen: torch.Generator) -> None:
    """A random draft vocabulary in SpecForge's t2d/d2t layout (target_id = draft_id + d2t[draft_id]).

    SpecForge derives it from token counts; the counting is data prep, not part of the step, so a random subset
    of the target vocab stands in for the most frequent tokens.
    """
    if draft_vocab == vocab:
        return  # SpecForge keeps the identity buffers when the vocabularies match
    used = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[used] = True
    with torch.no_grad():
        draft.t2d.copy_(t2d)
        draft.d2t.copy_(used - torch.arange(draft_vocab))
    draft.vocab_mapping_loaded = True


def _build_draft(sf, draft_file: Path, attention: str, dtype, device, vocab, draft_vocab, gen):
    """Mirror of SpecForge's build_eagle3_draft, minus checkpoint loading: random init, frozen embedding."""
    config = sf.AutoDraftModelConfig.from_file(str(draft_file))
    draft = sf.AutoDraftModel.from_config(config, attention_backend=attention, torch_dtype=dtype)
    _install_vocab_map(draft, vocab, draft_vocab, gen)
    draft.freeze_embedding()
    return draft.to(device=device, dtype=dtype)


def _build_target_head(sf, target_dir: Path, vocab: int, target_hidden: int, device, gen):
    """TargetHead as TargetHead.from_pretrained leaves it (frozen, eval, bf16), with random weights."""
    head = sf.TargetHead(str(target_dir))
    with torch.no_grad():
        head.fc.weight.copy_(torch.randn(vocab, target_hidden, generator=gen) * target_hidden**-0.5)
    head.freeze_weights()
    return head.eval().to(device=device, dtype=torch.bfloat16)


def _build_batch(sf, *, vocab, target_hidden, seq, dtype, device, gen):
    """Random offline features in storage layout, normalized by SpecForge's own EAGLE-3 normalizer."""
    raw = {
        "input_ids": torch.randint(0, vocab, (seq,), generator=gen),
        "loss_mask": torch.ones(seq, dtype=torch.long),
        # aux_hidden_state: the three captured layers concatenated on the last dim, as the capture stores them
        "aux_hidden_state": torch.randn(1, seq, 3 * target_hidden, generator=gen).to(dtype),
        # the last target hidden state feeds TargetHead, which SpecForge always keeps in bf16
        "hidden_state": torch.randn(1, seq, target_hidden, generator=gen).to(torch.bfloat16),
    }
    tensors = sf.normalize_offline_sample(raw, max_len=seq)
    # Already on the device, so the strategy's .to(device) calls are no-ops and no H2D copy is timed.
    tensors = {k: v.to(device) for k, v in tensors.items()}
    return sf.TrainBatch(
        sample_ids=["bench-0"], strategy="eagle3", tensors=tensors, metadata={"target_repr": "hidden_state"}
    )


# ---------------------------------------------------------------- trainer pieces


def _ensure_process_group(sf) -> None:
    """One-rank process group the way SpecForge's CLI sets it up for a direct one-GPU run (needed by FSDP)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return
    # MASTER_PORT 0: the one rank's TCP store binds a port the OS picks; a port found free and handed on
    # can be taken in between (EADDRINUSE).
    for key, value in (
        ("RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("LOCAL_RANK", "0"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "0"),
    ):
        os.environ.setdefault(key, value)
    os.environ.setdefault("FSDP_SHARDING", "SHARD_GRAD_OP")  # SpecForge's TrainingConfig.fsdp_sharding default
    sf.init_distributed(timeout=10)


def _optimizer_factory(sf, total_steps: int):
    """BF16Optimizer with SpecForge's TrainingConfig defaults (lr 1e-4, clip 0.5, 1.5% warmup, cosine)."""

    def make(draft_module):
        return sf.BF16Optimizer(
            draft_module, lr=1e-4, max_grad_norm=0.5, warmup_ratio=0.015, lr_scheduler="cosine", total_steps=total_steps
        )

    return make


def _resolve_attention(attention: str | None, device: torch.device) -> str:
    """flex_attention (SpecForge's default) on CUDA; sdpa, which SpecForge also supports, on the CPU.

    torch refuses flex_attention's backward on CPU tensors, so the CPU dry run cannot use SpecForge's default.
    """
    if attention:
        return attention
    return "flex_attention" if device.type == "cuda" else "sdpa"


def _check_device_support(device: torch.device, attention: str, wrapper: str) -> None:
    """Fail before building anything for combinations torch itself rejects off-GPU."""
    if wrapper not in ("none", "fsdp"):
        raise ValueError(f"wrapper must be 'none' or 'fsdp', got {wrapper!r}")
    if device.type == "cpu" and attention == "flex_attention":
        raise ValueError("torch's flex_attention has no CPU backward; use attention='sdpa' on the CPU")
    if device.type == "cpu" and wrapper == "fsdp":
        raise ValueError("FSDP needs an accelerator; use wrapper='none' on the CPU")


class _ReferenceLoss:
    """Gives SpecForge's reference loss the LogSoftmaxLoss.apply call shape (CPU only: Triton needs a GPU)."""

    def __init__(self, fn):
        self._fn = fn

    def apply(self, logits, target_p, position_mask):
        return self._fn(logits, target_p, position_mask)


def build_specforge_step(
    *,
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    intermediate: int,
    vocab: int,
    draft_vocab: int,
    target_hidden: int | None = None,
    seq: int,
    ttt: int = 7,
    device: torch.device | str | None = None,
    dtype: str = "bfloat16",
    attention: str | None = None,
    seed: int = 0,
    wrapper: str = "none",
    wheel: str | None = None,
    total_steps: int = 10_000,
) -> Callable[[], float]:
    """Build SpecForge's offline EAGLE-3 training step at these shapes (batch 1); returns ``step() -> loss``.

    ``attention=None`` means flex_attention on CUDA, sdpa on the CPU. ``wrapper`` is "none" or "fsdp" (SpecForge's
    one-rank FSDP wrap). Attributes on the returned function: ``backend``, ``loss_impl``, ``wrapper``,
    ``specforge_version``, ``specforge_location``, ``specforge_modules``, ``last_result`` (SpecForge's StepResult).
    """
    device = (
        torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    )
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # SpecForge allocates some tensors on the "current" device
    target_hidden = target_hidden or hidden
    torch_dtype = getattr(torch, dtype)
    attention = _resolve_attention(attention, device)
    _check_device_support(device, attention, wrapper)
    sf = load_specforge(wheel)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)

    workdir = Path(tempfile.mkdtemp(prefix="specforge-step-"))
    draft_file, target_dir = _write_configs(
        workdir,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate=intermediate,
        vocab=vocab,
        draft_vocab=draft_vocab,
        target_hidden=target_hidden,
        seq=seq,
        ttt=ttt,
    )
    draft = _build_draft(sf, draft_file, attention, torch_dtype, device, vocab, draft_vocab, gen)
    # build_eagle3_model: the wrapper is cast to the run dtype too
    model = sf.OnlineEagle3Model(draft_model=draft, length=ttt, attention_backend=attention).to(
        device=device, dtype=torch_dtype
    )
    target_head = _build_target_head(sf, target_dir, vocab, target_hidden, device, gen)

    if wrapper == "fsdp":
        _ensure_process_group(sf)
    backend = sf.FSDPTrainingBackend(
        sf.ParallelConfig.from_distributed(), optimizer_factory=_optimizer_factory(sf, total_steps)
    )
    wrapped = backend.prepare_model(model, wrap=wrapper == "fsdp", optimizer_target=model.draft_model)
    strategy = sf.build_step(wrapped, target_head=target_head, compact_teacher=False, compact_teacher_chunk_size=None)
    core = sf.TrainerCore(strategy, backend, accumulation_steps=1)
    batch = _build_batch(
        sf, vocab=vocab, target_hidden=target_hidden, seq=seq, dtype=torch_dtype, device=device, gen=gen
    )

    # The Triton loss kernel needs CUDA tensors; elsewhere SpecForge's own reference loss computes the same value.
    use_triton = device.type == "cuda"
    loss_patch = (
        contextlib.nullcontext()
        if use_triton
        else mock.patch.object(sf.eagle3_model_module, "LogSoftmaxLoss", _ReferenceLoss(sf.reference_loss))
    )

    def step() -> float:
        with loss_patch:
            result = core.train_step(batch)
        step.last_result = result
        return float(result.loss)

    step.backend = attention
    step.loss_impl = "triton" if use_triton else "reference"
    step.wrapper = wrapper
    step.device = str(device)
    step.specforge_version = sf.version
    step.specforge_location = sf.location
    step.specforge_modules = specforge_modules()
    step.last_result = None
    return step


# ---------------------------------------------------------------- smoke


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--wheel", default=None, help="SpecForge wheel (default: the installed specforge)")
    ap.add_argument("--tiny", action="store_true", help="CI shapes: hidden 64, vocab 512, seq 64, ttt 3")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--device", default=None)
    ap.add_argument("--attention", default=None, help="sdpa | flex_attention | fa (default: flex on CUDA)")
    ap.add_argument("--wrapper", default="none", choices=("none", "fsdp"))
    ap.add_argument(
        "--total-steps",
        type=int,
        default=None,
        help="LR schedule horizon (default: 10000; --tiny: --steps, so the 1.5%% warmup is 0 steps)",
    )
    for name, default in (
        ("hidden", 4096),
        ("heads", 32),
        ("kv-heads", 8),
        ("head-dim", 128),
        ("intermediate", 14336),
        ("vocab", 128256),
        ("draft-vocab", 32000),
        ("seq", 2048),
        ("ttt", 7),
    ):
        ap.add_argument(f"--{name}", type=int, default=default)
    a = ap.parse_args(argv)
    shapes = (
        dict(TINY)
        if a.tiny
        else {
            "hidden": a.hidden,
            "heads": a.heads,
            "kv_heads": a.kv_heads,
            "head_dim": a.head_dim,
            "intermediate": a.intermediate,
            "vocab": a.vocab,
            "draft_vocab": a.draft_vocab,
            "target_hidden": a.hidden,
            "seq": a.seq,
            "ttt": a.ttt,
        }
    )
    t0 = time.perf_counter()
    # With SpecForge's 1.5% warmup over a long horizon the first steps have a near-zero LR; the smoke's short
    # horizon lets the loss visibly move.
    total_steps = a.total_steps or (a.steps if a.tiny else 10_000)
    step = build_specforge_step(
        **shapes, device=a.device, attention=a.attention, wrapper=a.wrapper, wheel=a.wheel, total_steps=total_steps
    )
    print(
        f"specforge {step.specforge_version} from {step.specforge_location}; device={step.device} "
        f"backend={step.backend} loss={step.loss_impl} wrapper={step.wrapper}; build {time.perf_counter() - t0:.1f}s"
    )
    for i in range(a.steps):
        t1 = time.perf_counter()
        loss = step()
        print(f"step {i}: loss {loss:.6f}  ({time.perf_counter() - t1:.2f}s)")
    print("specforge modules:", " ".join(specforge_modules()))
    print("heavy packages imported:", heavy_modules_loaded() or "none")


if __name__ == "__main__":
    main()
