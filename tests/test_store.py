"""The Zarr hidden-state store: round trip, commit protocol, provenance, verify, s3."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eagle3.target_features import collate_samples
from storage.reader import StoreReader
from storage.store import HiddenStateStore, ProvenanceMismatch, ShardData, StoreError
from storage.verify import verify
from storage.zarr_io import to_bf16_bits

H, IDS = 8, [0, 2, 4]


def provenance(**over):
    prov = {
        "target_path": "/t",
        "target_weights_sha256": "abc",
        "num_layers": 6,
        "hidden_size": H,
        "capture_layer_ids": IDS,
        "layer_id_convention": "output_of_layer",
        "state_dtype": "bfloat16",
        "final_is_normed": True,
        "tokenizer_sha256": "tok",
        "chat_template_sha256": "tpl",
        "backend": "hf",
        "plan": {"shard_samples": 3},
        "target": {"vocab_size": 100},
    }
    prov.update(over)
    return prov


def make_shard(ids, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    aux = torch.randn(t, len(IDS) * H, generator=g)
    final = torch.randn(t, H, generator=g)
    data = ShardData(
        sample_ids=list(ids),
        input_ids=np.arange(t, dtype=np.int32) % 100,
        loss_mask=(np.arange(t) % 2).astype(np.uint8),
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        aux=to_bf16_bits(aux),
        final=to_bf16_bits(final),
    )
    return data, aux, final


def test_round_trip_by_sample_and_shard(tmp_path):
    store = HiddenStateStore.create_or_open(str(tmp_path / "s"), provenance())
    d1, aux1, fin1 = make_shard(["a", "b", "c"], [5, 3, 7])
    d2, aux2, _ = make_shard(["d", "e"], [4, 2], seed=1)
    store.commit([store.write_shard("000000", d1, chunk_bytes=64)])  # tiny chunks: several per shard
    store.commit([store.write_shard("000001", d2)])
    reader = StoreReader(str(tmp_path / "s"))
    assert len(reader) == 5
    b = reader.sample("b")
    assert torch.equal(b["aux"], aux1[5:8].to(torch.bfloat16))  # bit-exact bf16
    assert torch.equal(reader.sample("c")["final"], fin1[8:15].to(torch.bfloat16))
    assert b["input_ids"].tolist() == [5, 6, 7]
    shards = list(reader.iter_shards())
    assert [s["shard"] for s in shards] == ["000000", "000001"] and shards[1]["offsets"].tolist() == [0, 4, 6]
    batch = collate_samples([reader.sample(s) for s in ["e", "a"]])
    assert batch["aux"].shape == (2, 5, len(IDS) * H) and batch["aux"].dtype == torch.bfloat16
    assert batch["attention_mask"].sum(1).tolist() == [2, 5]
    assert torch.equal(batch["aux"][0, :2], aux2[4:6].to(torch.bfloat16))
    assert verify(str(tmp_path / "s"))["ok"]


def test_uncommitted_and_half_written_shards_are_invisible(tmp_path):
    store = HiddenStateStore.create_or_open(str(tmp_path / "s"), provenance())
    store.commit([store.write_shard("000000", make_shard(["a"], [3])[0])])
    store.write_shard("000001", make_shard(["b"], [3])[0])  # written, never committed
    # A half-written shard: the writer died before setting its marker.
    half = store.write_shard("000002", make_shard(["c"], [3])[0])
    import zarr

    from storage.zarr_io import zarr_store

    zarr.open_group(zarr_store(store.shard_url("000002")), mode="r+").attrs["complete"] = False
    assert StoreReader(str(tmp_path / "s")).sample_ids == ["a"]
    assert store.shard_is_complete("000001") and not store.shard_is_complete("000002")
    with pytest.raises(StoreError, match="000002.*did not mark it complete"):
        store.commit([half])


def test_provenance_contradiction_is_refused_by_field(tmp_path):
    HiddenStateStore.create_or_open(str(tmp_path / "s"), provenance())
    with pytest.raises(ProvenanceMismatch, match="'capture_layer_ids'"):
        HiddenStateStore.create_or_open(str(tmp_path / "s"), provenance(capture_layer_ids=[1, 2, 4]))
    with pytest.raises(ProvenanceMismatch, match="'tokenizer_sha256'"):
        StoreReader(str(tmp_path / "s"), expect={"tokenizer_sha256": "other"})
    with pytest.raises(ProvenanceMismatch, match="'hidden_size'"):
        HiddenStateStore.open(str(tmp_path / "s"), expect={"hidden_size": 16})


def test_writer_refuses_bad_shapes_and_empty_samples(tmp_path):
    store = HiddenStateStore.create_or_open(str(tmp_path / "s"), provenance())
    data, _, _ = make_shard(["a", "b"], [3, 2])
    data.offsets = np.array([0, 3, 3, 5], dtype=np.int64)
    data.sample_ids = ["a", "empty", "b"]
    with pytest.raises(StoreError, match="empty sample 'empty'"):
        store.write_shard("x", data)
    data, _, _ = make_shard(["a"], [3])
    data.final = data.final[:, :4]
    with pytest.raises(StoreError, match=r"final shape \(3, 4\) != \(3, 8\)"):
        store.write_shard("x", data)


def test_verify_reports_corrupt_shard_and_nan_sample(tmp_path):
    url = str(tmp_path / "s")
    store = HiddenStateStore.create_or_open(url, provenance())
    store.commit([store.write_shard("000000", make_shard(["a", "b"], [3, 4])[0])])
    data, _, _ = make_shard(["c", "d"], [2, 2], seed=3)
    data.aux[3, 1] = 0x7FC0  # bf16 NaN in sample d
    store.commit([store.write_shard("000001", data)])
    store.commit([store.write_shard("000002", make_shard(["e"], [5])[0])])
    shard_file = next(p for p in (tmp_path / "s" / "shards" / "000002" / "aux" / "c").rglob("*") if p.is_file())
    shard_file.write_bytes(shard_file.read_bytes()[:10])  # truncated Zarr shard file
    report = verify(url)
    assert not report["ok"]
    problems = {(p["shard"], p["sample"]): p["problem"] for p in report["problems"]}
    assert problems[("000001", "d")] == "NaN/Inf in aux"
    assert ("000001", "c") not in problems
    assert "unreadable" in problems[("000002", None)]
    assert all(p["shard"] != "000000" for p in report["problems"])


def test_compressed_store_round_trip(tmp_path):
    store = HiddenStateStore.create_or_open(str(tmp_path / "s"), provenance())
    data, aux, _ = make_shard(["a", "b"], [30, 20])
    store.commit([store.write_shard("000000", data, compression="zstd:1")])
    assert torch.equal(StoreReader(str(tmp_path / "s")).sample("b")["aux"], aux[30:].to(torch.bfloat16))
    with pytest.raises(StoreError, match="compression"):
        store.write_shard("000001", data, compression="lz9")


def test_commit_log_and_streaming_on_an_fsspec_memory_store(tmp_path):
    url = f"memory://{tmp_path.name}/store"  # remote code paths (fsspec, zarr's FsspecStore), in memory
    store = HiddenStateStore.create_or_open(url, provenance())
    data, aux, _ = make_shard(["a", "b"], [3, 4])
    store.commit([store.write_shard("train-000000-x", data, chunk_bytes=64)])
    store.commit([store.write_shard("train-000001-y", make_shard(["c"], [2])[0], compression="zstd:1")])
    before = store.manifest()
    reader = StoreReader(url)
    assert [s["id"] for s in reader.iter_samples(reader.shard_names("train"))] == ["a", "b", "c"]
    assert torch.equal(reader.sample("b")["aux"], aux[3:].to(torch.bfloat16))
    assert store.compact() == 2 and store.manifest() == before and verify(url)["ok"]
    store.fs.rm(f"{store.path}/shards/train-000000-x/aux/c/0/0")
    with pytest.raises(StoreError, match="shard train-000000-x: unreadable: data file .* is missing"):
        list(StoreReader(url).iter_samples(["train-000000-x"]))


def test_s3_store_on_local_moto_server():
    pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    import boto3

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        creds = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region_name": "us-east-1"}
        boto3.client("s3", endpoint_url=endpoint, **creds).create_bucket(Bucket="states")
        opts = {
            "key": "testing",
            "secret": "testing",
            "endpoint_url": endpoint,
            "client_kwargs": {"region_name": "us-east-1"},
        }
        url = "s3://states/run1/store"
        store = HiddenStateStore.create_or_open(url, provenance(), storage_options=opts)
        data, aux, final = make_shard(["a", "b"], [4, 6])
        store.commit([store.write_shard("000000", data, chunk_bytes=100)])
        store.commit([store.write_shard("000001", make_shard(["c"], [3], seed=1)[0])])
        reader = StoreReader(url, storage_options=opts)
        assert torch.equal(reader.sample("b")["aux"], aux[4:].to(torch.bfloat16))
        assert torch.equal(reader.sample("a")["final"], final[:4].to(torch.bfloat16))
        streamed = {s["id"]: s for s in reader.iter_samples(reader.shard_names())}
        assert list(streamed) == ["a", "b", "c"] and torch.equal(streamed["b"]["aux"], aux[4:].to(torch.bfloat16))
        before = store.manifest()
        assert store.compact() == 2 and store.manifest() == before and store._log_files() == []
        assert verify(url, storage_options=opts)["ok"]
        with pytest.raises(ProvenanceMismatch, match="'backend'"):
            HiddenStateStore.create_or_open(url, provenance(backend="sglang"), storage_options=opts)
    finally:
        server.stop()


# ---------------------------------------------------------------------------------- zarr_direct: the format
def test_direct_layout_is_zarrs_own(tmp_path):
    """Metadata written by storage.zarr_direct equals zarr's for the same array; zarr reads
    the data files it writes, and it reads zarr's (absent chunks included), bit for bit."""
    import json

    import fsspec
    import zarr

    from storage import zarr_direct
    from storage.zarr_io import zarr_store

    fs = fsspec.filesystem("file")
    rng = np.random.default_rng(0)
    cases = [
        (rng.integers(0, 99, 11, dtype=np.int32), None),
        (np.ones(5, np.uint8), None),
        (np.arange(4, dtype=np.int64), None),
        (rng.integers(0, 2**16, (10, 6), dtype=np.uint16), 3),
        (rng.integers(0, 2**16, (9, 4), dtype=np.uint16), 9),
        # state_dtype=int8: the int8 states and their float32 scales (one column for final's)
        (rng.integers(-127, 128, (10, 6), dtype=np.int8), 4),
        (rng.random((10, 3), dtype=np.float32), 10),
        (rng.random((7, 1), dtype=np.float32), 3),
    ]
    for k, (arr, rows) in enumerate(cases):
        # zarr's metadata for the same array
        g = zarr.open_group(zarr_store(str(tmp_path / f"z{k}")), mode="w")
        chunks, shards = ((len(arr),), None)
        if rows:
            chunks, shards = (rows, arr.shape[1]), (-(-len(arr) // rows) * rows, arr.shape[1])
        g.create_array(
            "a", shape=arr.shape, dtype=arr.dtype, chunks=chunks, shards=shards, compressors=None, fill_value=0
        )
        ours = zarr_direct.array_metadata(arr.shape, arr.dtype, rows)
        assert ours == json.loads((tmp_path / f"z{k}" / "a" / "zarr.json").read_text()), arr.dtype
        # ours written, zarr reads it
        path = str(tmp_path / f"d{k}")
        zarr_direct.put(fs, f"{path}/zarr.json", [json.dumps(ours).encode()])
        lay = zarr_direct.layout_of(path, ours)
        zarr_direct.write_whole(fs, lay, arr)
        assert np.array_equal(zarr.open_array(zarr_store(path), mode="r")[...], arr)
        reader = zarr_direct.RowReader(fs, lay)
        for a in range(len(arr)):
            for b in range(a + 1, len(arr) + 1):
                assert np.array_equal(reader.rows(a, b), arr[a:b])

    # zarr's data file with absent (all-zero) inner chunks, read directly
    arr = rng.integers(1, 2**16, (10, 4), dtype=np.uint16)
    arr[3:6] = 0  # inner chunk 1 (rows 3..5) is all fill value: zarr omits it
    g = zarr.open_group(zarr_store(str(tmp_path / "zabsent")), mode="w")
    g.create_array(
        "a", shape=arr.shape, dtype=arr.dtype, chunks=(3, 4), shards=(12, 4), compressors=None, fill_value=0
    )[...] = arr
    path = str(tmp_path / "zabsent" / "a")
    lay = zarr_direct.layout_of(path, json.loads((tmp_path / "zabsent" / "a" / "zarr.json").read_text()))
    assert (zarr_direct.RowReader(fs, lay).index()[1] == -1).all()
    assert np.array_equal(zarr_direct.read_whole(fs, lay), arr)
    assert np.array_equal(zarr_direct.RowReader(fs, lay).rows(2, 8), arr[2:8])
    # An index that points outside the file (with a valid checksum) is refused, not followed.
    import google_crc32c

    blob = bytearray(open(lay.file, "rb").read())
    index = np.frombuffer(bytes(blob[-lay.index_bytes : -4]), dtype="<u8").copy()
    index[0] = len(blob)  # chunk 0's offset: past the end
    blob[-lay.index_bytes :] = index.tobytes() + np.array([google_crc32c.value(index.tobytes())], "<u4").tobytes()
    open(lay.file, "wb").write(bytes(blob))
    with pytest.raises(zarr_direct.CorruptArray, match="points outside the file"):
        zarr_direct.read_whole(fs, lay)
    # A compressed array is not for the direct path: zarr reads it.
    g.create_array("c", shape=(4,), dtype="int32", chunks=(4,), compressors=zarr.codecs.ZstdCodec())
    assert zarr_direct.layout_of("x", json.loads((tmp_path / "zabsent" / "c" / "zarr.json").read_text())) is None


# ---------------------------------------------------------------------------------- manifest: the commit log
def test_commit_writes_one_small_file_and_compaction_folds_the_log(tmp_path, monkeypatch):
    import storage.store as store_mod

    url = str(tmp_path / "s")
    store = HiddenStateStore.create_or_open(url, provenance())
    writes: list[tuple[str, int]] = []
    real = store_mod.write_bytes_atomic
    monkeypatch.setattr(
        store_mod,
        "write_bytes_atomic",
        lambda fs, path, data, **kw: (writes.append((path, len(data))), real(fs, path, data, **kw)),
    )
    sizes = []
    for k in range(12):
        store.write_shard(f"{k:06d}", make_shard([f"x{k}"], [2], seed=k)[0])
        writes.clear()
        store.commit([store.completed_row(f"{k:06d}")])
        assert [p.rsplit("/", 2)[-2:] for p, _ in writes] == [["commits", f"{k:06d}.json"]]  # one log file only
        sizes.append(writes[0][1])
    assert max(sizes) - min(sizes) < 16  # constant per commit, not growing with the store
    assert not (tmp_path / "s" / "manifest.parquet").exists()
    before = store.manifest()
    assert [r["shard"] for r in before] == [f"{k:06d}" for k in range(12)]
    assert store.compact() == 12
    assert not list((tmp_path / "s" / "commits").iterdir())
    assert store.manifest() == before and store.compact() == 0
    assert store.summary() == {"shards": 12, "samples": 12, "tokens": 24, "bytes": before[0]["nbytes"] * 12}
    # A later commit lands in the log again and merges with the parquet.
    store.write_shard("000012", make_shard(["x12"], [2])[0])
    store.commit([store.completed_row("000012")])
    assert [r["shard"] for r in store.manifest()] == [f"{k:06d}" for k in range(13)]
    assert StoreReader(url).sample("x12")["input_ids"].tolist() == [0, 1]


def test_crash_at_any_compaction_step_gives_the_same_manifest(tmp_path, monkeypatch):
    url = str(tmp_path / "s")
    store = HiddenStateStore.create_or_open(url, provenance())
    for k in range(3):
        store.commit([store.write_shard(f"{k:06d}", make_shard([f"x{k}"], [3], seed=k)[0])])
    store.write_shard("000009", make_shard(["never"], [3])[0])  # written, never committed
    (tmp_path / "s" / "commits" / "000009.json.tmp-123").write_text("{")  # a killed atomic write's temp file
    logged = store.manifest()  # (1) crash before compaction: the log alone
    assert [r["shard"] for r in logged] == ["000000", "000001", "000002"]
    # (2) crash after the parquet was written, before the log files were removed
    log = {p.name: p.read_bytes() for p in (tmp_path / "s" / "commits").glob("*.json")}
    monkeypatch.setattr(store.fs, "rm", lambda *a, **k: (_ for _ in ()).throw(OSError("killed")))
    with pytest.raises(OSError, match="killed"):
        store.compact()
    monkeypatch.undo()
    assert (tmp_path / "s" / "manifest.parquet").exists()
    assert len(list((tmp_path / "s" / "commits").glob("*.json"))) == 3
    assert store.manifest() == logged and StoreReader(url).sample_ids == ["x0", "x1", "x2"]
    # (3) compacted and cleaned; the same again; a leftover log copy changes nothing either
    store.compact()
    assert store.manifest() == logged
    (tmp_path / "s" / "commits" / "000001.json").write_bytes(log["000001.json"])
    assert store.manifest() == logged
    # A corrupt log file is an error, never a silently missing shard.
    (tmp_path / "s" / "commits" / "000002.json").write_text("{not json")
    with pytest.raises(StoreError, match="commit log file .*000002.json"):
        store.manifest()


# ---------------------------------------------------------------------------------- streaming
def split_store(tmp_path):
    """train/heldout-named shards and an old-style name; returns (url, {shard: [(id, length)]})."""
    url = str(tmp_path / "s")
    store = HiddenStateStore.create_or_open(url, provenance())
    layout = {
        "heldout-000000-aaaa": [("h0", 3), ("h1", 2)],
        "train-000000-bbbb": [(f"t{i}", 2 + i % 3) for i in range(8)],
        "train-000001-cccc": [("u0", 4), ("u1", 1)],
        "000003-dddd": [("o0", 2)],
    }
    for k, (name, samples) in enumerate(layout.items()):
        data, _, _ = make_shard([s for s, _ in samples], [n for _, n in samples], seed=k)
        store.commit([store.write_shard(name, data, chunk_bytes=100)])
    return url, layout


def test_shard_names_by_split_and_iter_samples_equal_sample(tmp_path):
    url, layout = split_store(tmp_path)
    store = HiddenStateStore.open(url)
    data, _, _ = make_shard(["v0"], [2])
    store.commit([store.write_shard("zzz", data, split="heldout")])  # a split given by the writer
    store.compact()
    reader = StoreReader(url)
    assert reader.shard_names("train") == ["train-000000-bbbb", "train-000001-cccc"]
    assert reader.shard_names("heldout") == ["heldout-000000-aaaa", "zzz"]
    assert reader.shard_names() == reader.shard_names("all") == sorted([*layout, "zzz"])  # manifest order
    assert reader.shard_names("nope") == []
    assert {r["shard"]: r["split"] for r in reader.shards}["zzz"] == "heldout"
    names = reader.shard_names("train")
    got = list(reader.iter_samples(names, prefetch=False))
    assert [s["id"] for s in got] == [i for n in names for i, _ in layout[n]]  # shard order, sample order
    for s in got + list(reader.iter_samples(reader.shard_names())):
        ref = reader.sample(s["id"])
        assert set(s) == set(ref)
        for key in ("input_ids", "loss_mask", "aux", "final"):
            assert s[key].dtype == ref[key].dtype and torch.equal(s[key], ref[key]), (s["id"], key)
    # Shuffled within each shard, the same way for the same seed, shards still in order.
    a = [s["id"] for s in reader.iter_samples(names, seed=7)]
    assert a == [s["id"] for s in StoreReader(url).iter_samples(names, seed=7)]
    assert a != [s["id"] for s in got] and a != [s["id"] for s in reader.iter_samples(names, seed=8)]
    assert sorted(a[:8]) == sorted(i for i, _ in layout[names[0]]) and sorted(a[8:]) == ["u0", "u1"]
    with pytest.raises(StoreError, match="'nope' is not committed"):
        list(reader.iter_samples(["nope"]))


def test_constructing_a_reader_opens_no_shard(tmp_path, monkeypatch):
    url, layout = split_store(tmp_path)

    def refuse(*a, **k):
        raise AssertionError("a shard was opened")

    monkeypatch.setattr(HiddenStateStore, "open_shard", refuse)
    monkeypatch.setattr(HiddenStateStore, "shard_attrs", refuse)
    reader = StoreReader(url)
    assert len(reader) == 13 and reader.shard_names("heldout") == ["heldout-000000-aaaa"]
    monkeypatch.undo()
    assert sorted(reader.sample_ids) == sorted(i for v in layout.values() for i, _ in v)  # the index, lazily


def corrupt(tmp_path, name, how):
    shard = tmp_path / "s" / "shards" / name
    if how == "deleted":
        import shutil

        shutil.rmtree(shard)
    elif how == "truncated":
        f = shard / "aux" / "c" / "0" / "0"
        f.write_bytes(f.read_bytes()[:-30])
    elif how == "missing file":
        (shard / "final" / "c" / "0" / "0").unlink()
    elif how == "unreadable array":
        (shard / "aux" / "zarr.json").write_text("{broken")
    elif how == "bad offsets":
        off = np.frombuffer((shard / "offsets" / "c" / "0").read_bytes(), dtype="<i8").copy()
        off[1], off[2] = off[2], off[1]  # not increasing
        (shard / "offsets" / "c" / "0").write_bytes(off.tobytes())
    elif how == "incomplete":
        import zarr

        from storage.zarr_io import zarr_store

        zarr.open_group(zarr_store(str(shard)), mode="r+").attrs["complete"] = False


@pytest.mark.parametrize(
    "how,problem",
    [
        ("deleted", "shard group is missing"),
        ("truncated", "truncated|checksum"),
        ("missing file", "missing"),
        ("unreadable array", "array aux metadata is unreadable"),
        ("bad offsets", "offsets .* do not split"),
        ("incomplete", "never marked it complete"),
    ],
)
def test_corrupt_shard_raises_naming_it_or_is_skipped_and_counted(tmp_path, how, problem):
    url, layout = split_store(tmp_path)
    bad = "train-000000-bbbb"
    corrupt(tmp_path, bad, how)
    reader = StoreReader(url)  # constructing opens no shard: the corruption is not seen yet
    assert len(reader) == sum(len(v) for v in layout.values())
    with pytest.raises(StoreError, match=rf"store {url}: shard {bad}: .*({problem})"):
        list(reader.iter_samples(reader.shard_names()))
    skipping = StoreReader(url, on_corrupt="skip")
    ids = [s["id"] for s in skipping.iter_samples(skipping.shard_names())]
    assert ids == [i for n in sorted(layout) if n != bad for i, _ in layout[n]]  # every other shard, whole
    assert list(skipping.skipped) == [bad] and bad in skipping.skipped[bad]


def test_sample_of_a_corrupt_shard_raises_naming_it(tmp_path):
    url, _ = split_store(tmp_path)
    corrupt(tmp_path, "train-000000-bbbb", "truncated")
    reader = StoreReader(url, on_corrupt="skip")  # skipping is for streaming only
    assert reader.sample("u0")["input_ids"].shape == (4,)
    with pytest.raises(StoreError, match="shard train-000000-bbbb: sample 't7' unreadable: .*truncated"):
        reader.sample("t7")
    corrupt(tmp_path, "train-000001-cccc", "deleted")
    with pytest.raises(StoreError, match="shard train-000001-cccc: group metadata missing"):
        StoreReader(url).index  # the sample index is built on first use


def test_streaming_a_compressed_store_goes_through_zarr(tmp_path):
    url = str(tmp_path / "s")
    store = HiddenStateStore.create_or_open(url, provenance())
    data, aux, final = make_shard(["a", "b", "c"], [30, 20, 5])
    store.commit([store.write_shard("000000", data, compression="zstd:1", chunk_bytes=200)])
    reader = StoreReader(url)
    got = {s["id"]: s for s in reader.iter_samples(["000000"])}
    assert torch.equal(got["b"]["aux"], aux[30:50].to(torch.bfloat16))
    assert torch.equal(got["c"]["final"], final[50:].to(torch.bfloat16))
    assert torch.equal(reader.sample("b")["final"], final[30:50].to(torch.bfloat16))
