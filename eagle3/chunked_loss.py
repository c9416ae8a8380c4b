"""The draft head's soft cross-entropy a block of rows at a time, without keeping [T, Vd].

Per TTT step the draft scores every row t against the target's distribution p_t over the
draft vocabulary:

    z_t    = W x_t                      x_t = norm(hidden_t) [H], W the draft's lm_head [Vd, H]
    loss_t = -sum_v p_tv log softmax(z_t)_v
    d loss_t / d z_t = softmax(z_t) * sum_v p_tv - p_t      (= q_t - p_t, p sums to 1)

The plain path (eagle3.ttt.score_steps through eagle3.objectives.position_loss) keeps
log softmax(z) [T, Vd] in fp32 for backward: 1 GiB a step at T = 8192 and Vd = 32000, seven
times over at TTT 7. Here the forward computes loss_t, the draft's argmax and the acceptance
rate sum_v min(p_tv, q_tv) block by block and keeps only x and the (shared) target
distribution; the backward recomputes z for each block (one more x W^T matmul) and forms
the gradients from q - p. The same numbers up to rounding; the test holds the two paths to
each other in float64, values and gradients.
"""

from __future__ import annotations

import torch


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The matmul dtype the plain path's lm_head would run in: autocast's where it is on."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


def _row_blocks(rows: int, block: int):
    for start in range(0, rows, block):
        yield start, min(start + block, rows)


class ChunkedSoftCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, p, block: int, dtype: torch.dtype):
        b, rows, _ = x.shape
        loss = torch.empty(b, rows, dtype=torch.float32, device=x.device)
        best = torch.empty(b, rows, dtype=torch.long, device=x.device)
        alpha = torch.empty(b, rows, dtype=torch.float32, device=x.device)
        w = weight.to(dtype)
        with torch.autocast(x.device.type, enabled=False):
            for i in range(b):
                for lo, hi in _row_blocks(rows, block):
                    z = (x[i, lo:hi].to(dtype) @ w.T).float()
                    log_q = torch.log_softmax(z, dim=-1)
                    pb = p[i, lo:hi]
                    loss[i, lo:hi] = -(pb * log_q).sum(-1)
                    best[i, lo:hi] = z.argmax(-1)
                    alpha[i, lo:hi] = torch.minimum(pb, log_q.exp()).sum(-1)
        ctx.save_for_backward(x, weight, p)
        ctx.block, ctx.dtype = block, dtype
        ctx.mark_non_differentiable(best, alpha)
        return loss, best, alpha

    @staticmethod
    def backward(ctx, grad_loss, _grad_best, _grad_alpha):
        x, weight, p = ctx.saved_tensors
        block, dtype = ctx.block, ctx.dtype
        w = weight.to(dtype)
        grad_x = torch.zeros_like(x) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        with torch.autocast(x.device.type, enabled=False):
            for i in range(x.shape[0]):
                for lo, hi in _row_blocks(x.shape[1], block):
                    xb, pb = x[i, lo:hi].to(dtype), p[i, lo:hi]
                    q = torch.softmax((xb @ w.T).float(), dim=-1)
                    grad_z = (q * pb.sum(-1, keepdim=True) - pb) * grad_loss[i, lo:hi, None].float()
                    if grad_x is not None:
                        grad_x[i, lo:hi] = (grad_z.to(dtype) @ w).to(x.dtype)
                    grad_w += (grad_z.to(dtype).T @ xb).float()
        grad_w = grad_w.to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None, None, None


def chunked_soft_ce(x: torch.Tensor, weight: torch.Tensor, p: torch.Tensor, block: int):
    """(loss per row, the draft's argmax over its vocabulary, acceptance rate per row) for
    x [B, R, H] (normed hidden states), the lm_head weight [Vd, H] and the target's
    distribution p [B, R, Vd] (a view is fine: nothing of it is copied), `block` rows of
    [block, Vd] at a time. Only the loss has a gradient."""
    return ChunkedSoftCE.apply(x, weight, p, block, _compute_dtype(x))
