"""SpecForge 0.2.0's offline DFlash training step, built from SpecForge's own classes, for side-by-side timing.

    python -m bench.specforge_dflash_step --wheel /tmp/wheels/specforge-0.2.0-py3-none-any.whl --tiny

What one ``step()`` does is exactly one ``TrainerCore.train_step`` of SpecForge's trainer with its DFlash strategy,
fed with a batch shaped the way SpecForge's OFFLINE DFlash reader hands it over. Nothing of SpecForge's maths is
re-implemented here; this file only builds the objects (random weights, random features) and calls them. It is the
DFlash sibling of bench.specforge_step (the EAGLE-3 step), whose wheel loading, process group, optimizer and
attention helpers it reuses. The pieces, as laid out in the wheel:

* ``specforge/algorithms/dflash/providers.py`` is SpecForge's DFlash registration. Its offline data provider
  (``capture_method="dflash"``, feature ``hidden_states``, no last hidden state, ``target_repr`` None) reads stored
  features ``input_ids`` [seq], ``loss_mask`` [seq] and ``hidden_states`` [seq, k * hidden] (the k captured target
  layers concatenated on the last dim), normalizes each sample with ``normalize_offline_sample`` and collates with
  ``build_collator`` (both in ``specforge/algorithms/common/dflash_family_data.py``, built here through
  ``build_offline_normalizer`` / ``build_collator``, as the ``FeatureDataLoader`` does). So SpecForge's DFlash DOES
  train offline from stored target states: that is the path built here (no live target, no SGLang).
* ``specforge/modeling/draft/dflash.py`` ``DFlashDraftModel`` (resolved by ``specforge/modeling/auto.py``
  ``AutoDraftModel.from_config`` from a Qwen3 draft config JSON read by ``AutoDraftModelConfig.from_file``, as
  ``build_dflash_draft`` in ``specforge/algorithms/model_providers.py`` does: ``_attn_implementation`` set to the
  attention backend, weights cast to the run dtype): ``num_layers`` Qwen3-style decoder layers whose keys/values are
  the fused context (``fc`` over the k target layers, then ``hidden_norm``) followed by the block's own tokens.
  The k target layer ids go in ``dflash_config.target_layer_ids``, chosen by SpecForge's ``build_target_layer_ids``
  over a ``target_depth``-layer target (36: Qwen3-8B); they only name what the capture stored, the step's work
  depends on k alone. Its RMSNorm/MLP come from ``specforge/modeling/draft/dflash_kernels.py``: SpecForge's default
  (HF Qwen3RMSNorm/Qwen3MLP) unless ``liger=True`` (``load_liger_dflash_kernels``, ``model.use_liger_kernel``,
  needs the ``specforge[liger]`` extra).
* ``specforge/algorithms/common/dflash_family_model.py`` ``OnlineDFlashModel`` is SpecForge's one DFlash wrapper for
  both online and offline training (there is no separate offline class): it samples up to ``num_anchors`` anchors
  per sequence among positions whose token and next token are supervised, embeds each block (anchor token then
  ``block_size - 1`` mask tokens) with the target's embedding, builds the block mask (a flex ``BlockMask`` per step
  for flex_attention, a dense boolean mask for sdpa/eager), runs the draft over all blocks at once, and computes
  the loss in ``objective_chunk_blocks`` blocks at a time under activation checkpointing (``checkpointed_chunk_reduce``
  in ``specforge/core/chunking.py``): logits = the TARGET's lm_head over the draft's hidden states, plain
  ``F.cross_entropy`` on the real next tokens, the anchor slot excluded, weighted by ``exp(-(k-1)/gamma)`` when
  ``loss_decay_gamma`` is set. The wrapper is built as ``_build_dflash_family_model`` (same file as
  ``build_dflash_draft``) builds it: mask token resolved by ``resolve_mask_token_id``
  (``specforge/training/model_utils.py``) and written into the draft and its ``dflash_config``, the whole wrapper
  cast to the run dtype.
* ``specforge/modeling/target/target_utils.py`` ``TargetEmbeddingsAndHead``: the target's token embedding and
  lm_head, frozen, in the run dtype (what ``TargetEmbeddingsAndHead.from_pretrained`` leaves, with random weights
  instead of the target's). SpecForge's DFlash has NO draft vocabulary and no lm_head of its own: it shares the
  target's full-vocabulary lm_head (``vocab`` rows, 151936 for Qwen3-8B), so ``draft_vocab`` is accepted for the
  caller's sake and not used. Our draft keeps its own head over ``draft_vocab`` tokens; a comparison of the two
  steps must say so (SpecForge's head matmuls are ``vocab / draft_vocab`` times ours).
* ``specforge/training/strategies/base.py`` ``DFlashTrainStrategy`` (built through ``build_step`` in
  ``specforge/algorithms/dflash/providers.py``): passes ``input_ids``, ``hidden_states`` and ``loss_mask`` to the
  wrapper and returns the loss with its ``loss_terms`` (numerator, token count).
* ``specforge/training/backend.py`` ``FSDPTrainingBackend`` + ``specforge/optimizer.py`` ``BF16Optimizer`` over the
  draft's parameters: ``backward`` of the loss numerator, ``TrainerCore`` divides the gradients by the supervised
  token count, then the optimizer step (global grad norm, clip 0.5, AdamW lr 1e-4 on fp32 master copies,
  cosine-with-warmup LR, copy back to the bf16 weights). Defaults from ``TrainingConfig``
  (``specforge/config/schema.py``): ``num_anchors`` 512, ``objective_chunk_blocks`` 128, ``loss_type`` "dflash".
  ``loss_decay_gamma`` defaults to None there (no decay); here it defaults to 7.0, the DFlash recipe's gamma for
  blocks of 16 and what our side trains with.
* ``specforge/training/controller.py`` ``TrainerCore.train_step`` chains forward/loss -> backward -> gradient
  normalization -> step and reduces the metrics (``.item()`` host syncs, as in SpecForge's loop).

SpecForge's real single-GPU run additionally wraps the wrapper in FSDP (``SHARD_GRAD_OP``, one rank, one unit per
decoder layer, the frozen target embedding/lm_head left out) after ``init_distributed``; ``wrapper="fsdp"``
reproduces that, ``wrapper="none"`` (the default) calls the same backend with ``wrap=False``. Not timed: data
loading, the ``TrainerController`` logging/checkpointing around ``train_step``.

On the CPU (the CI dry run) ``step.backend`` is ``sdpa`` (SpecForge's DFlash also supports sdpa and eager; its
default flex_attention has no CPU backward in torch). The loss has no Triton kernel to stand in for: ``loss_impl`` is
``"cross_entropy"`` on every device. ``step.kernels`` is ``"qwen3"`` (SpecForge's default) or ``"liger"``.

Loading goes through bench.specforge_step's ``load_specforge``, which also imports the EAGLE-3 step's modules; this
step does not call them. ``step.specforge_modules`` lists every SpecForge module imported, ``step.dflash_modules``
the DFlash ones this step calls. None of them imports sglang, ray, deepspeed, datasets, pydantic or yunchang.
"""

from __future__ import annotations

import argparse
import importlib
import json
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch

from bench.specforge_step import (
    TINY as EAGLE3_TINY,
)
from bench.specforge_step import (
    _check_device_support,
    _ensure_process_group,
    _optimizer_factory,
    _resolve_attention,
    heavy_modules_loaded,
    load_specforge,
    specforge_modules,
)

# The DFlash modules the step calls into, in import order (after load_specforge's shared trainer modules).
DFLASH_MODULES = (
    "specforge.modeling.draft.dflash",
    "specforge.modeling.draft.dflash_kernels",
    "specforge.modeling.target.target_utils",
    "specforge.algorithms.common.dflash_family_model",
    "specforge.algorithms.common.dflash_family_data",
    "specforge.algorithms.dflash.providers",
    "specforge.training.model_utils",
)
DRAFT_ARCH = "DFlashDraftModel"
QWEN3_8B_DEPTH = 36  # the target's layer count the capture layer ids are spread over
TINY = {
    **{k: v for k, v in EAGLE3_TINY.items() if k != "ttt"},
    "num_layers": 2,
    "num_target_layers": 3,
    "block_size": 4,
    "num_anchors": 8,
}


def load_specforge_dflash(wheel: str | None = None) -> types.SimpleNamespace:
    """load_specforge's namespace (trainer, backend, optimizer, process group), plus SpecForge's DFlash pieces."""
    sf = load_specforge(wheel)
    mods = {name: importlib.import_module(name) for name in DFLASH_MODULES}
    dflash = mods["specforge.modeling.draft.dflash"]
    family_data = mods["specforge.algorithms.common.dflash_family_data"]
    return types.SimpleNamespace(
        **vars(sf),
        build_target_layer_ids=dflash.build_target_layer_ids,
        DEFAULT_DFLASH_KERNELS=mods["specforge.modeling.draft.dflash_kernels"].DEFAULT_DFLASH_KERNELS,
        load_liger_dflash_kernels=mods["specforge.modeling.draft.dflash_kernels"].load_liger_dflash_kernels,
        TargetEmbeddingsAndHead=mods["specforge.modeling.target.target_utils"].TargetEmbeddingsAndHead,
        OnlineDFlashModel=mods["specforge.algorithms.common.dflash_family_model"].OnlineDFlashModel,
        build_offline_normalizer=family_data.build_offline_normalizer,
        build_collator=family_data.build_collator,
        build_dflash_step=mods["specforge.algorithms.dflash.providers"].build_step,
        resolve_mask_token_id=mods["specforge.training.model_utils"].resolve_mask_token_id,
    )


# ---------------------------------------------------------------- draft, target parts, batch


def _write_draft_config(
    workdir: Path,
    *,
    hidden,
    heads,
    kv_heads,
    head_dim,
    intermediate,
    vocab,
    num_layers,
    block_size,
    target_depth,
    target_layer_ids,
    seq,
) -> Path:
    """A Qwen3 draft config JSON as SpecForge's DFlash auto-generation writes it (populate_dflash_generated_config)."""
    draft = {
        "architectures": [DRAFT_ARCH],
        "model_type": "qwen3",
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate,
        "num_hidden_layers": num_layers,
        "vocab_size": vocab,
        "max_position_embeddings": max(40960, seq + block_size),
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "num_target_layers": target_depth,
        "block_size": block_size,
        "layer_types": ["full_attention"] * num_layers,
        "sliding_window": None,
        "use_sliding_window": False,
        "dflash_config": {"target_layer_ids": list(target_layer_ids)},
    }
    path = workdir / "draft_config.json"
    path.write_text(json.dumps(draft))
    return path


def _build_draft(sf, draft_file: Path, attention: str, dtype, device, kernels):
    """build_dflash_draft, minus checkpoint loading: random init (on the device), run dtype."""
    config = sf.AutoDraftModelConfig.from_file(str(draft_file))
    config._attn_implementation = attention
    with torch.device(device):
        draft = sf.AutoDraftModel.from_config(config, torch_dtype=dtype, dflash_kernels=kernels)
    return draft.to(device=device, dtype=dtype)


def _build_target_parts(sf, *, vocab: int, target_hidden: int, dtype, device):
    """TargetEmbeddingsAndHead as from_pretrained leaves it (run dtype, eval, frozen), with random weights."""
    from transformers import Qwen3Config

    config = Qwen3Config(vocab_size=vocab, hidden_size=target_hidden)
    with torch.device(device):
        parts = sf.TargetEmbeddingsAndHead(config)
    parts.to(device=device, dtype=dtype)
    parts.eval()
    parts.requires_grad_(False)
    return parts


def _build_model(
    sf, draft, parts, *, mask_token_id, vocab, attention, num_anchors, loss_decay_gamma, objective_chunk_blocks
):
    """_build_dflash_family_model + build_dflash_model's OnlineDFlashModel (loss_type "dflash"), given the parts."""
    mask_token_id = sf.resolve_mask_token_id(
        explicit=mask_token_id, tokenizer=None, embedding_vocab_size=vocab, draft_model=draft
    )
    draft.mask_token_id = mask_token_id
    method_config = draft.config.dflash_config
    method_config["mask_token_id"] = mask_token_id
    method_config["target_layer_ids"] = list(draft.target_layer_ids)
    return sf.OnlineDFlashModel(
        draft_model=draft,
        target_lm_head=parts.lm_head,
        target_embed_tokens=parts.embed_tokens,
        mask_token_id=mask_token_id,
        block_size=int(draft.block_size),
        attention_backend=attention,
        num_anchors=num_anchors,
        loss_decay_gamma=loss_decay_gamma,
        objective_chunk_blocks=objective_chunk_blocks,
        loss_type="dflash",
    )


def _raw_sample(*, vocab, width, seq, dtype, gen) -> dict[str, torch.Tensor]:
    """One random sample as SpecForge's offline DFlash capture stores it (a feature file's tensors)."""
    return {
        "input_ids": torch.randint(0, vocab, (seq,), generator=gen),
        "loss_mask": torch.ones(seq, dtype=torch.long),
        # hidden_states: the k captured target layers concatenated on the last dim, as the capture stores them
        "hidden_states": torch.randn(seq, width, generator=gen).to(dtype),
    }


def _batch_from_raw(sf, raw: dict[str, torch.Tensor], *, seq, device):
    """What SpecForge's offline DFlash loader hands the trainer: its per-sample normalizer, collator, TrainBatch."""
    normalize = sf.build_offline_normalizer(seq)
    tensors = sf.build_collator()([normalize(raw)])
    # Already on the device, so the strategy's .to(device) calls are no-ops and no H2D copy is timed.
    tensors = {k: v.to(device) for k, v in tensors.items()}
    return sf.TrainBatch(sample_ids=["bench-0"], strategy="dflash", tensors=tensors, metadata={"target_repr": None})


# ---------------------------------------------------------------- the step


def build_specforge_dflash_step(
    *,
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    intermediate: int,
    vocab: int,
    draft_vocab: int | None = None,
    target_hidden: int | None = None,
    num_layers: int,
    num_target_layers: int,
    block_size: int,
    num_anchors: int,
    seq: int,
    device: torch.device | str | None = None,
    dtype: str | torch.dtype = "bfloat16",
    attention: str | None = None,
    loss_decay_gamma: float | None = 7.0,
    objective_chunk_blocks: int = 128,
    mask_token_id: int | None = None,
    target_depth: int = QWEN3_8B_DEPTH,
    liger: bool = False,
    seed: int = 0,
    wrapper: str = "none",
    wheel: str | None = None,
    total_steps: int = 10_000,
) -> Callable[[], float]:
    """Build SpecForge's offline DFlash training step at these shapes (batch 1); returns ``step() -> loss``.

    ``num_layers`` draft layers read ``num_target_layers`` (k) captured target layers; blocks of ``block_size``
    tokens, at most ``num_anchors`` a sequence. ``draft_vocab`` is not used: SpecForge's DFlash computes its logits
    with the target's frozen lm_head over all ``vocab`` tokens. SpecForge's draft has the target's width, so
    ``target_hidden`` must equal ``hidden``. ``mask_token_id`` defaults to ``vocab - 1`` (as our side's).
    ``attention=None`` means flex_attention on CUDA, sdpa on the CPU. Attributes on the returned function:
    ``backend``, ``loss_impl``, ``kernels``, ``wrapper``, ``device``, ``head`` and ``head_vocab`` (the shared target
    lm_head), ``target_layer_ids``, ``mask_token_id``, ``loss_decay_gamma``, ``specforge_version``,
    ``specforge_location``, ``specforge_modules``, ``dflash_modules``, ``model`` (the OnlineDFlashModel), ``batch``
    (SpecForge's TrainBatch), ``last_result`` (SpecForge's StepResult).
    """
    del draft_vocab  # SpecForge's DFlash shares the target's lm_head: no draft vocabulary
    device = (
        torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    )
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # SpecForge allocates some tensors on the "current" device
    if target_hidden is not None and target_hidden != hidden:
        raise ValueError(
            f"SpecForge's DFlash draft has the target's width (fc reads k * hidden, the target's embedding and lm_head "
            f"act on the draft's states): target_hidden {target_hidden} != hidden {hidden}"
        )
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    attention = _resolve_attention(attention, device)
    _check_device_support(device, attention, wrapper)
    sf = load_specforge_dflash(wheel)
    kernels = sf.load_liger_dflash_kernels() if liger else sf.DEFAULT_DFLASH_KERNELS
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)

    target_layer_ids = sf.build_target_layer_ids(target_depth, num_target_layers)
    workdir = Path(tempfile.mkdtemp(prefix="specforge-dflash-step-"))
    draft_file = _write_draft_config(
        workdir,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate=intermediate,
        vocab=vocab,
        num_layers=num_layers,
        block_size=block_size,
        target_depth=target_depth,
        target_layer_ids=target_layer_ids,
        seq=seq,
    )
    draft = _build_draft(sf, draft_file, attention, torch_dtype, device, kernels)
    parts = _build_target_parts(sf, vocab=vocab, target_hidden=hidden, dtype=torch_dtype, device=device)
    model = _build_model(
        sf,
        draft,
        parts,
        mask_token_id=vocab - 1 if mask_token_id is None else mask_token_id,
        vocab=vocab,
        attention=attention,
        num_anchors=num_anchors,
        loss_decay_gamma=loss_decay_gamma,
        objective_chunk_blocks=objective_chunk_blocks,
    ).to(device=device, dtype=torch_dtype)

    if wrapper == "fsdp":
        _ensure_process_group(sf)
    backend = sf.FSDPTrainingBackend(
        sf.ParallelConfig.from_distributed(), optimizer_factory=_optimizer_factory(sf, total_steps)
    )
    wrapped = backend.prepare_model(model, wrap=wrapper == "fsdp", optimizer_target=model.draft_model)
    strategy = sf.build_dflash_step(wrapped)
    core = sf.TrainerCore(strategy, backend, accumulation_steps=1)
    raw = _raw_sample(vocab=vocab, width=len(draft.target_layer_ids) * hidden, seq=seq, dtype=torch_dtype, gen=gen)
    batch = _batch_from_raw(sf, raw, seq=seq, device=device)

    def step() -> float:
        result = core.train_step(batch)
        step.last_result = result
        return float(result.loss)

    step.backend = attention
    step.loss_impl = "cross_entropy"
    step.kernels = "liger" if liger else "qwen3"
    step.wrapper = wrapper
    step.device = str(device)
    step.head = "target"
    step.head_vocab = vocab
    step.target_layer_ids = list(draft.target_layer_ids)
    step.mask_token_id = model.mask_token_id
    step.loss_decay_gamma = loss_decay_gamma
    step.specforge_version = sf.version
    step.specforge_location = sf.location
    step.specforge_modules = specforge_modules()
    step.dflash_modules = list(DFLASH_MODULES)
    step.model = model
    step.batch = batch
    step.last_result = None
    return step


# ---------------------------------------------------------------- smoke


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--wheel", default=None, help="SpecForge wheel (default: the installed specforge)")
    ap.add_argument(
        "--tiny", action="store_true", help="CI shapes: hidden 64, vocab 512, 2 layers, blocks of 4, seq 64"
    )
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--device", default=None)
    ap.add_argument("--attention", default=None, help="sdpa | eager | flex_attention (default: flex on CUDA)")
    ap.add_argument("--wrapper", default="none", choices=("none", "fsdp"))
    ap.add_argument("--liger", action="store_true", help="SpecForge's Liger RMSNorm/SwiGLU kernels (specforge[liger])")
    ap.add_argument(
        "--total-steps", type=int, default=None, help="LR schedule horizon (default: 10000; --tiny: --steps)"
    )
    # DFlash's recipe for Qwen3-8B
    defaults = {"hidden": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128, "intermediate": 12288, "vocab": 151936}
    defaults |= {"draft_vocab": 32000, "num_layers": 5, "num_target_layers": 5, "block_size": 16}
    defaults |= {"num_anchors": 512, "seq": 2048}
    for name, default in defaults.items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    a = ap.parse_args(argv)
    shapes = dict(TINY) if a.tiny else {name: getattr(a, name) for name in defaults}
    t0 = time.perf_counter()
    # With SpecForge's 1.5% warmup over a long horizon the first steps have a near-zero LR; the smoke's short
    # horizon lets the loss visibly move.
    total_steps = a.total_steps or (a.steps if a.tiny else 10_000)
    step = build_specforge_dflash_step(
        **shapes,
        device=a.device,
        attention=a.attention,
        wrapper=a.wrapper,
        liger=a.liger,
        wheel=a.wheel,
        total_steps=total_steps,
    )
    print(
        f"specforge {step.specforge_version} from {step.specforge_location}; device={step.device} "
        f"backend={step.backend} loss={step.loss_impl} kernels={step.kernels} wrapper={step.wrapper} "
        f"head={step.head} (vocab {step.head_vocab}) target_layer_ids={step.target_layer_ids}; "
        f"build {time.perf_counter() - t0:.1f}s"
    )
    for i in range(a.steps):
        t1 = time.perf_counter()
        loss = step()
        print(f"step {i}: loss {loss:.6f}  ({time.perf_counter() - t1:.2f}s)")
    print("specforge modules:", " ".join(specforge_modules()))
    print("heavy packages imported:", heavy_modules_loaded() or "none")


if __name__ == "__main__":
    main()
