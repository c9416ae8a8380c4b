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


class LayerTap:
    """Forward hooks keeping the raw output of each captured layer during a model call.

    Used for one call (`with LayerTap(...)`, as `capture_states` does) or for the life of
    a decoder (the reference speculative decoder's target)."""

    def __init__(self, model, layer_ids: list[int]):
        layers = decoder_layers(model)
        self.layer_ids = validate_capture_ids(layer_ids, len(layers), "capture_layer_ids")
        self.grabbed: dict[int, torch.Tensor] = {}
        self.handles = [
            (model.get_input_embeddings() if i == EMBEDDING else layers[i]).register_forward_hook(self._keep(i))
            for i in self.layer_ids
        ]

    def _keep(self, layer_id: int):
        def hook(_module, _inputs, output):
            self.grabbed[layer_id] = output[0] if isinstance(output, tuple) else output
        return hook

    def aux(self) -> torch.Tensor:
        """The last call's captured states, [..., n*H] in capture-id order."""
        return torch.cat([self.grabbed[i] for i in self.layer_ids], dim=-1)

    def close(self) -> None:
        for h in self.handles:
            h.remove()

    def __enter__(self) -> "LayerTap":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@torch.no_grad()
def capture_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, layer_ids: list[int]):
    """-> (aux [B, T, n*H] in capture-id order, final [B, T, H] post-norm)."""
    with LayerTap(model, layer_ids) as tap:
        out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
        return tap.aux(), out.hidden_states[-1]


def pad_stack(rows, fill=0) -> torch.Tensor:
    """Tensors of shape [T_i, ...] right-padded with `fill` to the longest and stacked [B, T, ...]."""
    if not rows:
        raise ValueError("nothing to pad")
    t = max(len(r) for r in rows)
    out = torch.full((len(rows), t, *rows[0].shape[1:]), fill, dtype=rows[0].dtype, device=rows[0].device)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def pad_right(sequences: list[list[int]], masks: list[list[int]], pad_id: int = 0):
    """Right-pad token lists into (input_ids, loss_mask, attention_mask) tensors."""
    for i, (s, m) in enumerate(zip(sequences, masks)):
        if len(s) != len(m):
            raise ValueError(f"sequence {i}: {len(s)} tokens but a loss mask of {len(m)}")
    return (pad_stack([torch.as_tensor(s, dtype=torch.long) for s in sequences], pad_id),
            pad_stack([torch.as_tensor(m, dtype=torch.long) for m in masks], 0),
            pad_stack([torch.ones(len(s), dtype=torch.bool) for s in sequences], False))


def collate_samples(samples, pad_id: int = 0) -> dict:
    """A training batch from per-sample dicts (input_ids, loss_mask [T], aux, final [T, .]),
    e.g. read from the hidden-state store: states keep their dtype."""
    ids, loss, attn = pad_right([s["input_ids"] for s in samples], [s["loss_mask"] for s in samples], pad_id)
    return {"input_ids": ids, "loss_mask": loss, "attention_mask": attn,
            "aux": pad_stack([s["aux"] for s in samples]), "final": pad_stack([s["final"] for s in samples])}


def capture_batch(model, sequences, masks, layer_ids, pad_id: int = 0, dtype=None, device=None) -> dict:
    """A training batch (see eagle3.training) straight from an HF target ("online" data),
    on `device` (default: the CPU)."""
    ids, loss, attn = (t.to(device) for t in pad_right(sequences, masks, pad_id))
    aux, final = capture_states(model, ids, attn.long(), layer_ids)
    if dtype is not None:
        aux, final = aux.to(dtype), final.to(dtype)
    return {"input_ids": ids, "loss_mask": loss, "attention_mask": attn, "aux": aux, "final": final}
