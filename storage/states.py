"""How a shard holds the hidden states: the schemes (`capture.state_dtype`), and the
conversions between the capture's tensors and a shard's arrays.

- "bfloat16" (the default): `aux` uint16 [T, n*H] and `final` uint16 [T, H], the bf16 bit
  patterns (zarr has no bf16), read back bit for bit.
- "int8": symmetric absmax quantisation of every row slice of width H: per token and
  captured layer for aux (each H-wide slice of an aux row has its own scale), per token for
  final. `aux` int8 [T, n*H] + `aux_scale` float32 [T, n]; `final` int8 [T, H] +
  `final_scale` float32 [T, 1]. For a slice x: s = max|x| / 127, q = round(x / s) in
  [-127, 127] (-128 is never written), x ~= q * s, so |x - q*s| <= s/2 per element plus
  float rounding. An all-zero slice has s = 0 and q = 0: read back as exact zeros, no NaN.
  A NaN or Inf in a slice makes its scale NaN or Inf (`storage.verify` reports it).
  Readers return q * s computed in float32 and rounded once to bf16 (one more rounding,
  relative 2**-8 at most), the same bf16 tensors as a bf16 store's.

The scales are float32, not bf16: the quantiser then divides by exactly the scale that is
stored (a rounded bf16 scale would have to be rounded up, else the max element lands past
127, and would widen the step by up to 2**-7), and they cost 4 B per row and layer, 16 B a
token at 3 aux layers + final: 0.06% of the 28,672 B of int8 states at H 7168.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

STATE_DTYPES = ("bfloat16", "int8")
# What provenance's `stored_as` says for each scheme.
STORED_AS = {
    "bfloat16": "uint16 bit patterns of bfloat16",
    "int8": "int8, symmetric absmax per row slice (aux: per token and captured layer; final: per "
    "token), float32 scales in aux_scale / final_scale; value = q * scale",
}
# A shard's state arrays by scheme, and their dtypes.
STATE_ARRAYS = {
    "bfloat16": {"aux": np.uint16, "final": np.uint16},
    "int8": {"aux": np.int8, "aux_scale": np.float32, "final": np.int8, "final_scale": np.float32},
}
SCALES = {"aux": "aux_scale", "final": "final_scale"}
QMAX = 127
# float32 working memory per block of rows: a few MB stay in a CPU's cache; a GPU wants
# fewer, larger kernels
_CPU_BLOCK_BYTES, _GPU_BLOCK_BYTES = 4 << 20, 64 << 20


def state_bytes_per_token(n_aux: int, hidden_size: int, state_dtype: str) -> int:
    """Bytes of the aux + final states of one token (scales included)."""
    if state_dtype == "int8":
        return (n_aux + 1) * (hidden_size + 4)
    return 2 * (n_aux + 1) * hidden_size


def _block_rows(width: int, block_bytes: int) -> int:
    return max(1, block_bytes // (4 * width))


def quantize_int8(x: Any, groups: int, q_out: np.ndarray, s_out: np.ndarray) -> None:
    """Quantise x [t, groups*H] (a torch tensor of any float dtype, on any device: the work
    is done there, in float32, a block of rows at a time) into q_out int8 [t, groups*H] and
    s_out float32 [t, groups] (numpy, on the CPU)."""
    import torch

    t, width = x.shape
    h = width // groups
    q_view, s_view = torch.from_numpy(q_out), torch.from_numpy(s_out)
    step = _block_rows(width, _CPU_BLOCK_BYTES if x.device.type == "cpu" else _GPU_BLOCK_BYTES)
    with torch.no_grad():
        for a in range(0, t, step):
            b = min(t, a + step)
            g = x[a:b].detach().reshape(b - a, groups, h).float()
            s = g.abs().amax(dim=2) / QMAX
            # Zero slices divide by 1 (q = 0, s = 0 stored). NaN/Inf scales stay, for verify.
            q = torch.round(g / torch.where(s == 0, torch.ones_like(s), s)[..., None]).clamp_(-QMAX, QMAX)
            q_view[a:b].copy_(q.to(torch.int8).reshape(b - a, width))
            s_view[a:b].copy_(s)


def dequantize(q: Any, s: Any):
    """int8 q [..., G*H] and float32 scales s [..., G] (torch tensors on one device, any
    leading dims, e.g. a batch's [B, T]) -> a bfloat16 tensor [..., G*H] on that device:
    q * s in float32, rounded once to bf16. The one dequantisation: the CPU reader's and the
    training device's (right after the host-to-device copy, storage.states.decode_batch),
    so they agree bit for bit (an int8 -> float32 copy is exact, a float32 multiply and the
    round to bf16 are correctly rounded on any device). A block of rows at a time through one
    float32 buffer (a CPU's cache, a few MB; a GPU's, 64 MB: fewer, larger kernels): int8 ->
    float32 copy, in-place multiply, copy to bf16 is ~6x faster on a CPU core than one
    mixed-dtype multiply, and bounds the device's float32 working memory at any batch size."""
    import torch

    lead, width, groups = q.shape[:-1], q.shape[-1], s.shape[-1]
    if s.shape[:-1] != lead or width % groups:
        raise ValueError(f"int8 states {tuple(q.shape)} and scales {tuple(s.shape)} do not match")
    h = width // groups
    qt, st = q.reshape(-1, width), s.reshape(-1, groups)
    t = qt.shape[0]
    out = torch.empty((t, width), dtype=torch.bfloat16, device=q.device)
    step = _block_rows(width, _CPU_BLOCK_BYTES if q.device.type == "cpu" else _GPU_BLOCK_BYTES)
    buf = torch.empty((min(t, step), groups, h), dtype=torch.float32, device=q.device)
    for a in range(0, t, step):
        b = min(t, a + step)
        work = buf[: b - a]
        work.copy_(qt[a:b].view(b - a, groups, h))
        work.mul_(st[a:b, :, None])
        out[a:b].view(b - a, groups, h).copy_(work)
    return out.reshape(*lead, width)


def dequantize_int8(q: np.ndarray, s: np.ndarray):
    """int8 [T, G*H] and float32 scales [T, G] (numpy) -> a torch bfloat16 tensor [T, G*H]
    on the CPU (`dequantize`)."""
    import torch

    return dequantize(torch.from_numpy(np.ascontiguousarray(q)), torch.from_numpy(np.ascontiguousarray(s)))


def decode_batch(batch: dict) -> dict:
    """A batch (or sample) whose states are still as an int8 store holds them (`aux`,
    `final` int8 with `aux_scale`, `final_scale` float32, e.g. `StoreReader.iter_samples(...,
    dequantize=False)` batched) with `aux`/`final` dequantised to bf16 where the tensors are
    (on the training device after the copy) and the scales dropped; a batch of bf16 states
    as it is."""
    if not any(key in batch for key in SCALES.values()):
        return batch
    out = {k: v for k, v in batch.items() if k not in SCALES.values()}
    for key, scale in SCALES.items():
        out[key] = dequantize(batch[key], batch[scale])
    return out


def encode_states(states: Sequence, state_dtype: str) -> dict[str, np.ndarray]:
    """A shard's per-sample (aux [t, n*H], final [t, H]) tensors as its state arrays (see
    STATE_ARRAYS), converted where the tensors are (the engine's device) and then moved to
    the CPU."""
    import torch

    from storage.zarr_io import to_bf16_bits

    if state_dtype == "bfloat16":
        return {
            "aux": to_bf16_bits(torch.cat([a for a, _ in states])),
            "final": to_bf16_bits(torch.cat([f for _, f in states])),
        }
    if state_dtype != "int8":
        raise ValueError(f"state_dtype={state_dtype!r}: use one of {STATE_DTYPES}")
    t = sum(len(a) for a, _ in states)
    h = states[0][1].shape[1]
    groups = states[0][0].shape[1] // h
    out = {
        "aux": np.empty((t, groups * h), np.int8),
        "aux_scale": np.empty((t, groups), np.float32),
        "final": np.empty((t, h), np.int8),
        "final_scale": np.empty((t, 1), np.float32),
    }
    row = 0
    for aux, final in states:  # sample by sample: no concatenated copy on the device
        n = len(aux)
        quantize_int8(aux, groups, out["aux"][row : row + n], out["aux_scale"][row : row + n])
        quantize_int8(final, 1, out["final"][row : row + n], out["final_scale"][row : row + n])
        row += n
    return out


def decode_states(arrays: dict, state_dtype: str) -> tuple:
    """(aux, final) torch bfloat16 tensors from a shard's (or sample's) state arrays: bf16
    bits reinterpreted (no copy), int8 dequantised on the CPU."""
    states = states_as_tensors(arrays, state_dtype, dequantize=True)
    return states["aux"], states["final"]


def states_as_tensors(arrays: dict, state_dtype: str, dequantize: bool = True) -> dict:
    """A shard's (or sample's) state arrays as torch tensors on the CPU: bf16 bits
    reinterpreted as `aux`/`final` bf16 (no copy); int8 dequantised to them on the CPU, or
    with `dequantize=False` kept as stored (`aux`, `final` int8 and `aux_scale`,
    `final_scale` float32, views), for `decode_batch` on the training device."""
    import torch

    from storage.zarr_io import from_bf16_bits

    if state_dtype != "int8":
        return {"aux": from_bf16_bits(arrays["aux"]), "final": from_bf16_bits(arrays["final"])}
    if dequantize:
        return {key: dequantize_int8(arrays[key], arrays[SCALES[key]]) for key in SCALES}
    return {key: torch.from_numpy(arrays[key]) for key in STATE_ARRAYS["int8"]}


def state_shapes(state_dtype: str, tokens: int, n_aux: int, hidden_size: int) -> dict[str, tuple]:
    """The shapes a shard's state arrays must have."""
    shapes = {"aux": (tokens, n_aux * hidden_size), "final": (tokens, hidden_size)}
    if state_dtype == "int8":
        shapes.update(aux_scale=(tokens, n_aux), final_scale=(tokens, 1))
    return shapes


def nonfinite_rows(arr: np.ndarray) -> np.ndarray:
    """Row indices holding a NaN or Inf: bf16 bit patterns (exponent bits all ones) or a
    float array (int8 states are always finite: their scales carry it)."""
    if arr.dtype == np.uint16:
        bad = (arr & 0x7F80) == 0x7F80
    elif arr.dtype.kind == "f":
        bad = ~np.isfinite(arr)
    else:
        return np.empty(0, dtype=np.int64)
    return np.flatnonzero(bad.reshape(arr.shape[0], -1).any(axis=1))
