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
    prov = {"target_path": "/t", "target_weights_sha256": "abc", "num_layers": 6,
            "hidden_size": H, "capture_layer_ids": IDS, "layer_id_convention": "output_of_layer",
            "state_dtype": "bfloat16", "final_is_normed": True, "tokenizer_sha256": "tok",
            "chat_template_sha256": "tpl", "backend": "hf", "plan": {"shard_samples": 3},
            "target": {"vocab_size": 100}}
    prov.update(over)
    return prov


def make_shard(ids, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    aux = torch.randn(t, len(IDS) * H, generator=g)
    final = torch.randn(t, H, generator=g)
    data = ShardData(sample_ids=list(ids), input_ids=np.arange(t, dtype=np.int32) % 100,
                     loss_mask=(np.arange(t) % 2).astype(np.uint8),
                     offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
                     aux=to_bf16_bits(aux), final=to_bf16_bits(final))
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
        opts = {"key": "testing", "secret": "testing", "endpoint_url": endpoint,
                "client_kwargs": {"region_name": "us-east-1"}}
        url = "s3://states/run1/store"
        store = HiddenStateStore.create_or_open(url, provenance(), storage_options=opts)
        data, aux, final = make_shard(["a", "b"], [4, 6])
        store.commit([store.write_shard("000000", data, chunk_bytes=100)])
        reader = StoreReader(url, storage_options=opts)
        assert torch.equal(reader.sample("b")["aux"], aux[4:].to(torch.bfloat16))
        assert torch.equal(reader.sample("a")["final"], final[:4].to(torch.bfloat16))
        assert verify(url, storage_options=opts)["ok"]
        with pytest.raises(ProvenanceMismatch, match="'backend'"):
            HiddenStateStore.create_or_open(url, provenance(backend="sglang"), storage_options=opts)
    finally:
        server.stop()
