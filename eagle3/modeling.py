"""The EAGLE-3 draft, written to read like the paper and to load in SGLang as is.

    h0   = fc(cat(target states of the captured layers))          # n*H_t -> H
           (optionally normalised first: one RMSNorm over the concatenation, then one per state)
    x    = cat(input_layernorm(embed(token)), hidden_norm(h))     # 2H wide
    a    = h + o_proj(attention(q_proj(x), k_proj(x), v_proj(x)))
    out  = a + mlp(post_attention_layernorm(a))                   # the draft's hidden state
    p    = softmax(lm_head(norm(out)))                            # over the draft vocabulary

`out` (before the final norm) is what the next drafting step reads as its hidden state,
as SGLang's `LlamaForCausalLMEagle3` does. Parameter names follow that class's checkpoint
layout (`fc`, `midlayer.*`, `norm`, `lm_head`, buffers `d2t`, `t2d`), so export is a save.

Attention is delegated to a state object (see `eagle3.attention`): the same layer runs the
training-time-test unroll and the step-by-step KV-cache decode used at inference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from eagle3.attention import AttentionState, upcast
from eagle3.draft_config import DraftConfig
from eagle3.vocab import target_ids_of


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 (as Llama does) so bf16 inputs do not lose the mean square.
        dtype = x.dtype
        x32 = upcast(x)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [B, T, head_dim] for integer positions [B, T] (Llama/NeoX layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    angles = positions.to(torch.float32)[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, head_dim]; rotate pairs (i, i + d/2) as HF's `rotate_half`."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    cos = cos[:, None].to(x.dtype)
    sin = sin[:, None].to(x.dtype)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        width_in = 2 * cfg.hidden_size  # embeddings and hidden state side by side
        self.q_proj = nn.Linear(width_in, cfg.num_attention_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(width_in, cfg.num_key_value_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(width_in, cfg.num_key_value_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, state: AttentionState) -> torch.Tensor:
        b, t, _ = x.shape
        c = self.cfg
        q = self.q_proj(x).view(b, t, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        cos, sin = rotary_cos_sin(positions, c.head_dim, c.rope_theta)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # Grouped-query attention: query head h reads key/value head h // group (HF order).
        # States that group heads themselves (flex) get k/v as they are, saving the copies.
        if not getattr(state, "native_gqa", False):
            group = c.num_attention_heads // c.num_key_value_heads
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        out = state.attend(q, k, v)  # [B, heads, T, head_dim]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class ResidualBlockTraining(nn.Module):
    """What the training step sets on a draft layer (`configure_training`), shared by the
    families' layers: activation checkpointing of the MLP (its [T, intermediate]
    activations recomputed in backward instead of kept, for one more MLP forward), and
    residual dropout drawn from the training's generator (a resumed run draws the same
    masks). Neither is part of the weights."""

    def __init__(self):
        super().__init__()
        self.recompute_mlp = False
        self.dropout: tuple[float, torch.Generator | None] | None = None  # (probability, generator)

    def drop(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.dropout is None or self.dropout[0] == 0:
            return x
        p, generator = self.dropout
        keep = torch.rand(x.shape, generator=generator, device=x.device) >= p
        return x * keep / (1 - p)

    def residual_mlp(self, a: torch.Tensor, mlp: nn.Module, norm: nn.Module) -> torch.Tensor:
        """a + dropped mlp(norm(a)), the MLP recomputed in backward when asked."""
        h = norm(a)
        if self.recompute_mlp and torch.is_grad_enabled():
            return a + self.drop(checkpoint(mlp, h, use_reentrant=False))
        return a + self.drop(mlp(h))


class DecoderLayer(ResidualBlockTraining):
    """SGLang's `midlayer`: a Llama layer whose attention reads [embeds, hidden] (2H wide)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, embeds, hidden, positions, state: AttentionState) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        a = hidden + self.drop(self.self_attn(x, positions, state))
        return self.residual_mlp(a, self.mlp, self.post_attention_layernorm)


class TargetWiredDraft(nn.Module):
    """What every draft family shares with its target: a frozen copy of the target's input
    embeddings, and the draft vocabulary (`d2t[i]`: the offset with target_id = i + d2t[i];
    `t2d`: which target ids the draft has), set once the vocab stage has chosen it."""

    def __init__(self, vocab_size: int, hidden_size: int, draft_vocab_size: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(vocab_size, dtype=torch.bool))
        self.t2d[:draft_vocab_size] = True

    def load_target_embeddings(self, weight: torch.Tensor) -> None:
        if tuple(weight.shape) != tuple(self.embed_tokens.weight.shape):
            vocab, hidden = self.embed_tokens.weight.shape
            raise ValueError(
                f"target embeddings have shape {tuple(weight.shape)} but the draft expects "
                f"[vocab_size={vocab}, hidden_size={hidden}]"
            )
        with torch.no_grad():
            self.embed_tokens.weight.copy_(weight)

    def set_vocab_mapping(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(
                f"vocab mapping shapes d2t{tuple(d2t.shape)}/t2d{tuple(t2d.shape)} do not match the "
                f"draft's draft_vocab_size={self.d2t.numel()}, vocab_size={self.t2d.numel()}"
            )
        if int(t2d.sum()) != self.d2t.numel():
            raise ValueError(f"t2d marks {int(t2d.sum())} tokens, expected {self.d2t.numel()}")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target ids of draft ids, on the buffers' device (a CPU index, e.g. an arange, would
        otherwise be added to a CUDA gather and fail)."""
        draft_ids = draft_ids.to(self.d2t.device)
        return draft_ids + self.d2t[draft_ids]

    def target_ids(self) -> torch.Tensor:
        """The target id of every draft id (on the buffers' device)."""
        return target_ids_of(self.d2t)

    def init_head_from_target(self, lm_head_weight: torch.Tensor, final_norm_weight: torch.Tensor) -> None:
        """Start `lm_head` and `norm` where the target's own head is: its lm_head rows for the
        draft vocabulary (call after `set_vocab_mapping`) and its final norm. The draft then
        begins in the space the target reads its next token from, instead of learning that
        space from a random projection. Needs the draft as wide as the target. Every family
        has `cfg`, `lm_head` and `norm`: the draft's head is `lm_head(norm(h))`."""
        want = (self.cfg.vocab_size, self.cfg.hidden_size)
        if tuple(lm_head_weight.shape) != want or tuple(final_norm_weight.shape) != (self.cfg.hidden_size,):
            raise ValueError(
                f"draft.init_head=target needs the target's lm_head [vocab_size, hidden_size] = {list(want)} and "
                f"final norm [{self.cfg.hidden_size}], got {list(lm_head_weight.shape)} and "
                f"{list(final_norm_weight.shape)}: the draft's hidden_size must equal the target's"
            )
        with torch.no_grad():
            rows = self.target_ids().to(lm_head_weight.device)
            self.lm_head.weight.copy_(lm_head_weight[rows].to(self.lm_head.weight))
            self.norm.weight.copy_(final_norm_weight.to(self.norm.weight))


class Eagle3Draft(TargetWiredDraft):
    family = "eagle3"  # its record in eagle3.families

    def __init__(self, cfg: DraftConfig):
        super().__init__(cfg.vocab_size, cfg.hidden_size, cfg.draft_vocab_size)
        self.cfg = cfg
        width = cfg.num_aux * cfg.target_hidden_size
        # SGLang's names: `input_norm` (norm_before_fc) and `fc_norm.<i>` (fc_norm).
        self.input_norm = RMSNorm(width, cfg.rms_norm_eps) if cfg.norm_before_fc else None
        self.fc_norm = (
            nn.ModuleList(RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in range(cfg.num_aux))
            if cfg.fc_norm
            else None
        )
        self.fc = nn.Linear(width, cfg.hidden_size, bias=False)
        self.midlayer = DecoderLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)

    # --- wiring -----------------------------------------------------------------------
    def configure_training(self, recompute_mlp: bool, dropout: tuple[float, torch.Generator | None] | None) -> None:
        """What the training step sets on the layer: MLP recomputation and residual dropout."""
        self.midlayer.recompute_mlp, self.midlayer.dropout = recompute_mlp, dropout

    # --- the maths --------------------------------------------------------------------
    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """[..., n * H_target] captured target states -> [..., H] first hidden input."""
        expected = self.cfg.num_aux * self.cfg.target_hidden_size
        if aux.shape[-1] != expected:
            raise ValueError(
                f"aux hidden states are {aux.shape[-1]} wide, expected {expected} = "
                f"{self.cfg.num_aux} captured layers x target_hidden_size {self.cfg.target_hidden_size}"
            )
        aux = aux.to(self.fc.weight.dtype)  # stored states may be bf16
        if self.input_norm is not None:
            aux = self.input_norm(aux)
        if self.fc_norm is not None:
            aux = torch.cat(
                [norm(part) for norm, part in zip(self.fc_norm, aux.chunk(self.cfg.num_aux, dim=-1))], dim=-1
            )
        return self.fc(aux)

    def step(self, input_ids, hidden, positions, state: AttentionState) -> torch.Tensor:
        """One drafting step for a block of rows; returns the pre-norm hidden state."""
        return self.midlayer(self.embed_tokens(input_ids), hidden, positions, state)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))
