"""``s3://bucket/prefix`` models: the small files (config, tokenizer) fetched to a local folder,
the safetensors shards left in the store (read into memory by the loader) or cached whole with
``--download-dir``; ``lightwell download``. No torch here: the engine resolves models with it."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from typing import Any

from lightwell.model_files import ModelFiles
from lightwell.storage.object_store import (
    ObjectStore,
    ObjectStoreError,
    StoredObject,
    StoreOptions,
    parse_uri,
)

INDEX_FILE = "model.safetensors.index.json"
# bytes per element of each safetensors dtype (the cache check reads headers without torch)
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
             "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}  # fmt: skip
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")
_TEMP_DIRS: list[tempfile.TemporaryDirectory] = []  # removed at interpreter exit


@dataclass(frozen=True)
class RemoteModel:
    uri: str
    options: StoreOptions


def cache_folder(download_dir: str, uri: str) -> str:
    bucket, prefix = parse_uri(uri)
    return os.path.join(os.path.abspath(os.path.expanduser(download_dir)), bucket, prefix)


def resolve_remote(uri: str, options: StoreOptions, progress: bool = True) -> ModelFiles:
    """The model's files: a cached local folder (``options.download_dir``), or a temporary
    folder of its small files with the shards left in the store (``ModelFiles.remote``)."""
    store = ObjectStore(uri, options)
    objects = store.list()
    if "config.json" not in objects:
        raise ObjectStoreError(
            f"{store.uri}: no config.json (Lightwell loads HF safetensors folders from object "
            "storage)"
        )
    name = store.prefix.rsplit("/", 1)[-1] or store.bucket
    small = [o for o in objects.values() if not o.name.endswith(WEIGHT_SUFFIXES)]
    if options.download_dir:
        folder = cache_folder(options.download_dir, uri)
        os.makedirs(folder, exist_ok=True)
        _fetch(store, small, folder, progress=False)
        shards = shard_objects(objects, folder, store.uri)
        _fetch(store, shards, folder, progress=progress)
        for obj in shards:
            _check_cached(os.path.join(folder, obj.name), store.where(obj.name))
        return ModelFiles("hf", folder, name)
    tmp = tempfile.TemporaryDirectory(prefix="lightwell-model-")
    _TEMP_DIRS.append(tmp)
    _fetch(store, small, tmp.name, progress=False)
    shard_objects(objects, tmp.name, store.uri)  # a shard the index names must exist
    return ModelFiles("hf", tmp.name, name, remote=RemoteModel(store.uri, options))


def shard_objects(objects: dict[str, StoredObject], folder: str, uri: str) -> list[StoredObject]:
    """The shards to load: those the index (already in ``folder``) names, else every
    ``*.safetensors`` object."""
    index = os.path.join(folder, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f).get("weight_map", {}).values()))
        missing = [n for n in names if n not in objects]
        if missing:
            raise ObjectStoreError(f"{uri}: {INDEX_FILE} names missing shard(s): {missing}")
    else:
        names = sorted(n for n in objects if n.endswith(".safetensors"))
    if not names:
        raise ObjectStoreError(f"{uri}: no .safetensors objects under this prefix")
    return [objects[n] for n in names]


def _fetch(store: ObjectStore, objs: list[StoredObject], folder: str, progress: bool) -> int:
    bar = progress_bar(sum(o.size for o in objs), "Downloading", progress)
    moved = 0
    try:
        for obj in objs:
            moved += store.download(obj, os.path.join(folder, obj.name), bar)
    finally:
        bar.close()
    return moved


def progress_bar(total: int, desc: str, progress: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(
        total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
        disable=None if progress else True, leave=False,
    )  # fmt: skip


def _check_cached(path: str, where: str) -> None:
    """ObjectStoreError unless the cached shard's header parses and its tensors fit the file."""
    total = os.path.getsize(path)
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little") if total >= 8 else -1
        header = f.read(n) if 0 <= n <= total - 8 else b""
    try:
        entries = json.loads(header) if header else None
        entries.pop("__metadata__", None)
        ends = [8 + n + int(e["data_offsets"][1]) for e in entries.values()]
        sizes = [_ITEMSIZE[e["dtype"]] for e in entries.values()]
    except (AttributeError, KeyError, TypeError, ValueError, UnicodeDecodeError):
        ends, sizes = None, None
    if ends is None or (ends and max(ends) > total) or len(sizes) != len(ends):
        raise ObjectStoreError(f"{where}: corrupt or truncated safetensors file")


def download_model(uri: str, options: StoreOptions) -> str:
    """``lightwell download``: cache the model under the download dir; returns its folder."""
    if not options.download_dir:
        raise ObjectStoreError("lightwell download needs --download-dir")
    return resolve_remote(uri, options).path
