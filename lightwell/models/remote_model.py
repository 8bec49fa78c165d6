"""A model under ``s3://bucket/prefix``: an HF folder (config.json, tokenizer files, safetensors
shards) in object storage.

Without a download dir, the small files go to a temporary folder and the shards are read into
host memory by parallel ranged GETs (the next shard while the current one loads), never written
to disk. With one, every file is cached under ``DIR/bucket/prefix`` (reused while the ETags and
sizes match, resumed after an interruption) and the model loads from there.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from lightwell.models.object_store import (
    ObjectStore,
    ObjectStoreError,
    StoredObject,
    StoreOptions,
    parse_uri,
)
from lightwell.models.paths import ModelFiles
from lightwell.models.safetensors_loader import (
    INDEX_FILE,
    check_safetensors_file,
    header_length,
    parse_header,
    tensors_from_buffer,
)

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
    bar = _bar(sum(o.size for o in objs), "Downloading", progress)
    moved = 0
    try:
        for obj in objs:
            moved += store.download(obj, os.path.join(folder, obj.name), bar)
    finally:
        bar.close()
    return moved


def _bar(total: int, desc: str, progress: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(
        total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
        disable=None if progress else True, leave=False,
    )  # fmt: skip


def _check_cached(path: str, where: str) -> None:
    try:
        check_safetensors_file(path)
    except ValueError as e:
        raise ObjectStoreError(f"{where}: corrupt or truncated safetensors file: {e}") from None


def download_model(uri: str, options: StoreOptions) -> str:
    """``lightwell download``: cache the model under the download dir; returns its folder."""
    if not options.download_dir:
        raise ObjectStoreError("lightwell download needs --download-dir")
    return resolve_remote(uri, options).path


class S3Checkpoint:
    """Iterate ``(source, name, tensor)`` over the shards of a model in object storage, each
    shard read whole into host memory by parallel ranged GETs."""

    def __init__(self, remote: RemoteModel, folder: str, progress: bool = True):
        self.store = ObjectStore(remote.uri, remote.options)
        self.shards = shard_objects(self.store.list(), folder, self.store.uri)
        self.progress = progress
        self._count = sum(len(self._header(obj)) for obj in self.shards)

    def __len__(self) -> int:
        return self._count

    def _header(self, obj: StoredObject) -> dict:
        where = self.store.where(obj.name)
        try:
            n = header_length(self.store.read_range(obj, 0, min(8, obj.size)), obj.size)
            return parse_header(self.store.read_range(obj, 8, 8 + n), obj.size)
        except ValueError as e:
            raise ObjectStoreError(f"{where}: corrupt or truncated safetensors file: {e}") from None

    def _read(self, obj: StoredObject) -> torch.Tensor:
        bar = _bar(obj.size, f"Reading {obj.name}", self.progress)
        try:
            return torch.from_numpy(self.store.read(obj, bar))
        finally:
            bar.close()

    def __iter__(self) -> Iterator[tuple[str, str, torch.Tensor]]:
        with ThreadPoolExecutor(1) as ahead:
            pending = ahead.submit(self._read, self.shards[0])
            for i, obj in enumerate(self.shards):
                buf = pending.result()  # [size] uint8
                if i + 1 < len(self.shards):
                    pending = ahead.submit(self._read, self.shards[i + 1])
                where = self.store.where(obj.name)
                try:
                    tensors = list(tensors_from_buffer(buf))
                except ValueError as e:
                    raise ObjectStoreError(
                        f"{where}: corrupt or truncated safetensors file: {e}"
                    ) from None
                del buf
                for name, tensor in tensors:
                    yield where, name, tensor
                del tensors  # the shard's memory goes before the one after next arrives
