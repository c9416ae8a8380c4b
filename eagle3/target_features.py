"""Read the captured states out of an HF transformers target, by the layer-id convention.

Forward hooks on the decoder layers return each layer's raw output (the residual stream),
so id N-1 is the last layer's output *before* the final norm, exactly what SGLang returns
for it. `final` is HF's last `hidden_states` entry: *after* the final norm, like SGLang's
returned hidden state; the target head then needs only the lm_head (`final_is_normed`).
"""
from __future__ import annotations

import torch

from eagle3.layer_ids import EMBEDDING, validate_capture_ids

FINAL_IS_NORMED = True


def decoder_layers(model) -> torch.nn.ModuleList:
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__} has no .model.layers; not a decoder-only HF model")
    return layers


@torch.no_grad()
def capture_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, layer_ids: list[int]):
    """-> (aux [B, T, n*H] in capture-id order, final [B, T, H] post-norm)."""
    layers = decoder_layers(model)
    validate_capture_ids(layer_ids, len(layers), "capture_layer_ids")
    grabbed: dict[int, torch.Tensor] = {}

    def keep(layer_id):
        def hook(_module, _inputs, output):
            grabbed[layer_id] = output[0] if isinstance(output, tuple) else output
        return hook

    handles = []
    for i in layer_ids:
        module = model.get_input_embeddings() if i == EMBEDDING else layers[i]
        handles.append(module.register_forward_hook(keep(i)))
    try:
        out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    aux = torch.cat([grabbed[i] for i in layer_ids], dim=-1)
    return aux, out.hidden_states[-1]


def pad_right(sequences: list[list[int]], masks: list[list[int]], pad_id: int = 0):
    """Right-pad token lists into (input_ids, loss_mask, attention_mask) tensors."""
    if not sequences:
        raise ValueError("no sequences to pad")
    t = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), t), pad_id, dtype=torch.long)
    loss = torch.zeros(len(sequences), t, dtype=torch.long)
    attn = torch.zeros(len(sequences), t, dtype=torch.bool)
    for i, (s, m) in enumerate(zip(sequences, masks)):
        if len(s) != len(m):
            raise ValueError(f"sequence {i}: {len(s)} tokens but a loss mask of {len(m)}")
        ids[i, : len(s)] = torch.tensor(s)
        loss[i, : len(s)] = torch.tensor(m)
        attn[i, : len(s)] = True
    return ids, loss, attn


def capture_batch(model, sequences, masks, layer_ids, pad_id: int = 0, dtype=None) -> dict:
    """A training batch (see eagle3.training) straight from an HF target ("online" data)."""
    ids, loss, attn = pad_right(sequences, masks, pad_id)
    aux, final = capture_states(model, ids, attn.long(), layer_ids)
    if dtype is not None:
        aux, final = aux.to(dtype), final.to(dtype)
    return {"input_ids": ids, "loss_mask": loss, "attention_mask": attn, "aux": aux, "final": final}
