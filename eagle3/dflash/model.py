"""The DFlash block draft, written to read like the paper and to load in vLLM as is.

    ctx   = hidden_norm(fc(cat(target states of the captured layers)))     # [T, H], one per verified row
    block = [anchor, mask, ..., mask]  at positions a, a+1, .., a+S-1     # the anchor is a real token
    h     = embed(block)               (mask slots: the draft's own mask embedding)
    per layer l:
        K, V = [k_norm(k_proj(ctx)) | k_norm(k_proj(n(h)))], [v_proj(ctx) | v_proj(n(h))]   (RoPE on K)
        h    = h + o_proj(attention(q_norm(q_proj(n(h))), K, V))    # n = input_layernorm
        h    = h + mlp(post_attention_layernorm(h))
    p(slot i) = softmax(lm_head(norm(h_i)))  for the mask slots i = 1..S-1: the block's guesses

The context is injected into the keys and values of every layer (each layer projects it
with its own k_proj / v_proj); a block sees the context rows strictly before its anchor
and every slot of its own block (full, non-causal attention inside the block).

Names follow vLLM's `DFlashQwen3ForCausalLM` checkpoint layout (`fc`, `hidden_norm`,
`layers.{i}.self_attn.{q,k,v,o}_proj`, `.{q,k}_norm`, `.mlp.*`, `norm`, `lm_head`, `d2t`),
so export is a save; the target's embedding is shared and frozen (not exported), and the
mask slots' embedding ships beside the weights (`mask_embedding`, vLLM's override file).

Attention takes precomputed context keys and values, so the same layers run training
(many blocks over one sequence's context, `eagle3.dflash.blocks`) and decoding (one block
over a growing context cache, `eagle3.dflash.drafter`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from eagle3.attention import _softmax_fp32, step0_visible, upcast
from eagle3.dflash.config import DFlashConfig
from eagle3.modeling import MLP, ResidualBlockTraining, RMSNorm, TargetWiredDraft, apply_rotary, rotary_cos_sin

NEG_INF = float("-inf")


class BlockVisibility:
    """What each block of a forward may read: block n, anchored at rows[b, n] + 1, sees the
    context rows j <= rows[b, n] of the same sample (segments [B, T]; -1 is padding) and
    every slot of its own block. `backend`: "dense" (two-part scores, `block_attention`:
    the CPU path and the reference) or "flex" (flex_attention with a block-sparse mask over
    [context keys | every block's keys], compiled on CUDA: no [blocks x slots, context]
    score tensor is kept, so a 16-slot block at 512 anchors over 8k tokens fits a GPU)."""

    def __init__(self, rows: torch.Tensor, segments: torch.Tensor, backend: str = "dense"):
        if backend not in ("dense", "flex"):
            raise ValueError(f"block attention backend {backend!r} is not 'dense' or 'flex'")
        self.rows, self.segments, self.backend = rows, segments, backend
        self._dense: torch.Tensor | None = None
        self._masks: dict[int, object] = {}

    @property
    def dense(self) -> torch.Tensor:
        """[B, N, T] bool: the context rows each block reads."""
        if self._dense is None:
            t = self.segments.shape[1]
            seg_q = self.segments.gather(1, self.rows)[:, :, None]
            k_idx = torch.arange(t, device=self.rows.device)[None, None, :]
            self._dense = step0_visible(seg_q, self.segments[:, None, :], self.rows[:, :, None], k_idx) & (seg_q >= 0)
        return self._dense

    def block_mask(self, slots: int):
        """flex_attention's BlockMask over queries [N * slots] and keys [T + N * slots]."""
        if slots not in self._masks:
            from torch.nn.attention.flex_attention import create_block_mask

            rows, seg = self.rows, self.segments
            t, n = seg.shape[1], rows.shape[1]

            def visible(b, h, q_idx, kv_idx):
                block = q_idx // slots
                row = rows[b, block]
                ctx = torch.clamp(kv_idx, max=t - 1)
                sees_ctx = (ctx <= row) & (seg[b, ctx] == seg[b, row]) & (seg[b, row] >= 0)
                return torch.where(kv_idx < t, sees_ctx, (kv_idx - t) // slots == block)

            self._masks[slots] = create_block_mask(
                visible, rows.shape[0], None, n * slots, t + n * slots, device=rows.device, _compile=rows.is_cuda
            )
        return self._masks[slots]


def flex_block_attention(q, k_block, v_block, k_ctx, v_ctx, visibility: BlockVisibility) -> torch.Tensor:
    """`block_attention` by flex_attention: the same maths over [context | blocks] keys with
    the visibility's block-sparse mask. k/v may hold fewer (grouped) heads than q."""
    from eagle3.attention import _flex_kernel

    b, h, n, s, d = q.shape
    hkv = k_ctx.shape[1]
    keys = torch.cat([k_ctx, k_block.reshape(b, hkv, n * s, d)], dim=2)
    values = torch.cat([v_ctx, v_block.reshape(b, hkv, n * s, d)], dim=2)
    out = _flex_kernel(q.device)(
        q.reshape(b, h, n * s, d), keys, values, block_mask=visibility.block_mask(s), enable_gqa=h != hkv
    )
    return out.reshape(b, h, n, s, d)


def block_attention(q, k_block, v_block, k_ctx, v_ctx, visible: torch.Tensor) -> torch.Tensor:
    """q, k_block, v_block [B, H, N, S, D] (N blocks of S slots); k_ctx, v_ctx [B, H, T, D];
    visible [B, N, T] bool: the context rows block n may read. Each slot attends to the
    visible context and to every slot of its own block -> [B, H, N, S, D].

    Scores are kept in two parts, [.., S, T] against the context and [.., S, S] inside the
    block, so memory grows with N*S*(T+S), not with (N*S)^2."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    t = k_ctx.shape[-2]
    ctx = upcast(torch.einsum("bhnsd,bhtd->bhnst", q, k_ctx)) * scale
    ctx = ctx.masked_fill(~visible[:, None, :, None, :], NEG_INF)
    own = upcast(torch.einsum("bhnsd,bhnud->bhnsu", q, k_block)) * scale
    probs = _softmax_fp32(torch.cat([ctx, own], dim=-1))
    p_ctx, p_own = probs[..., :t].to(v_ctx.dtype), probs[..., t:].to(v_block.dtype)
    return torch.einsum("bhnst,bhtd->bhnsd", p_ctx, v_ctx) + torch.einsum("bhnsu,bhnud->bhnsd", p_own, v_block)


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.cfg = cfg
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, cfg.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)  # per head, as Qwen3
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def _heads(self, x: torch.Tensor, proj: nn.Linear, norm: RMSNorm | None, positions) -> torch.Tensor:
        """[..., L, H] -> [..., heads, L, D]: projected, per-head normed, rotated (when `norm`)."""
        c = self.cfg
        out = proj(x)
        out = out.view(*out.shape[:-1], out.shape[-1] // c.head_dim, c.head_dim)
        if norm is not None:
            out = norm(out)
        out = out.transpose(-2, -3)  # [..., heads, L, D]
        if norm is not None:
            lead = positions.shape[:-1]
            cos, sin = rotary_cos_sin(positions.reshape(-1, positions.shape[-1]), c.head_dim, c.rope_theta)
            flat = out.reshape(-1, out.shape[-3], *out.shape[-2:])  # [prod(lead), heads, L, D]
            out = apply_rotary(flat, cos, sin).view(*lead, *out.shape[-3:])
        return out

    def _repeat(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        group = self.cfg.num_attention_heads // self.cfg.num_key_value_heads
        return x if group == 1 else x.repeat_interleave(group, dim=dim)

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the context rows ctx [B, T, H] at positions [B, T] -> [B, Hkv, T, D] each."""
        return self._heads(ctx, self.k_proj, self.k_norm, positions), self._heads(ctx, self.v_proj, None, None)

    def forward(self, x, positions, k_ctx, v_ctx, visibility: BlockVisibility) -> torch.Tensor:
        """x [B, N, S, H] (already input-normed), positions [B, N, S]; context k/v [B, Hkv, T, D]."""
        b, n, s, _ = x.shape
        q = self._heads(x, self.q_proj, self.q_norm, positions).transpose(1, 2)  # [B, Hq, N, S, D]
        k = self._heads(x, self.k_proj, self.k_norm, positions).transpose(1, 2)
        v = self._heads(x, self.v_proj, None, None).transpose(1, 2)
        if visibility.backend == "flex":  # grouped heads as they are
            out = flex_block_attention(q, k, v, k_ctx, v_ctx, visibility)
        else:
            out = block_attention(
                q,
                self._repeat(k, 1),
                self._repeat(v, 1),
                self._repeat(k_ctx, 1),
                self._repeat(v_ctx, 1),
                visibility.dense,
            )
        return self.o_proj(out.permute(0, 2, 3, 1, 4).reshape(b, n, s, -1))


class DFlashLayer(ResidualBlockTraining):
    """A Qwen3 decoder layer whose keys and values also hold the context."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h, positions, k_ctx, v_ctx, visibility: BlockVisibility) -> torch.Tensor:
        a = h + self.drop(self.self_attn(self.input_layernorm(h), positions, k_ctx, v_ctx, visibility))
        return self.residual_mlp(a, self.mlp, self.post_attention_layernorm)


class DFlashDraft(TargetWiredDraft):
    family = "dflash"  # its record in eagle3.families
    first_guess_slot = 1  # the anchor's slot guesses nothing: mask slot j + 1 guesses step j

    def __init__(self, cfg: DFlashConfig):
        super().__init__(cfg.vocab_size, cfg.hidden_size, cfg.draft_vocab_size)
        self.cfg = cfg
        # The mask slots' embedding, trained: it starts as the target's row of mask_token_id
        # (what vLLM would embed without the draft's own) and ships as vLLM's override file.
        self.mask_embedding = nn.Parameter(torch.zeros(cfg.hidden_size))
        self.fc = nn.Linear(cfg.num_aux * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)

    def load_target_embeddings(self, weight: torch.Tensor) -> None:
        super().load_target_embeddings(weight)
        with torch.no_grad():
            self.mask_embedding.copy_(weight[self.cfg.mask_token_id])

    def configure_training(self, recompute_mlp: bool, dropout: tuple[float, torch.Generator | None] | None) -> None:
        for layer in self.layers:
            layer.recompute_mlp, layer.dropout = recompute_mlp, dropout

    # --- the maths ----------------------------------------------------------------------
    def context(self, aux: torch.Tensor) -> torch.Tensor:
        """[..., n * H_target] captured target states -> [..., H] context rows."""
        expected = self.cfg.num_aux * self.cfg.target_hidden_size
        if aux.shape[-1] != expected:
            raise ValueError(
                f"aux hidden states are {aux.shape[-1]} wide, expected {expected} = "
                f"{self.cfg.num_aux} captured layers x target_hidden_size {self.cfg.target_hidden_size}"
            )
        return self.hidden_norm(self.fc(aux.to(self.fc.weight.dtype)))

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's keys and values of the context rows ctx [B, T, H] at positions [B, T]."""
        return [layer.self_attn.context_kv(ctx, positions) for layer in self.layers]

    def embed_block(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids -> embeddings, the mask id's being the draft's own (as vLLM embeds them)."""
        embeds = self.embed_tokens(ids)
        is_mask = (ids == self.cfg.mask_token_id)[..., None]
        return torch.where(is_mask, self.mask_embedding.to(embeds.dtype), embeds)

    def blocks(self, ids, positions, context_kv, visibility: BlockVisibility) -> torch.Tensor:
        """Blocks ids [B, N, S] at positions [B, N, S] over the context (`context_kv`, the rows
        `visibility` lets each block read) -> pre-norm hidden states [B, N, S, H]."""
        h = self.embed_block(ids)
        for layer, (k, v) in zip(self.layers, context_kv):
            h = layer(h, positions, k, v, visibility)
        return h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))
