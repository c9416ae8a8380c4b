"""capture.state_dtype=int8: per-row absmax quantisation (storage.states), its error bound
against a plain reference, the store's round trip, provenance refusals, sizes, and a
capture of the tiny target."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import storage.states
from storage.reader import StoreReader
from storage.states import decode_batch, dequantize, dequantize_int8, encode_states, quantize_int8
from storage.store import HiddenStateStore, ProvenanceMismatch, ShardData, StoreError
from storage.verify import verify
from tests.helpers import cfg_for, run_dir_with_corpus
from tests.test_store import IDS, H, provenance

BF16_EPS = 2.0**-8  # bf16's unit roundoff: the reader's one rounding of q * s


def reference_quantize(x: np.ndarray, groups: int) -> tuple[np.ndarray, np.ndarray]:
    """The obvious quantiser, slice by slice in plain Python on float32 values."""
    t, width = x.shape
    h = width // groups
    q = np.zeros((t, width), np.int8)
    s = np.zeros((t, groups), np.float32)
    for i in range(t):
        for g in range(groups):
            part = [np.float32(v) for v in x[i, g * h : (g + 1) * h]]
            scale = np.float32(max(abs(v) for v in part)) / np.float32(127)
            s[i, g] = scale
            for j, v in enumerate(part):
                k = 0 if scale == 0 else int(np.round(v / scale))  # half to even, like torch
                q[i, g * h + j] = min(127, max(-127, k))
    return q, s


def quantized(x: torch.Tensor, groups: int) -> tuple[np.ndarray, np.ndarray]:
    q = np.empty(x.shape, np.int8)
    s = np.empty((x.shape[0], groups), np.float32)
    quantize_int8(x, groups, q, s)
    return q, s


def bound(s: np.ndarray, groups: int, width: int) -> np.ndarray:
    """s/2 per element (each slice's own scale), float64."""
    return np.repeat(s.astype(np.float64), width // groups, axis=1) / 2


rows = st.integers(1, 6).flatmap(
    lambda t: st.tuples(
        st.sampled_from([1, 2, 3]),
        st.sampled_from([1, 4, 16]),
        hnp.arrays(
            np.float32,
            (t, 48),
            elements=st.floats(-3e4, 3e4, width=32, allow_subnormal=False) | st.sampled_from([0.0, -0.0, 1e-30, 1.0]),
        ),
    )
)


@settings(max_examples=150, deadline=None)
@given(rows)
def test_quantiser_equals_the_reference_and_stays_within_half_a_step(case):
    groups, zero_every, x = case
    x = x.copy()
    x[::zero_every] = 0  # all-zero rows among the others
    q, s = quantized(torch.from_numpy(x), groups)
    rq, rs = reference_quantize(x, groups)
    assert np.array_equal(s, rs) and np.array_equal(q, rq)
    assert q.min() >= -127 and np.isfinite(s).all()
    deq = q.astype(np.float64) * np.repeat(s.astype(np.float64), x.shape[1] // groups, axis=1)
    err = np.abs(x.astype(np.float64) - deq)
    assert (err <= bound(s, groups, x.shape[1]) * (1 + 1e-6) + np.abs(x) * 2.0**-23).all()
    # What readers return: q * s rounded once to bf16.
    got = dequantize_int8(q, s).double().numpy()
    limit = bound(s, groups, x.shape[1]) * (1 + 1e-6) + np.abs(x) * 2.0**-23 + np.abs(deq) * BF16_EPS * (1 + 1e-4)
    assert (np.abs(x - got) <= limit).all()
    zero = ~x.any(axis=1)
    assert (got[zero] == 0).all() and not np.isnan(got).any()


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 3),
    st.integers(1, 5),
    st.sampled_from([1, 2, 4]),
    st.sampled_from([64, 200, 1 << 20]),
    st.integers(0, 2**31 - 1),
)
def test_dequantize_of_any_shape_and_block_equals_the_plain_product_bit_for_bit(b, t, groups, block_bytes, seed):
    """`dequantize` (the one the CPU reader and the training device run) on a batch's
    [B, T, G*H] against the obvious q * s in float32 rounded to bf16, and the reader's numpy
    entry point against it, whatever the block the rows are worked through (64 B: one row a
    block)."""
    rng = np.random.default_rng(seed)
    h = 6
    q = rng.integers(-127, 128, (b, t, groups * h), dtype=np.int8)
    s = (rng.standard_normal((b, t, groups)) * 10.0 ** rng.integers(-30, 30, (b, t, groups))).astype(np.float32)
    s.flat[::3] = 0  # all-zero slices (padding)
    want = (torch.from_numpy(q).float() * torch.from_numpy(np.repeat(s, h, axis=-1))).bfloat16()
    saved = storage.states._CPU_BLOCK_BYTES
    storage.states._CPU_BLOCK_BYTES = block_bytes
    try:
        got = dequantize(torch.from_numpy(q), torch.from_numpy(s))
        flat = dequantize_int8(q.reshape(b * t, -1), s.reshape(b * t, -1))
    finally:
        storage.states._CPU_BLOCK_BYTES = saved
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))  # bits (signed zeros, infs too)
    assert torch.equal(flat.view(torch.int16), want.reshape(b * t, -1).view(torch.int16))
    with pytest.raises(ValueError, match="do not match"):
        dequantize(torch.from_numpy(q), torch.from_numpy(s[:, :0]))


def test_all_zero_slices_come_back_as_zeros_and_nonfinite_values_mark_their_scale():
    x = torch.randn(4, 3 * 8)
    x[0] = 0  # a whole row
    x[1, 8:16] = 0  # one layer's slice of a row
    q, s = quantized(x, 3)
    assert s[0].tolist() == [0, 0, 0] and s[1, 1] == 0 and (s[1, [0, 2]] > 0).all()
    back = dequantize_int8(q, s)
    assert not back.isnan().any() and (back[0] == 0).all() and (back[1, 8:16] == 0).all()
    x[2, 3], x[3, 20] = float("nan"), float("inf")
    _, s = quantized(x, 3)
    assert math.isnan(s[2, 0]) and math.isinf(s[3, 2]) and np.isfinite(s[2, 1:]).all()


def test_int8_against_fp8_at_the_same_bytes():
    """The scheme's choice, measured: per-row scaled float8_e4m3 costs the same bytes. On
    Gaussian rows int8's errors are ~3x smaller (max and rms); fp8 keeps its relative error
    when a few channels are far larger than the rest (massive activations), where int8's
    step grows with the row's max; int8's bound is absolute (s/2), fp8's relative."""

    def errors(x, deq):
        rms = x.pow(2).mean(-1, keepdim=True).sqrt()
        e = (x - deq).abs() / rms
        return e.max().item(), e.pow(2).mean().sqrt().item()

    def fp8(x):
        s = x.abs().amax(-1, keepdim=True) / 448
        return (x / s).to(torch.float8_e4m3fn).float() * s

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4096, generator=g).bfloat16().float()
    q, s = quantized(x, 1)
    int8_max, int8_rms = errors(x, dequantize_int8(q, s).float())
    fp8_max, fp8_rms = errors(x, fp8(x))
    assert int8_max < fp8_max / 4 and int8_rms < fp8_rms / 2
    x[:, :4] *= 100  # outlier channels
    q, s = quantized(x, 1)
    assert errors(x, dequantize_int8(q, s).float())[1] > errors(x, fp8(x))[1]


def make_states(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    states = [(torch.randn(n, len(IDS) * H, generator=g) * 3, torch.randn(n, H, generator=g)) for n in lengths]
    states[0][0][:, H : 2 * H] = 0  # a zero slice in the first sample
    return states


def shard_of(ids, states, state_dtype):
    t = sum(len(a) for a, _ in states)
    return ShardData(
        sample_ids=list(ids),
        input_ids=np.arange(t, dtype=np.int32) % 100,
        loss_mask=(np.arange(t) % 2).astype(np.uint8),
        offsets=np.concatenate([[0], np.cumsum([len(a) for a, _ in states])]).astype(np.int64),
        **encode_states(states, state_dtype),
    )


def assert_within_bound(got: torch.Tensor, want: torch.Tensor, scale: np.ndarray, slack: float = 0.0):
    groups = scale.shape[1]
    limit = bound(scale, groups, want.shape[1]) * (1 + 1e-6) + want.abs().double().numpy() * 2 * BF16_EPS + slack
    err = (got.double() - want.double()).abs().numpy()
    assert (err <= limit).all(), float((err - limit).max())


def test_int8_store_reads_back_within_the_bound_and_bf16_stays_bit_exact(tmp_path):
    states, ids = make_states([5, 3, 7]), ["a", "b", "c"]
    got = {}
    for scheme in ("bfloat16", "int8"):
        url = str(tmp_path / scheme)
        store = HiddenStateStore.create_or_open(url, provenance(state_dtype=scheme))
        store.commit([store.write_shard("train-000000-x", shard_of(ids, states, scheme), chunk_bytes=64)])
        assert verify(url)["ok"]
        reader = StoreReader(url)
        assert reader.state_dtype == scheme
        got[scheme] = {s["id"]: s for s in reader.iter_samples(reader.shard_names())}
        for sid in ids:  # random access gives what streaming gives
            one = reader.sample(sid)
            assert one["aux"].dtype == one["final"].dtype == torch.bfloat16
            assert torch.equal(one["aux"], got[scheme][sid]["aux"]) and torch.equal(
                one["final"], got[scheme][sid]["final"]
            )
    raw = StoreReader(str(tmp_path / "int8")).read_shard("train-000000-x")
    assert (
        raw["aux"].dtype == np.int8 and raw["aux_scale"].shape == (15, len(IDS)) and raw["final_scale"].shape == (15, 1)
    )
    off = raw["offsets"]
    for k, (sid, (aux, final)) in enumerate(zip(ids, states)):
        assert torch.equal(got["bfloat16"][sid]["aux"], aux.bfloat16())  # bit-exact, as before
        assert torch.equal(got["bfloat16"][sid]["final"], final.bfloat16())
        a, b = off[k], off[k + 1]
        assert_within_bound(got["int8"][sid]["aux"], aux, raw["aux_scale"][a:b])
        assert_within_bound(got["int8"][sid]["final"], final, raw["final_scale"][a:b])
    assert (got["int8"]["a"]["aux"][:, H : 2 * H] == 0).all()
    # zarr itself reads the int8 store (the arrays are in zarr's own layout)
    g = HiddenStateStore(str(tmp_path / "int8")).open_shard("train-000000-x")
    assert np.array_equal(g["aux"][...], raw["aux"]) and np.array_equal(g["final_scale"][...], raw["final_scale"])
    # about half the bytes: 4 * (8 + 4) state bytes a token against bf16's 2 * 4 * 8
    sizes = {s: HiddenStateStore(str(tmp_path / s)).summary()["bytes"] for s in got}
    assert sizes["int8"] < 0.8 * sizes["bfloat16"]


def test_compressed_int8_store_round_trip(tmp_path):
    states = make_states([4, 6], seed=1)
    url = str(tmp_path / "z")
    store = HiddenStateStore.create_or_open(url, provenance(state_dtype="int8"))
    store.commit([store.write_shard("000000", shard_of(["a", "b"], states, "int8"), compression="zstd:1")])
    reader = StoreReader(url)
    streamed = {s["id"]: s for s in reader.iter_samples(reader.shard_names())}
    assert torch.equal(reader.sample("b")["aux"], streamed["b"]["aux"]) and verify(url)["ok"]
    assert_within_bound(streamed["b"]["aux"], states[1][0], reader.read_shard("000000")["aux_scale"][4:])


def test_writer_refuses_states_of_another_scheme(tmp_path):
    store = HiddenStateStore.create_or_open(str(tmp_path / "s"), provenance(state_dtype="int8"))
    states = make_states([3])
    with pytest.raises(StoreError, match=r"aux is uint16, not int8 \(state_dtype int8\)"):
        store.write_shard("x", shard_of(["a"], states, "bfloat16"))
    bf16 = HiddenStateStore.create_or_open(str(tmp_path / "b"), provenance())
    with pytest.raises(StoreError, match="aux_scale, final_scale not stored with state_dtype bfloat16"):
        bf16.write_shard("x", shard_of(["a"], states, "int8"))


def test_verify_reports_nonfinite_scales_and_out_of_range_values(tmp_path):
    url = str(tmp_path / "s")
    store = HiddenStateStore.create_or_open(url, provenance(state_dtype="int8"))
    states = make_states([3, 4])
    states[1][0][2, 5] = float("nan")
    data = shard_of(["a", "b"], states, "int8")
    data.final[1, 0] = -128
    store.commit([store.write_shard("000000", data)])
    problems = {(p["sample"], p["problem"]) for p in verify(url)["problems"]}
    assert problems == {
        ("b", "NaN/Inf in aux_scale"),
        ("a", "int8 value -128 in final (the quantiser writes -127..127)"),
    }


def test_an_unknown_scheme_is_refused_naming_the_field(tmp_path):
    url = str(tmp_path / "s")
    HiddenStateStore.create_or_open(url, provenance(state_dtype="fp4"))
    for read in (StoreReader, verify):
        with pytest.raises(
            StoreError, match=r"provenance field 'state_dtype' is 'fp4', a scheme this code cannot read"
        ):
            read(url)
    with pytest.raises(StoreError, match="'state_dtype' is 'fp4'"):
        HiddenStateStore(url).write_shard("x", shard_of(["a"], make_states([2]), "bfloat16"))


def test_the_train_side_refuses_a_store_of_another_scheme(tmp_path):
    from tests.helpers import contract_of
    from workflows.core.config import compose
    from workflows.core.provenance import CAPTURE_CONTRACT

    identity = {"path": "/t", "weights_sha256": "w", "tokenizer_sha256": "t", "chat_template_sha256": "c"}
    contract = {
        s: contract_of(compose(["target=tiny", f"capture.state_dtype={s}"]), identity) for s in ("bfloat16", "int8")
    }
    assert contract["int8"]["state_dtype"] == "int8" and "state_dtype" in CAPTURE_CONTRACT
    assert {k for k in CAPTURE_CONTRACT if contract["int8"][k] != contract["bfloat16"][k]} == {"state_dtype"}
    for stored, asked in (("bfloat16", "int8"), ("int8", "bfloat16")):
        url = str(tmp_path / stored)
        HiddenStateStore.create_or_open(url, contract[stored])
        said = f"provenance field 'state_dtype' is '{stored}' in the store but the config asks for '{asked}'"
        with pytest.raises(ProvenanceMismatch, match=said):
            StoreReader(url, expect=contract[asked])  # the train stage's open (RunLayout.open_store)
        with pytest.raises(ProvenanceMismatch, match="'state_dtype'"):  # the capture stage's
            HiddenStateStore.create_or_open(url, contract[asked], checked=CAPTURE_CONTRACT)
        assert StoreReader(url, expect=contract[stored]).state_dtype == stored


@pytest.mark.parametrize(
    "target, ratio",
    [
        ("kimi_k25_int4", 28693 / 57349),  # 3 aux + final, H 7168: 0.5003
        # H 64: the 5 B of id + mask and 4 x 4 B of scales weigh on 517 B a token: 0.536
        ("tiny", 277 / 517),
    ],
)
def test_int8_bytes_per_token_are_about_half(target, ratio):
    from workflows.capture import sizing
    from workflows.core.config import compose

    cfg = compose([f"target={target}", "capture.state_dtype=int8"])
    est = sizing.estimate(cfg.target, cfg.capture, 1000, cfg.store_capture_ids)
    bf16, int8 = est["by_state_dtype"]["bfloat16"]["bytes_per_token"], est["bytes_per_token"]
    assert est["state_dtype"] == "int8" and est["by_state_dtype"]["int8"]["bytes_per_token"] == int8
    assert int8 / bf16 == pytest.approx(ratio) and int8 * 1000 == est["projected_bytes"]
    assert int8 / bf16 <= (0.52 if target == "kimi_k25_int4" else 0.54)
    n, h = len(cfg.target.capture_ids), cfg.target.hidden_size
    assert int8 - 5 == (n + 1) * h + 4 * (n + 1) and bf16 - 5 == 2 * (n + 1) * h  # states only: 0.531 at H 64


def test_int8_capture_of_the_tiny_target_matches_hf_within_the_bound(tiny_target, corpus, tmp_path, ray_local):  # noqa: F811
    from eagle3.target_features import capture_states
    from tests.helpers import contract_of
    from workflows.capture import stage as capture
    from workflows.core.layout import RunLayout
    from workflows.core.provenance import target_identity
    from workflows.core.targets import load_target
    from workflows.train.data import eval_batches

    dirs = {s: run_dir_with_corpus(corpus, tmp_path / s) for s in ("bfloat16", "int8")}
    cfgs = {s: cfg_for(tiny_target, dirs[s], f"capture.state_dtype={s}") for s in dirs}
    for s in dirs:
        capture.run(cfgs[s], tiny_target)
    summary = json.loads((dirs["int8"] / "capture" / "summary.json").read_text())
    assert summary["verify_ok"] and summary["state_dtype"] == "int8"
    identity = target_identity(tiny_target, cfgs["int8"].cache_path)
    reader = RunLayout.of(cfgs["int8"]).open_store(expect=contract_of(cfgs["int8"], identity))
    assert reader.provenance["state_dtype"] == "int8" and reader.provenance["stored_as"].startswith("int8")
    # Against the HF forward (float32), each slice within half its step (plus bf16's rounding).
    model, _ = load_target(tiny_target, dtype="float32")
    where = reader.index
    for sid in reader.sample_ids[:4]:
        got = reader.sample(sid)
        ids = got["input_ids"][None]
        aux, final = capture_states(model, ids, torch.ones_like(ids), [0, 2, 4])
        raw = reader.read_shard(where[sid][0])
        k = where[sid][1]
        a, b = raw["offsets"][k], raw["offsets"][k + 1]
        assert_within_bound(got["aux"], aux[0], raw["aux_scale"][a:b], slack=1e-5)
        assert_within_bound(got["final"], final[0], raw["final_scale"][a:b], slack=1e-5)
    # The train path batches it as stored (int8 + scales) and dequantises after the copy to
    # its device (workflows.train.data.to_device): the reader's bf16.
    batch = next(iter(eval_batches(reader, reader.shard_names("train"), batch_size=4, max_seq_len=4096, pad_id=0)))
    assert batch["aux"].dtype == batch["final"].dtype == torch.int8 and batch["aux_scale"].dtype == torch.float32
    first = [reader.sample(sid) for sid in reader.store.shard_attrs(reader.shard_names("train")[0])["sample_ids"][:4]]
    decoded = decode_batch(batch)
    assert decoded["aux"].dtype == torch.bfloat16 and "aux_scale" not in decoded
    for row, one in enumerate(first):
        n = len(one["input_ids"])
        assert torch.equal(decoded["aux"][row, :n], one["aux"]) and torch.equal(decoded["final"][row, :n], one["final"])
    # About half the bytes (0.536 at H 64, see test_int8_bytes_per_token_are_about_half): the
    # arrays, and their data files (which add each Zarr shard's index and padding).
    stores = {s: HiddenStateStore(str(d / "store")) for s, d in dirs.items()}
    sizes = {s: store.summary()["bytes"] for s, store in stores.items()}
    assert sizes["int8"] / sizes["bfloat16"] == pytest.approx(277 / 517, abs=0.005), sizes
    files = {
        s: sum(f.stat().st_size for f in (d / "store" / "shards").glob("*/*/c/**/*") if f.is_file())
        for s, d in dirs.items()
    }
    assert 0.5 < files["int8"] / files["bfloat16"] < 0.55, files
    # A config of the other scheme is refused on both sides, naming the field.
    with pytest.raises(ProvenanceMismatch, match="'state_dtype'"):
        RunLayout.of(cfgs["int8"]).open_store(expect=contract_of(cfgs["bfloat16"], identity))
    with pytest.raises(ProvenanceMismatch, match="'state_dtype'"):
        capture.run(cfg_for(tiny_target, dirs["int8"], "capture.state_dtype=bfloat16"), tiny_target)


def test_a_reader_hands_out_a_drafters_own_layers_of_a_union_store(tmp_path):
    """A store of the union of several drafters' layers ([0, 2, 4] here): a reader asking for
    [4, 0] gets exactly those layers' columns (and int8 scales), in that order, streaming and
    by sample, in both schemes; a layer the store lacks is refused, naming it."""
    from storage.store import StoreError

    states, ids = make_states([5, 3, 7]), ["a", "b", "c"]
    for scheme in ("bfloat16", "int8"):
        url = str(tmp_path / scheme)
        store = HiddenStateStore.create_or_open(url, provenance(state_dtype=scheme))
        store.commit([store.write_shard("train-000000-x", shard_of(ids, states, scheme))])
        whole = {s["id"]: s for s in StoreReader(url).iter_samples(["train-000000-x"], dequantize=False)}
        picked = StoreReader(url, aux_layers=[4, 0])
        part = {s["id"]: s for s in picked.iter_samples(["train-000000-x"], dequantize=False)}
        for sid in ids:
            a = whole[sid]["aux"]
            assert torch.equal(part[sid]["aux"], torch.cat([a[:, 2 * H : 3 * H], a[:, :H]], dim=1))
            if scheme == "int8":
                assert torch.equal(part[sid]["aux_scale"], whole[sid]["aux_scale"][:, [2, 0]])
            assert torch.equal(part[sid]["final"], whole[sid]["final"])
            one = picked.sample(sid)["aux"]
            full = StoreReader(url).sample(sid)["aux"]
            assert torch.equal(one, torch.cat([full[:, 2 * H :], full[:, :H]], dim=1))
        assert StoreReader(url, aux_layers=IDS)._aux_slots is None  # the whole store: no copy
        with pytest.raises(
            StoreError, match=r"holds capture ids \[0, 2, 4\], the draft reads \[1, 2, 3\]: \[1, 3\] are not captured"
        ):
            StoreReader(url, aux_layers=[1, 2, 3])
