"""Reading the store: random access by sample and streaming by shard (the trainer).

Only shards listed in the manifest are visible. States come back as torch bfloat16
tensors whatever the store's scheme (storage.states): a bf16 store's stored bit patterns
reinterpreted, never rounded again; an int8 store's values dequantised here, on the CPU
(q * scale in float32, rounded once to bf16), or with `iter_samples(..., dequantize=False)`
left as stored (int8 + float32 scales) for the trainer, which dequantises them on its
device after the copy (storage.states.decode_batch): half the bytes cross, and a GPU does
the multiply. A scheme this code does not know is refused.

Uncompressed arrays are read with plain file I/O in Zarr's own layout (storage.
zarr_direct): a whole shard's array in one read, a sample's rows in one ranged read.
Compressed arrays (or layouts zarr_direct does not handle) go through zarr.

    reader = StoreReader(url)                       # reads the manifest only
    names = reader.shard_names("train")             # manifest order; split from the name prefix
    for s in reader.iter_samples(names[rank::world], seed=epoch):   # one worker's part
        ...                                         # s: id, input_ids, loss_mask, aux, final
"""

from __future__ import annotations

import json
import zlib
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import numpy as np
import torch

from storage import zarr_direct
from storage.states import STATE_ARRAYS, decode_states, state_shapes, states_as_tensors
from storage.store import HiddenStateStore, StoreError, sample_ids_hash, split_of, state_dtype_of

TOKEN_ARRAYS = ("input_ids", "loss_mask", "offsets")


class _ZarrArray:
    """Zarr's read path, with zarr_direct's interface (compressed or other layouts)."""

    def __init__(self, arr):
        self.arr = arr

    def whole(self) -> np.ndarray:
        return self.arr[...]

    def rows(self, a: int, b: int) -> np.ndarray:
        return self.arr[a:b]


class _DirectArray:
    def __init__(self, fs, lay: zarr_direct.Layout):
        self.fs, self.lay, self.rows = fs, lay, zarr_direct.RowReader(fs, lay).rows

    def whole(self) -> np.ndarray:
        return zarr_direct.read_whole(self.fs, self.lay)


def aux_slots(stored: list[int], wanted: list[int] | None, url: str) -> list[int] | None:
    """Positions of the `wanted` capture ids among the `stored` ones (None: all, as stored);
    ids the store lacks are refused, naming them."""
    if wanted is None or list(wanted) == stored:
        return None
    missing = [i for i in wanted if i not in stored]
    if missing:
        raise StoreError(
            f"store {url}: it holds capture ids {stored}, the draft reads {list(wanted)}: {missing} are not "
            "captured. Capture a store with them (capture.families lists every drafter family a store must "
            "serve, e.g. capture.families=[eagle3,dflash]), or train the family the store was captured for"
        )
    return [stored.index(i) for i in wanted]


def sample_order(count: int, shard: str, seed: int | None):
    """The order a shard's samples are read in: as stored, or with `seed` shuffled the same
    way for a given (seed, shard name) whichever worker reads it."""
    if seed is None:
        return range(count)
    return np.random.default_rng([seed, zlib.crc32(shard.encode())]).permutation(count)


def shard_samples(shard: dict, state_dtype: str, order) -> Iterator[dict]:
    """The samples of one shard whose states are tensors already (`states_as_tensors`), in
    `order`: views into the shard's buffers. The store's reader and the streaming train
    source (which receives shards from engine actors) both cut shards into samples here."""
    ids, off = shard["sample_ids"], shard["offsets"]
    input_ids = torch.from_numpy(shard["input_ids"].astype(np.int64))
    loss_mask = torch.from_numpy(shard["loss_mask"].astype(np.int64))
    states = {k: shard[k] for k in STATE_ARRAYS[state_dtype] if k in shard}
    for k in order:
        a, b = int(off[k]), int(off[k + 1])
        yield {
            "id": ids[k],
            "input_ids": input_ids[a:b],
            "loss_mask": loss_mask[a:b],
            **{key: v[a:b] for key, v in states.items()},
        }


class StoreReader:
    """`on_corrupt="error"` (default): a committed shard that is missing or corrupt raises
    StoreError naming the store, the shard and the problem. `"skip"`: streaming
    (`iter_shards`, `iter_samples`) passes over it and records it in `skipped`
    ({shard: problem}); nothing is logged here. `sample()` always raises.

    `aux_layers`: the capture ids to hand out, in this order, of those the store holds (a
    store may hold the union of several drafters' layers, each reading its own): `aux` (and
    an int8 store's `aux_scale`) then holds those layers only. An id the store lacks is
    refused, naming it. None: every stored layer."""

    def __init__(
        self,
        url: str,
        storage_options: dict | None = None,
        expect: dict | None = None,
        on_corrupt: str = "error",
        aux_layers: list[int] | None = None,
    ):
        if on_corrupt not in ("error", "skip"):
            raise ValueError(f"on_corrupt={on_corrupt!r}: use 'error' or 'skip'")
        self.store = HiddenStateStore.open(url, storage_options, expect=expect)
        self.provenance = self.store.provenance
        self._aux_slots = aux_slots(list(self.provenance["capture_layer_ids"]), aux_layers, self.store.url)
        self.state_dtype = state_dtype_of(self.provenance, f"store {self.store.url}")
        self.arrays = (*TOKEN_ARRAYS, *STATE_ARRAYS[self.state_dtype])  # what each shard group holds
        self.shards = self.store.manifest()  # committed rows, in manifest (shard name) order
        self._rows = {r["shard"]: r for r in self.shards}
        self.on_corrupt = on_corrupt
        self.skipped: dict[str, str] = {}
        self._index: dict[str, tuple[str, int]] | None = None
        # sample(): the last 64 shards' array readers and offsets
        self._open: OrderedDict[str, tuple[dict, np.ndarray]] = OrderedDict()

    @property
    def url(self) -> str:
        return self.store.url

    # ------------------------------------------------------------------ errors
    def _error(self, name: str, problem: str) -> StoreError:
        return StoreError(f"store {self.store.url}: shard {name}: {problem}")

    def _row(self, name: str) -> dict:
        if name not in self._rows:
            raise StoreError(f"store {self.store.url}: shard {name!r} is not committed (not in the manifest)")
        return self._rows[name]

    # ------------------------------------------------------------------ random access by sample
    @property
    def index(self) -> dict[str, tuple[str, int]]:
        """sample id -> (shard, position); built on first use from the shards' group metadata
        (one small JSON read per shard; no array is opened)."""
        if self._index is None:
            fs, base = self.store.fs, self.store.path
            paths = [f"{base}/shards/{r['shard']}/zarr.json" for r in self.shards]
            blobs = fs.cat(paths, on_error="return") if paths else {}  # concurrent on object stores
            index: dict[str, tuple[str, int]] = {}
            for row, path in zip(self.shards, paths):
                name, blob = row["shard"], blobs.get(path)
                try:
                    if not isinstance(blob, bytes):  # the error fs.cat returned for this file
                        raise blob if isinstance(blob, Exception) else FileNotFoundError(path)
                    ids = json.loads(blob)["attributes"]["sample_ids"]
                except Exception as exc:
                    raise self._error(name, f"group metadata missing or unreadable ({type(exc).__name__}: {exc})")
                for k, sid in enumerate(ids):
                    if sid in index:
                        raise StoreError(f"sample {sid!r} is in shards {index[sid][0]} and {name}")
                    index[sid] = (name, k)
            self._index = index
        return self._index

    def __len__(self) -> int:
        return sum(int(r["n_samples"]) for r in self.shards)

    @property
    def sample_ids(self) -> list[str]:
        return list(self.index)

    def _arrays(self, name: str) -> dict:
        """The shard's arrays (`self.arrays`): zarr_direct readers where the layout allows, else zarr's."""
        fs, group_path = self.store.fs, f"{self.store.path}/shards/{name}"
        arrays, group = {}, None
        for key in self.arrays:
            try:
                meta = zarr_direct.read_json(fs, f"{group_path}/{key}/zarr.json")
            except FileNotFoundError:
                raise self._error(name, f"array {key} is missing (no {key}/zarr.json)") from None
            except (OSError, ValueError) as exc:
                raise self._error(name, f"array {key} metadata is unreadable ({exc})") from None
            lay = zarr_direct.layout_of(f"{group_path}/{key}", meta)
            if lay is not None:
                arrays[key] = _DirectArray(fs, lay)
            else:
                if group is None:
                    group = self.store.open_shard(name)
                arrays[key] = _ZarrArray(group[key])
        return arrays

    def sample(self, sample_id: str) -> dict:
        """One sample: input_ids/loss_mask int64 [T], aux bf16 [T, n*H], final bf16 [T, H]."""
        if sample_id not in self.index:
            raise KeyError(f"sample {sample_id!r} is not in a committed shard of {self.store.url}")
        return self._sample(*self.index[sample_id], sample_id)

    def sample_at(self, name: str, k: int) -> dict:
        """The `k`-th sample of committed shard `name`, as `sample()` returns it (reads that
        shard's metadata only, not the whole store's index)."""
        self._row(name)
        try:
            sample_id = self.store.shard_attrs(name)["sample_ids"][k]
        except Exception as exc:
            raise self._error(name, f"no sample {k} ({type(exc).__name__}: {exc})") from None
        return self._sample(name, k, sample_id)

    def _sample(self, name: str, k: int, sample_id: str) -> dict:
        try:
            if name not in self._open:
                arrays = self._arrays(name)
                self._open[name] = (arrays, arrays["offsets"].whole())
                if len(self._open) > 64:
                    self._open.popitem(last=False)
            self._open.move_to_end(name)
            arrays, off = self._open[name]
            a, b = int(off[k]), int(off[k + 1])
            got = {key: arrays[key].rows(a, b) for key in self.arrays if key != "offsets"}
        except StoreError:
            raise
        except Exception as exc:  # missing or truncated file, codec error, bad offsets
            raise self._error(name, f"sample {sample_id!r} unreadable: {type(exc).__name__}: {exc}") from None
        aux, final = decode_states(self._select(got), self.state_dtype)
        return {
            "id": sample_id,
            "input_ids": torch.from_numpy(got["input_ids"].astype(np.int64)),
            "loss_mask": torch.from_numpy(got["loss_mask"].astype(np.int64)),
            "aux": aux,
            "final": final,
        }

    # ------------------------------------------------------------------ streaming by shard
    def shard_names(self, split: str | None = None) -> list[str]:
        """Committed shards in manifest order; of one split (`"train"`, `"heldout"`: the row's
        `split`, else the name's prefix) or all of them (None or "all"). Shards of stores
        written before splits were named have no split: only None/"all" lists them."""
        if split in (None, "all"):
            return [r["shard"] for r in self.shards]
        return [r["shard"] for r in self.shards if split_of(r) == split]

    def read_shard(self, name: str) -> dict:
        """One committed shard whole and checked: numpy arrays as stored (bf16 still as uint16
        bits; int8 with `aux_scale`/`final_scale`) plus `shard` and `sample_ids`. Raises
        StoreError naming the store, shard and problem."""
        row = self._row(name)
        prov = self.provenance
        try:
            attrs = self.store.shard_attrs(name)
        except FileNotFoundError:
            raise self._error(name, "the shard group is missing (no zarr.json; deleted?)") from None
        except (OSError, ValueError) as exc:
            raise self._error(name, f"the shard group metadata is unreadable ({exc})") from None
        if not attrs.get("complete"):
            raise self._error(name, "committed but its writer never marked it complete")
        ids = list(attrs.get("sample_ids") or [])
        if sample_ids_hash(ids) != row["sample_ids_sha256"]:
            raise self._error(name, "its sample ids differ from the manifest's hash")
        try:
            out = {key: arr.whole() for key, arr in self._arrays(name).items()}
        except StoreError:
            raise
        except Exception as exc:  # missing/truncated file, bad index, codec error
            raise self._error(name, f"unreadable: {exc}") from None
        t, n, h = int(row["n_tokens"]), len(ids), prov["hidden_size"]
        expected = {
            "input_ids": (t,),
            "loss_mask": (t,),
            "offsets": (n + 1,),
            **state_shapes(self.state_dtype, t, len(prov["capture_layer_ids"]), h),
        }
        for key, shape in expected.items():
            if out[key].shape != shape:
                raise self._error(name, f"{key} shape {out[key].shape} != {shape} (manifest: {n} samples, {t} tokens)")
        for key, dtype in STATE_ARRAYS[self.state_dtype].items():
            if out[key].dtype != dtype:
                raise self._error(
                    name, f"{key} is {out[key].dtype}, not {np.dtype(dtype)} (state_dtype {self.state_dtype})"
                )
        off = out["offsets"]
        if off[0] != 0 or off[-1] != t or np.any(np.diff(off) <= 0):
            raise self._error(name, f"offsets {off.tolist()[:8]}... do not split {t} tokens into {n} non-empty samples")
        return {"shard": name, "sample_ids": ids, **self._select(out)}

    def _select(self, arrays: dict) -> dict:
        """`aux_layers`' columns of the aux states (and of their int8 scales)."""
        if self._aux_slots is None:
            return arrays
        h, slots = self.provenance["hidden_size"], self._aux_slots
        arrays = dict(arrays)
        aux = arrays["aux"]
        arrays["aux"] = np.concatenate([aux[:, k * h : (k + 1) * h] for k in slots], axis=1)
        if "aux_scale" in arrays:
            arrays["aux_scale"] = np.ascontiguousarray(arrays["aux_scale"][:, slots])
        return arrays

    def _stream(self, names: list[str], prefetch: bool, decode: bool | None = None) -> Iterator[dict]:
        """Checked shards in order; corrupt ones per `on_corrupt`. With `prefetch` the next
        shard is read (and with `decode`, its states made tensors) in the background while
        the caller works on this one: two shards in memory (plus what the caller keeps)."""
        for name in names:
            self._row(name)  # an unknown name fails before anything is read
        if not prefetch:
            for name in names:
                shard = self._read_or_skip(name, decode)
                if shard is not None:
                    yield shard
                del shard
            return
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-prefetch") as pool:
            pending = pool.submit(self._read_or_skip, names[0], decode) if names else None
            for k in range(len(names)):
                shard = pending.result()  # the previous shard was dropped before this
                pending = pool.submit(self._read_or_skip, names[k + 1], decode) if k + 1 < len(names) else None
                if shard is not None:
                    yield shard
                del shard

    def _read_or_skip(self, name: str, decode: bool | None = None) -> dict | None:
        """`read_shard`, or None for a corrupt shard skipped. `decode` True: its states as bf16
        tensors `aux`/`final` (int8 dequantised here: in the prefetch thread); False: as
        tensors of the stored dtypes (int8 and its scales; bf16 bits as bf16); None: numpy
        arrays as stored."""
        try:
            shard = self.read_shard(name)
        except StoreError as exc:
            if self.on_corrupt == "error":
                raise
            self.skipped[name] = str(exc)
            return None
        if decode is not None:
            states = states_as_tensors(shard, self.state_dtype, dequantize=decode)
            shard = {k: v for k, v in shard.items() if k not in STATE_ARRAYS[self.state_dtype]}
            shard.update(states)
        return shard

    def iter_shards(self, shard_names: list[str] | None = None, prefetch: bool = True) -> Iterator[dict]:
        """Whole checked shards (see `read_shard`), in the given order or manifest order."""
        return self._stream(self.shard_names() if shard_names is None else list(shard_names), prefetch)

    def iter_samples(
        self, shard_names: list[str], seed: int | None = None, prefetch: bool = True, dequantize: bool = True
    ) -> Iterator[dict]:
        """The samples of the named shards, as `sample()` gives them, one shard read at a time
        (whole, checked; the next prefetched): in shard order and sample order within a shard,
        or with `seed` (an int >= 0) shuffled within each shard, the same way for a given
        (seed, shard) whichever worker reads it. The tensors are views into the shard's
        buffers: copy (or collate) samples you keep past the shard. With `dequantize=False`
        an int8 store's samples keep `aux`/`final` int8 plus `aux_scale`/`final_scale` float32
        (storage.states.decode_batch makes them bf16, wherever they are then); a bf16 store's
        are bf16 either way."""
        for shard in self._stream(list(shard_names), prefetch, decode=dequantize):
            yield from shard_samples(
                shard, self.state_dtype, sample_order(len(shard["sample_ids"]), shard["shard"], seed)
            )
            del shard  # before the stream reads ahead again
