"""Read the captured states out of an HF transformers target, by the layer-id convention.

Forward hooks on the decoder layers return each layer's raw output (the residual stream),
so id N-1 is the last layer's output *before* the final norm, exactly what SGLang returns
for it. `final` is HF's last `hidden_states` entry: *after* the final norm, like SGLang's
returned hidden state; the target head then needs only the lm_head (`final_is_normed`).

Batches from per-sample states: `collate_samples` (one sample per row, right padding) and
`pack_samples` (several samples per row, with `position_ids` and `segment_ids`, see eagle3.ttt).
"""

from __future__ import annotations

from dataclasses import dataclass

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

    def __init__(self, model, capture_ids: list[int]):
        layers = decoder_layers(model)
        self.capture_ids = validate_capture_ids(capture_ids, len(layers), "capture_layer_ids")
        self.grabbed: dict[int, torch.Tensor] = {}
        self.handles = [
            (model.get_input_embeddings() if i == EMBEDDING else layers[i]).register_forward_hook(self._keep(i))
            for i in self.capture_ids
        ]

    def _keep(self, layer_id: int):
        def hook(_module, _inputs, output):
            self.grabbed[layer_id] = output[0] if isinstance(output, tuple) else output

        return hook

    def aux(self) -> torch.Tensor:
        """The last call's captured states, [..., n*H] in capture-id order."""
        return torch.cat([self.grabbed[i] for i in self.capture_ids], dim=-1)

    def close(self) -> None:
        for h in self.handles:
            h.remove()

    def __enter__(self) -> "LayerTap":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@torch.no_grad()
def capture_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, capture_ids: list[int]):
    """-> (aux [B, T, n*H] in capture-id order, final [B, T, H] post-norm)."""
    # The decoder alone: its last_hidden_state is the post-norm final state, and the LM head
    # (B x T x vocab logits, a fifth of a 135M model's FLOPs) and every layer's output
    # (output_hidden_states) are never computed or kept.
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    with LayerTap(model, capture_ids) as tap:
        out = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return tap.aux(), out.last_hidden_state


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
    return (
        pad_stack([torch.as_tensor(s, dtype=torch.long) for s in sequences], pad_id),
        pad_stack([torch.as_tensor(m, dtype=torch.long) for m in masks], 0),
        pad_stack([torch.ones(len(s), dtype=torch.bool) for s in sequences], False),
    )


def padded_layout(attention_mask: torch.Tensor) -> dict:
    """position_ids / segment_ids of a padded batch (one sample per row, see eagle3.ttt)."""
    b, t = attention_mask.shape
    positions = torch.arange(t, device=attention_mask.device).expand(b, t).contiguous()
    return {"position_ids": positions, "segment_ids": attention_mask.bool().long() - 1}


# A sample's or batch's per-token states: bf16 `aux`/`final`, or as an int8 store holds them,
# int8 with float32 `aux_scale`/`final_scale` (one per token and captured layer), which batch
# like the states (padding 0: q = 0, scale 0 reads back as the 0.0 a bf16 batch pads with).
STATE_KEYS = ("aux", "final", "aux_scale", "final_scale")


def state_keys(sample: dict) -> list[str]:
    return [k for k in STATE_KEYS if k in sample]


def collate_samples(samples, pad_id: int = 0) -> dict:
    """A training batch from per-sample dicts (input_ids, loss_mask [T], aux, final [T, .],
    and with int8 states their scales), e.g. read from the hidden-state store: states keep
    their dtype. One sample per row."""
    ids, loss, attn = pad_right([s["input_ids"] for s in samples], [s["loss_mask"] for s in samples], pad_id)
    return {
        "input_ids": ids,
        "loss_mask": loss,
        "attention_mask": attn,
        **padded_layout(attn),
        **{k: pad_stack([s[k] for s in samples]) for k in state_keys(samples[0])},
    }


@dataclass
class Packing:
    """What `pack_samples` made: the batches, and which samples went where."""

    batches: list[dict]
    rows: list[list[int]]  # per packed row, the indices of its samples, in order
    truncated: int  # samples cut to max_seq_len (their tail is not trained on)
    tokens: int  # real tokens in all rows
    slots: int  # B x T summed over batches (real tokens + padding)

    @property
    def pad_fraction(self) -> float:
        return 1 - self.tokens / self.slots if self.slots else 0.0


def first_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """Greedy first fit in the given order: each item goes to the first row (oldest first)
    with room, else to a new row. Deterministic; O(n log n) with a max tree over the rows'
    free room, where rows not yet opened count as empty (capacity free)."""
    if any(n > capacity for n in lengths):
        raise ValueError(f"an item is longer than the capacity {capacity}")
    size = 1
    while size < max(1, len(lengths)):
        size *= 2
    free = [capacity] * (2 * size)  # free[size + r]: room left in row r; parents hold maxima
    rows: list[list[int]] = []
    for i, n in enumerate(lengths):
        node = 1
        while node < size:  # descend to the leftmost row with room >= n
            node = 2 * node if free[2 * node] >= n else 2 * node + 1
        r = node - size
        if r == len(rows):
            rows.append([])
        rows[r].append(i)
        free[node] -= n
        node //= 2
        while node:
            free[node] = max(free[2 * node], free[2 * node + 1])
            node //= 2
    return rows


def pack_samples(samples, max_seq_len: int, pad_id: int = 0, rows_per_batch: int = 1) -> Packing:
    """Pack per-sample dicts (as `collate_samples` takes) into rows of at most `max_seq_len`
    tokens, greedy first fit in the given order; `rows_per_batch` rows make a batch, padded
    to its longest row. Each sample keeps its own positions (0..n-1) and a segment id (its
    rank in the row), so attention and the TTT shifts stay inside it (eagle3.ttt). A sample
    longer than max_seq_len is truncated to it and counted in `Packing.truncated`."""
    if max_seq_len < 1 or rows_per_batch < 1:
        raise ValueError(f"max_seq_len={max_seq_len} and rows_per_batch={rows_per_batch} must be >= 1")
    keys = ("input_ids", "loss_mask", *state_keys(samples[0])) if samples else ()
    cut = [{key: s[key][:max_seq_len] for key in keys} for s in samples]
    truncated = sum(len(s["input_ids"]) > max_seq_len for s in samples)
    rows = first_fit([len(s["input_ids"]) for s in cut], max_seq_len)
    batches, tokens, slots = [], 0, 0
    for start in range(0, len(rows), rows_per_batch):
        group = rows[start : start + rows_per_batch]
        packed = []
        for members in group:
            parts = [cut[i] for i in members]
            ids = torch.cat([torch.as_tensor(p["input_ids"], dtype=torch.long) for p in parts])
            packed.append(
                {
                    "input_ids": ids,
                    "loss_mask": torch.cat([torch.as_tensor(p["loss_mask"], dtype=torch.long) for p in parts]),
                    **{k: torch.cat([p[k] for p in parts]) for k in keys[2:]},
                    "position_ids": torch.cat([torch.arange(len(p["input_ids"]), device=ids.device) for p in parts]),
                    "segment_ids": torch.cat(
                        [
                            torch.full((len(p["input_ids"]),), r, dtype=torch.long, device=ids.device)
                            for r, p in enumerate(parts)
                        ]
                    ),
                }
            )
        batch = {
            "input_ids": pad_stack([p["input_ids"] for p in packed], pad_id),
            "loss_mask": pad_stack([p["loss_mask"] for p in packed], 0),
            **{k: pad_stack([p[k] for p in packed]) for k in keys[2:]},
            "position_ids": pad_stack([p["position_ids"] for p in packed], 0),
            "segment_ids": pad_stack([p["segment_ids"] for p in packed], -1),
        }
        batch["attention_mask"] = batch["segment_ids"] >= 0
        tokens += int(batch["attention_mask"].sum())
        slots += batch["attention_mask"].numel()
        batches.append(batch)
    return Packing(batches=batches, rows=rows, truncated=truncated, tokens=tokens, slots=slots)


def capture_batch(model, sequences, masks, capture_ids, pad_id: int = 0, dtype=None, device=None) -> dict:
    """A training batch (see eagle3.training) straight from an HF target ("online" data),
    on `device` (default: the CPU)."""
    ids, loss, attn = (t.to(device) for t in pad_right(sequences, masks, pad_id))
    aux, final = capture_states(model, ids, attn.long(), capture_ids)
    if dtype is not None:
        aux, final = aux.to(dtype), final.to(dtype)
    return {
        "input_ids": ids,
        "loss_mask": loss,
        "attention_mask": attn,
        **padded_layout(attn),
        "aux": aux,
        "final": final,
    }
