"""The hidden-state store: Zarr v3, one group per capture shard, committed via a manifest.

    <store>/zarr.json              root group; attributes["provenance"] (see storage.store)
    <store>/shards/<name>/         one capture shard, written whole by one writer
        input_ids int32 [T]   loss_mask uint8 [T]   offsets int64 [n+1]
        aux uint16 [T, n_aux*H]  final uint16 [T, H]   (bf16 bit patterns; state_dtype "bfloat16")
        or aux int8 + aux_scale float32 [T, n_aux], final int8 + final_scale float32 [T, 1]
        (state_dtype "int8": per-row absmax quantisation, storage.states)
        attributes: sample_ids, complete (the writer's marker, set last), stats
    <store>/commits/<name>.json    the commit log: one small file per commit (atomic)
    <store>/manifest.parquet       the log folded by `compact()` (rewritten atomically)

Readers see only committed shards (parquet + log). Uncompressed arrays are read and
written with plain file I/O in Zarr's own layout (storage.zarr_direct); zarr reads them.
"""

from storage.store import HiddenStateStore, ShardData, StoreError  # noqa: F401
