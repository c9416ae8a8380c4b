"""Provenance: what every artefact records about where it came from, in one field list.

* The target's **identity** (`target_identity`): path, architecture facts, tokenizer and
  chat-template hashes, and the hash of its weights files. It is computed once per target
  folder and cached (keyed by the files' sizes and modification times), so no stage
  re-hashes a tokenizer or a checkpoint.
* The **capture contract** (`CAPTURE_CONTRACT`, `capture_contract`): the fields a hidden-
  state store and a config must agree on. The capture stage writes them into the store;
  the train stage opens the store expecting exactly the same fields, so a store captured
  from another target, weights, layers, template, engine, engine dtype or scheme of
  stored states (`state_dtype`: bf16 or int8) is refused by name.
* The **draft's provenance** (`draft_provenance`): what a trained draft carries to export,
  evaluation and the doctor.

Records are plain JSON-ready dicts (no tensors). Secrets never enter them: `redacted`
masks the values of the secret-bearing maps (`capture.storage_options`, `target.env`)
before a config or a section of it is recorded.

Each builder takes the sections it reads (the target, the capture section), not the whole
config; only the draft's provenance records the whole config, by design.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path
from typing import Any, Mapping

from eagle3.layer_ids import CONVENTION
from eagle3.schema import to_dict
from eagle3.target_features import FINAL_IS_NORMED
from storage.states import STORED_AS
from workflows.core.markers import read_json, write_json_atomic
from workflows.core.precision import engine_dtype
from workflows.core.records import VocabSummary

PREPARED = "PREPARED.json"  # written last into a target folder the pipeline built
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
REDACTED = "<redacted>"
# Maps whose values may hold secrets (tokens, keys): the store's storage_options and the
# target engine's env. Masked wherever they sit, in a whole config or in one section.
SECRET_MAPS = ("storage_options", "env")
# The fields a hidden-state store and a config must agree on (see the module doc).
CAPTURE_CONTRACT = (
    "target_path",
    "target_weights_sha256",
    "num_layers",
    "hidden_size",
    "capture_layer_ids",
    "layer_id_convention",
    "state_dtype",
    "final_is_normed",
    "tokenizer_sha256",
    "chat_template_sha256",
    "backend",
    "engine_dtype",
)


# ------------------------------------------------------------------------- target identity


def text_config(config: Mapping) -> Mapping:
    """The language model's config: multimodal wrappers (e.g. Kimi-K2.5) nest it in text_config."""
    nested = config.get("text_config")
    return nested if isinstance(nested, Mapping) and "num_hidden_layers" in nested else config


def is_multimodal_wrapper(config: Mapping) -> bool:
    """A checkpoint whose language model sits inside a multimodal wrapper (kimi_k25): a config
    with a text_config and a vision_config."""
    return "text_config" in config and "vision_config" in config


def read_hf_config(folder: str | Path) -> tuple[dict, Mapping]:
    """(config.json, its language-model part) of a checkpoint folder."""
    config = read_json(Path(folder) / "config.json")
    return config, text_config(config)


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def chat_template_sha256(template: str) -> str:
    """Hash of a chat template string (the same value whether read from disk or a tokenizer)."""
    return hashlib.sha256(template.encode("utf-8")).hexdigest()


def read_chat_template(folder: str | Path) -> str | None:
    """The chat template saved with a checkpoint, wherever this transformers version put it."""
    folder = Path(folder)
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    for name in ("chat_template.json", "tokenizer_config.json"):
        file = folder / name
        if file.is_file():
            template = read_json(file).get("chat_template")
            if isinstance(template, str):
                return template
            if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
                named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
                if isinstance(named.get("default"), str):
                    return named["default"]
                return json.dumps(template, sort_keys=True)
    return None


def tokenizer_sha256(folder: str | Path) -> str | None:
    """sha256 of tokenizer.json, or of the tokenizer files present (name + bytes) without one."""
    folder = Path(folder)
    if (folder / "tokenizer.json").is_file():
        return sha256_file(folder / "tokenizer.json")
    names = (
        "tokenizer.model",
        "tiktoken.model",
        "vocab.json",
        "merges.txt",
        "vocab.txt",
        "added_tokens.json",
        "special_tokens_map.json",
        "tokenizer_config.json",
    )
    present = [folder / n for n in names if (folder / n).is_file()]
    if not present:
        return None
    digest = hashlib.sha256()
    for file in present:
        digest.update(file.name.encode() + b"\0")
        digest.update(file.read_bytes())
    return digest.hexdigest()


def read_prepared(folder: str | Path) -> dict | None:
    """The PREPARED.json of a target folder the pipeline built, None when missing or unreadable."""
    try:
        return json.loads((Path(folder) / PREPARED).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def weights_sha256(folder: Path) -> str | None:
    """One hash over every weights file of the folder (names and contents, sorted by name)."""
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
    if not files:
        return None
    size = sum(p.stat().st_size for p in files)
    if size > 1 << 30:  # minutes for a large checkpoint, once: say so
        print(
            f"[target] hashing {size / 1e9:.1f} GB of weights in {folder} once (cached by file size and mtime)",
            flush=True,
        )
    digest = hashlib.sha256()
    for file in files:
        digest.update(f"{file.name}\0{sha256_file(file)}\n".encode())
    return digest.hexdigest()


def _signature(folder: Path) -> list:
    """What invalidates a cached identity: every file's name, size and modification time."""
    return sorted([p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in folder.iterdir() if p.is_file())


def target_identity(path: str | Path, cache_dir: str | Path) -> dict:
    """What identifies a target for the artefacts built from it (no model load).

    Cached in `<cache_dir>/identities/` per folder, so the weights of a large checkpoint are
    hashed once, not by every stage: a changed file (size or mtime) recomputes it."""
    folder = Path(path).expanduser().resolve()
    cache = Path(cache_dir) / "identities" / f"{hashlib.sha256(str(folder).encode()).hexdigest()[:16]}.json"
    signature = _signature(folder)
    if cache.is_file():
        try:
            cached = json.loads(cache.read_text())
            if cached.get("signature") == signature:
                return cached["identity"]
        except (OSError, ValueError, KeyError):
            pass  # unreadable cache: recompute below
    _, text = read_hf_config(folder)
    config = read_json(folder / "config.json")
    template = read_chat_template(folder)
    prepared = read_prepared(folder)
    identity: dict[str, Any] = {
        "path": str(folder),
        "model_type": text.get("model_type", config.get("model_type")),
        "num_layers": text.get("num_hidden_layers"),
        "hidden_size": text.get("hidden_size"),
        "vocab_size": text.get("vocab_size"),
        "tokenizer_sha256": tokenizer_sha256(folder),
        "chat_template_sha256": None if template is None else chat_template_sha256(template),
        # A folder the pipeline built recorded its weights' hash when it wrote them.
        "weights_sha256": (prepared or {}).get("weights_sha256") or weights_sha256(folder),
    }
    if prepared is not None:
        identity["prepared"] = {
            k: prepared.get(k)
            for k in (
                "source",
                "spec_name",
                "source_file",
                "source_sha256",
                "dtype",
                "transformers_version",
                "torch_version",
                "builder_version",
                "prepared_at",
            )
        }
    write_json_atomic(cache, {"signature": signature, "identity": identity})
    return identity


def capture_contract(target, capture, identity: Mapping, capture_ids: list[int]) -> dict:
    """The fields (CAPTURE_CONTRACT) a store of `capture_ids` captured by `capture` from
    `target` holds (the union of the drafters' layers: FullConfig.store_capture_ids)."""
    contract = {
        "target_path": identity["path"],
        "target_weights_sha256": identity["weights_sha256"],
        "num_layers": target.num_layers,
        "hidden_size": target.hidden_size,
        "capture_layer_ids": list(capture_ids),
        "layer_id_convention": CONVENTION,
        "state_dtype": capture.state_dtype,
        "final_is_normed": FINAL_IS_NORMED,
        "tokenizer_sha256": identity["tokenizer_sha256"],
        "chat_template_sha256": identity["chat_template_sha256"],
        "backend": capture.backend,
        "engine_dtype": engine_dtype(capture),
    }
    assert tuple(contract) == CAPTURE_CONTRACT
    return contract


def store_provenance(
    target, capture, identity: Mapping, plan: Mapping, backend_version: str, capture_ids: list[int]
) -> dict:
    """The contract plus what is recorded only (versions, the capture section, the shard plan)."""
    return {
        **capture_contract(target, capture, identity, capture_ids),
        "target_name": target.name,
        "target": {k: identity.get(k) for k in ("model_type", "vocab_size")},
        "stored_as": STORED_AS[capture.state_dtype],
        "backend_version": backend_version,
        "code_version": code_version(),
        "config": redacted(capture),
        "plan": dict(plan),
    }


def engine_captured_mismatch(prov: Mapping, where: str) -> str | None:
    """The one line refusing a store whose capture engines reported capturing other layers
    than its provenance names (`engine_captured_layer_ids`, recorded by the capture stage);
    None when they agree or nothing was reported."""
    reported, named = prov.get("engine_captured_layer_ids"), prov.get("capture_layer_ids")
    if reported is None or list(reported) == list(named or []):
        return None
    return (
        f"{where}: its provenance names capture ids {list(named or [])} but its {prov.get('backend')} capture "
        f"engine reported capturing ids {list(reported)}: the stored states are of other layers; recapture"
    )


def draft_provenance(cfg, identity: Mapping, vocab_summary: VocabSummary) -> dict:
    """What every draft artefact (checkpoint, trained draft, exports) carries: the whole run
    config among it, so that a draft says how it was made."""
    return {
        "target": dict(identity),
        "target_name": cfg.target.name,
        "draft_family": cfg.draft.family,
        "capture_layer_ids": cfg.draft_capture_ids,
        "layer_id_convention": CONVENTION,
        "final_is_normed": FINAL_IS_NORMED,
        "hidden_size": cfg.target.hidden_size,
        "vocab": vocab_summary.as_dict(),
        "code_version": code_version(),
        "config": redacted(cfg),
    }


def redacted(config) -> dict:
    """A config (or one section) as a JSON-ready dict, the values of its secret-bearing maps
    (SECRET_MAPS) masked."""

    def mask(node):
        if isinstance(node, dict):
            return {
                k: {n: REDACTED for n in v} if k in SECRET_MAPS and isinstance(v, dict) else mask(v)
                for k, v in node.items()
            }
        if isinstance(node, list):
            return [mask(v) for v in node]
        return node

    return mask(json.loads(json.dumps(to_dict(config), default=str)))


def code_version() -> str:
    """The package version plus the git commit when run from a checkout."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = version("eagle3-pipeline")
    except PackageNotFoundError:
        v = "unknown"
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent,
            env={**os.environ, "GIT_TERMINAL_PROMPT": "0"},
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        sha = ""
    return f"{v}+{sha}" if sha else v
