"""MLA attention (DeepSeek-V2/V3, Kimi-K2/K2.5) with SGLang 0.5.23's torch_native backend.

SGLang's DeepSeek attention picks one of its forward methods per batch through a registry
of handlers keyed by attention backend (`AttentionBackendRegistry` in
`models/deepseek_common/attention_backend_handler.py`). torch_native has no entry, so it
gets the triton handler, which sends a prefill without a cached prefix down the MHA path:
keys and values decompressed from the latent, written and read as if the KV pool held
them. The pool of an MLA model holds the compressed latent (kv_lora_rank + rope dims, one
head), and torch_native's extend reads its keys and values back from the pool: every
token's attention reads the wrong numbers from the first layer on, without an error.
Decode and verify already take the absorbed-MLA path (queries in latent space, the latent
as keys, its first kv_lora_rank columns as values), which reads that pool as it is.

The stand-in registers torch_native with the absorbed path for every batch: SGLang's own
choice among its MLA methods (`_dispatch_mla_subtype`), never the MHA ones. Measured on
the tiny_kimi target: SGLang's greedy tokens equal HF's and its captured states equal
HF's within float32 rounding (tests/test_sglang_mla.py), where without it they differ from
the first generated token on.

`install()` (called by ../sitecustomize.py for every process with the shim on its path:
CPU SGLang only) patches the module right after it loads. Standard library only here.
"""

from __future__ import annotations

MODULE = "sglang.srt.models.deepseek_common.attention_backend_handler"
BACKEND = "torch_native"


def patch_attention_backend_handler(module) -> None:
    registry = module.AttentionBackendRegistry
    if BACKEND in registry._handlers:
        return  # an SGLang that knows torch_native for MLA itself: its own choice stands

    def handle_attention_torch_native(attn, forward_batch):
        # Whatever the batch (prefill with or without a prefix, decode, verify, draft
        # extend): the methods that read the latent pool as the latent it is.
        return module._dispatch_mla_subtype(attn, forward_batch)

    registry.register(BACKEND, handle_attention_torch_native)


def install() -> None:
    from workflows.core.import_hooks import patch_on_import  # the project is on these processes' path

    patch_on_import({MODULE: patch_attention_backend_handler})
