"""In-place rotary embedding with the call signature SGLang uses on CPU (pure torch)."""
import torch


def rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox):
    """Rotate `query` and `key` ([tokens, heads * head_size], key may be None) in place.

    `cos_sin_cache[p]` holds cat(cos, sin) for position p over the rotated dims. NeoX
    layout pairs dim i with i + rot/2 (Llama/HF); otherwise adjacent dims (2i, 2i+1) pair.
    """
    cos, sin = cos_sin_cache.index_select(0, positions.flatten().long()).float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    rot = 2 * cos.shape[-1]
    for x in (query, key):
        if x is None:
            continue
        heads = x.view(positions.numel(), -1, head_size)
        part = heads[..., :rot].float()
        if is_neox:
            a, b = part[..., : rot // 2], part[..., rot // 2 :]
            rotated = torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)
        else:
            a, b = part[..., 0::2], part[..., 1::2]
            rotated = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
        heads[..., :rot].copy_(rotated.to(x.dtype))
