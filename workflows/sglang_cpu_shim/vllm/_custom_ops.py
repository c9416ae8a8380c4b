"""`rotary_embedding` with vLLM's contract, in pure torch (SGLang's CPU RoPE fallback)."""

import torch


def rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox):
    """Rotate `query` and `key` in place.

    query/key: [tokens, heads * head_size] (key may be None); cos_sin_cache: [max_pos, rot]
    holding cos then sin for the first `rot` dims of each head; is_neox: rotate halves
    (GPT-NeoX / Llama) rather than interleaved pairs (GPT-J).
    """
    cos, sin = cos_sin_cache.index_select(0, positions.flatten().long()).float().chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [tokens, 1, rot/2]: broadcast over heads
    rot = 2 * cos.shape[-1]
    for x in (query, key):
        if x is None:
            continue
        heads = x.view(cos.shape[0], -1, head_size)
        part = heads[..., :rot].float()
        if is_neox:
            a, b = part.chunk(2, dim=-1)
            rotated = torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)
        else:
            a, b = part[..., 0::2], part[..., 1::2]
            rotated = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
        heads[..., :rot].copy_(rotated.to(x.dtype))
