"""Which floating-point type the target engines and the trainer compute in (`auto`).

No CPU dtype is hard-coded: CPUs differ by an order of magnitude. On a Xeon with AMX a bf16
matrix product ran ~6x faster than fp32; on an AMD EPYC without bf16 units it ran ~7x (and
on this project's CI machine ~30x) *slower*, which made a bf16 default crawl. So `auto`
times one small matrix product in each type on one thread, once per process, picks bf16
only where it is clearly faster, and logs the figures behind the choice. On a GPU `auto`
is bf16 (fp16 where the GPU has no bf16). Any explicit dtype in the config is used as is.
"""

from __future__ import annotations

import functools
import time

from workflows.core.log import log

BF16_MIN_SPEEDUP = 1.25  # bf16 halves memory, but on a CPU only speed decides
_SIZE, _SECONDS = 256, 0.05


def resolve(requested: str, device: str = "cpu") -> str:
    """`requested` itself, or for `auto` the faster type on `device` (see the module doc)."""
    if requested != "auto":
        return requested
    if device.startswith("cuda"):
        return cuda_choice()
    return cpu_choice()[0]


def cuda_choice() -> str:
    """bf16 on the GPUs; fp16 only where this process sees a GPU without bf16. A driver
    without a GPU (a Ray head node placing CUDA workers) must not probe its own CPU: every
    datacenter GPU since Ampere has bf16."""
    import torch

    if torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        return "float16"
    return "bfloat16"


@functools.lru_cache(maxsize=None)
def cpu_choice() -> tuple[str, str]:
    """(dtype, why) for this CPU, measured once per process and logged."""
    fp32, bf16 = matmul_gflops("float32"), matmul_gflops("bfloat16")
    dtype = "bfloat16" if bf16 >= BF16_MIN_SPEEDUP * fp32 else "float32"
    why = (
        f"bf16 matmul {bf16:.1f} GFLOP/s vs fp32 {fp32:.1f} on one thread "
        f"(bf16 is chosen from {BF16_MIN_SPEEDUP}x faster)"
    )
    log(f"[precision] CPU compute dtype: {dtype}: {why}; set it explicitly to override")
    return dtype, why


def matmul_gflops(dtype: str) -> float:
    """GFLOP/s of a 256x256 matrix product in `dtype` on one thread (best of a short run)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = torch.randn(_SIZE, _SIZE, dtype=getattr(torch, dtype))
        b = torch.randn(_SIZE, _SIZE, dtype=getattr(torch, dtype))
        a @ b  # warm-up: kernel selection, allocation
        best, deadline = float("inf"), time.perf_counter() + _SECONDS
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return 2 * _SIZE**3 / best / 1e9


def engine_dtype(capture) -> str:
    """The capture engines' dtype: `capture.dtype` (the capture section) resolved on their device."""
    return resolve(capture.dtype, "cuda" if capture.gpus_per_actor else "cpu")
