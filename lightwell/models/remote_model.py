"""Shards of an ``s3://`` model read into host memory (parallel ranged GETs) and handed to the
loader as tensors; the model's files themselves are resolved by ``lightwell.storage.remote``."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

from lightwell.models.safetensors_loader import header_length, parse_header, tensors_from_buffer
from lightwell.storage.object_store import ObjectStore, ObjectStoreError, StoredObject
from lightwell.storage.remote import RemoteModel, progress_bar, shard_objects


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
        bar = progress_bar(obj.size, f"Reading {obj.name}", self.progress)
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
