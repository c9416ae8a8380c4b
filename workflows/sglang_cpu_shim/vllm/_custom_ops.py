"""`rotary_embedding` in plain torch, with vllm's in-place contract (see ../README.md)."""
import torch


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_size: int, is_neox: bool) -> None:
    heads = x.view(x.shape[0], -1, head_size)  # a view: writing into it updates x
    rot = heads[..., : cos.shape[-1] * 2].float()
    if is_neox:  # pairs (i, i + d/2)
        first, second = rot.chunk(2, dim=-1)
    else:  # pairs (2i, 2i + 1)
        first, second = rot[..., 0::2], rot[..., 1::2]
    new_first, new_second = first * cos - second * sin, second * cos + first * sin
    out = torch.cat((new_first, new_second), -1) if is_neox else torch.stack((new_first, new_second), -1).flatten(-2)
    heads[..., : cos.shape[-1] * 2] = out.to(x.dtype)


def rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox):
    cos, sin = cos_sin_cache.index_select(0, positions.flatten().long()).float().chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads
    for x in (query, key):
        if x is not None:
            _rotate(x, cos, sin, head_size, is_neox)
