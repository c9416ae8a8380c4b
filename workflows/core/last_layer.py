"""The target's last decoder layer and final norm, alone: the final hidden state from the
last layer's input.

Used by the SGLang engine for id N-1 and for `capture.final_state=tail` (the runner mode
gets the final state from SGLang itself). SGLang 0.5.23's Engine returns the captured aux
states *instead of* the final hidden state, and it cannot capture the last layer's output
at all (it captures layer inputs). So a capture that asks it for the ids *and* the input
of the last layer (id N-2) gets everything in one forward; this module then computes

    final = norm(layer_{N-1}(h_{N-2}))        (and id N-1 = layer_{N-1}(h_{N-2}), pre-norm)

with the target's own HF classes and weights, loaded from its checkpoint: one layer and one
norm (1/N of the weights), on the device of the engine's actor. The attention of that layer
is causal over the whole sequence, as in the target's prefill, with no KV cache; sequences
are right-padded into batches, which causal attention makes exact for the real rows.

`TailUnavailable` says why a checkpoint cannot be handled this way (a quantized checkpoint,
names the model's classes do not use); the SGLang engine then refuses `final_state=tail`,
and id N-1 (which only the tail gives), naming the reason.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from workflows.core.engine_spec import micro_batches


class TailUnavailable(RuntimeError):
    """This checkpoint's last layer cannot be run alone here (the reason is the message)."""


def _tensors(folder: Path, names: set[str]) -> dict[str, torch.Tensor]:
    """The named tensors of a safetensors checkpoint (single file or sharded with an index)."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
    elif (folder / "model.safetensors").is_file():
        with safe_open(folder / "model.safetensors", "pt") as f:
            weight_map = {k: "model.safetensors" for k in f.keys()}
    else:
        raise TailUnavailable(f"{folder}: no safetensors checkpoint (model.safetensors or its index)")
    missing = sorted(names - set(weight_map))
    if missing:
        raise TailUnavailable(
            f"{folder}: the checkpoint has no tensor {missing[0]!r} (and {len(missing) - 1} more) of the last layer"
        )
    out: dict[str, torch.Tensor] = {}
    for file in sorted({weight_map[n] for n in names}):
        with safe_open(folder / file, "pt") as f:
            for n in names:
                if weight_map[n] == file:
                    out[n] = f.get_tensor(n)
    return out


class FinalLayerTail:
    """norm(last_layer(h)) for a target checkpoint folder; see the module doc."""

    def __init__(
        self,
        target_path: str | Path,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        trust_remote_code: bool = False,
    ):
        from transformers import AutoConfig, AutoModelForCausalLM

        folder = Path(target_path)
        config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
        if getattr(config, "quantization_config", None) or getattr(
            config.get_text_config(), "quantization_config", None
        ):
            raise TailUnavailable(f"{folder}: a quantized checkpoint (its layers need the quantizer's loader)")
        text = config.get_text_config()
        window = getattr(text, "sliding_window", None) if getattr(text, "use_sliding_window", True) else None
        layer_types = getattr(text, "layer_types", None) or []
        if (
            window
            or (layer_types and layer_types[-1] != "full_attention")
            or getattr(text, "attn_logit_softcapping", None)
        ):
            raise TailUnavailable(
                f"{folder}: the last layer's attention is not plain causal (sliding window or "
                "logit softcapping), which the tail computes"
            )
        self.device, self.dtype = torch.device(device), dtype
        try:
            with torch.device("meta"):  # the architecture without memory; two modules get real weights
                model = AutoModelForCausalLM.from_config(
                    config, trust_remote_code=trust_remote_code, attn_implementation="sdpa"
                )
            decoder = model.get_decoder()
            prefix = next(name for name, module in model.named_modules() if module is decoder)
            self.num_layers = len(decoder.layers)
            layer_prefix = f"{prefix}.layers.{self.num_layers - 1}."
            norm_prefix = f"{prefix}.norm."
            wanted = {n for n in model.state_dict() if n.startswith((layer_prefix, norm_prefix))}
            weights = _tensors(folder, wanted)
            self.layer, self.norm = decoder.layers[-1], decoder.norm
            for module, p in ((self.layer, layer_prefix), (self.norm, norm_prefix)):
                module.load_state_dict(
                    {n[len(p) :]: t for n, t in weights.items() if n.startswith(p)}, strict=True, assign=True
                )
                module.to(self.device, dtype).eval().requires_grad_(False)
            # The rotary table is computed, not stored: build it again on the real device.
            with self.device:
                self.rotary = type(decoder.rotary_emb)(config=decoder.config)
            if any(n.endswith("sinks") for n in wanted):
                raise TailUnavailable(f"{folder}: the last layer has attention sinks, which the tail does not apply")
            self.batch([torch.zeros(2, text.hidden_size)])  # fails here, not on the first capture
        except TailUnavailable:
            raise
        except Exception as exc:  # an architecture whose layer does not run alone like Llama's
            raise TailUnavailable(f"{folder}: cannot run the last layer alone ({type(exc).__name__}: {exc})") from exc

    @torch.no_grad()
    def __call__(self, last_input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, H] input of the last layer -> ([T, H] its output, [T, H] after the final norm),
        float32 on the CPU."""
        out, normed = self.batch([last_input])
        return out[0], normed[0]

    @torch.no_grad()
    def batch(self, inputs: list[torch.Tensor], token_budget: int = 4096) -> tuple[list, list]:
        """`__call__` for many sequences, right-padded into batches of about `token_budget`
        tokens. No mask is needed: SDPA attends causally when given none, and with padding on
        the right a real row only ever sees the real rows before it."""
        outs: list = [None] * len(inputs)
        normed: list = [None] * len(inputs)
        for idx in micro_batches([len(x) for x in inputs], token_budget):
            width = max(len(inputs[i]) for i in idx)
            x = torch.zeros(len(idx), width, inputs[idx[0]].shape[-1], device=self.device, dtype=self.dtype)
            for row, i in enumerate(idx):
                x[row, : len(inputs[i])] = inputs[i].to(self.device, self.dtype)
            positions = torch.arange(width, device=self.device)[None].expand(len(idx), -1)
            out = self.layer(
                x, attention_mask=None, position_ids=positions, position_embeddings=self.rotary(x, positions)
            )
            out = out[0] if isinstance(out, tuple) else out
            norm = self.norm(out)
            for row, i in enumerate(idx):
                n = len(inputs[i])
                outs[i], normed[i] = out[row, :n].float().cpu(), norm[row, :n].float().cpu()
        return outs, normed
