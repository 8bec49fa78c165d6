"""Objects in S3-compatible storage: listing, parallel ranged GETs into host memory, and a
download cache that is reused while the objects' ETags and sizes match and resumed after an
interruption. boto3 is imported when a store is first used; credentials come from boto3's own
chain (environment, shared files, instance or pod roles) and are never logged. No torch here.
"""

from __future__ import annotations

import json
import os
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

CHUNK_BYTES = 8 << 20  # one ranged GET
READ_BYTES = 1 << 20  # one read from a response body
RETRIES = 3  # per ranged GET whose body breaks off (botocore retries the requests themselves)
CACHE_META = ".lightwell-cache"  # per-file {"etag", "size"} records inside a cached folder


class ObjectStoreError(RuntimeError):
    """A model in object storage cannot be read: one line, printed without a traceback."""


@dataclass(frozen=True)
class StoreOptions:
    endpoint_url: str | None = None  # None: AWS S3 (or the AWS_ENDPOINT_URL* settings)
    max_connections: int = 8  # parallel ranged GETs per object
    download_dir: str | None = None  # None: weights go to host memory only


@dataclass(frozen=True)
class StoredObject:
    key: str
    size: int
    etag: str

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1]


def store_options(model_config: Any) -> StoreOptions:
    """The object-storage options of a ModelConfig."""
    m = model_config
    return StoreOptions(m.s3_endpoint_url, m.s3_max_connections, m.download_dir)


def is_object_uri(model: str | None) -> bool:
    return model is not None and model.startswith("s3://")


def parse_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/prefix`` -> (bucket, prefix without a trailing slash)."""
    if not is_object_uri(uri):
        raise ObjectStoreError(f"{uri!r} is not an s3://bucket/prefix address")
    bucket, _, prefix = uri[len("s3://") :].partition("/")
    if not bucket:
        raise ObjectStoreError(f"{uri!r} names no bucket (expected s3://bucket/prefix)")
    return bucket, prefix.strip("/")


_MESSAGES = {
    "NoSuchBucket": "bucket {bucket!r} does not exist",
    "NoSuchKey": "object not found",
    "404": "object not found",
    "InvalidAccessKeyId": "the access key is not valid for this store (check the credentials)",
    "SignatureDoesNotMatch": "the secret key does not match the access key (check the credentials)",
    "ExpiredToken": "the credentials have expired",
    "AccessDenied": "access denied (the credentials lack permission for this bucket)",
    "403": "access denied (check the credentials and the bucket's policy)",
    "PreconditionFailed": "the object changed while it was being read (its ETag moved): retry",
    "412": "the object changed while it was being read (its ETag moved): retry",
}


@contextmanager
def _translated(where: str, bucket: str) -> Iterator[None]:
    """botocore's exceptions -> one-line ObjectStoreErrors naming ``where``."""
    from botocore import exceptions as bx

    try:
        yield
    except bx.ClientError as e:
        error = e.response.get("Error", {})
        code = str(error.get("Code", ""))
        if code in _MESSAGES:
            msg = _MESSAGES[code].format(bucket=bucket)
        else:
            msg = f"{code}: {error.get('Message', e)}"
        raise ObjectStoreError(f"{where}: {msg}") from None
    except bx.NoCredentialsError:
        raise ObjectStoreError(
            f"{where}: no credentials found (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
            "AWS_PROFILE, or use an instance or pod role)"
        ) from None
    except (bx.EndpointConnectionError, bx.ConnectionClosedError) as e:
        raise ObjectStoreError(f"{where}: cannot reach the store: {e}") from None
    except bx.BotoCoreError as e:
        raise ObjectStoreError(f"{where}: {e}") from None


class ObjectStore:
    """The objects directly under one ``s3://bucket/prefix``."""

    def __init__(self, uri: str, options: StoreOptions | None = None):
        self.uri = uri.rstrip("/")
        self.bucket, self.prefix = parse_uri(uri)
        self.options = options or StoreOptions()
        if self.options.max_connections < 1:
            raise ObjectStoreError("s3_max_connections must be >= 1")
        self._client: Any = None
        self._lock = threading.Lock()

    @property
    def client(self) -> Any:
        with self._lock:
            if self._client is None:
                self._client = self._make_client()
            return self._client

    def _make_client(self) -> Any:
        import boto3
        from botocore.config import Config

        config = Config(
            max_pool_connections=self.options.max_connections + 2,
            retries={"max_attempts": RETRIES + 2, "mode": "standard"},
        )
        with _translated(self.uri, self.bucket):
            return boto3.session.Session().client(
                "s3", endpoint_url=self.options.endpoint_url, config=config
            )

    def where(self, name: str = "") -> str:
        return f"{self.uri}/{name}" if name else self.uri

    def list(self) -> dict[str, StoredObject]:
        """File name -> object, for the objects directly under the prefix."""
        start = f"{self.prefix}/" if self.prefix else ""
        found: dict[str, StoredObject] = {}
        with _translated(self.uri, self.bucket):
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=start, Delimiter="/"
            )
            for page in pages:
                for item in page.get("Contents", []):
                    obj = StoredObject(item["Key"], int(item["Size"]), item["ETag"].strip('"'))
                    if obj.name:
                        found[obj.name] = obj
        if not found:
            raise ObjectStoreError(f"{self.uri}: no objects under this prefix")
        return found

    def read(self, obj: StoredObject, bar: Any = None) -> Any:
        """The whole object in a fresh uint8 numpy array, fetched by parallel ranged GETs."""
        import numpy as np

        out = np.empty(obj.size, dtype=np.uint8)
        view = memoryview(out)
        ranges = _ranges(0, obj.size)
        if len(ranges) <= 1:
            for lo, hi in ranges:
                self._get_into(obj, lo, hi, view[lo:hi], bar)
            return out
        with ThreadPoolExecutor(min(self.options.max_connections, len(ranges))) as pool:
            futures = [
                pool.submit(self._get_into, obj, lo, hi, view[lo:hi], bar) for lo, hi in ranges
            ]
            for f in futures:
                f.result()
        return out

    def read_range(self, obj: StoredObject, lo: int, hi: int) -> bytes:
        buf = bytearray(hi - lo)
        self._get_into(obj, lo, hi, memoryview(buf), None)
        return bytes(buf)

    def download(self, obj: StoredObject, dest: str, bar: Any = None) -> int:
        """Make ``dest`` a copy of ``obj``; returns the bytes transferred (0 when the cached
        copy's ETag and size match; the missing tail only when a partial copy of the same
        ETag is there). Processes sharing the folder take turns per file."""
        if cached_matches(dest, obj):
            return 0
        with _exclusive(_meta_path(dest) + ".lock"):
            if cached_matches(dest, obj):  # another process fetched it meanwhile
                return 0
            return self._download(obj, dest, bar)

    def _download(self, obj: StoredObject, dest: str, bar: Any) -> int:
        partial = dest + ".partial"
        start = _resume_offset(partial, obj)
        _write_meta(partial, obj)
        ranges = _ranges(start, obj.size)
        workers = min(self.options.max_connections, max(len(ranges), 1))
        with open(partial, "ab") as f, ThreadPoolExecutor(workers) as pool:
            fetch = lambda r: self.read_range(obj, *r)
            for (lo, hi), data in zip(ranges, _in_order(pool, fetch, ranges, 2 * workers)):
                f.write(data)
                if bar is not None:
                    bar.update(hi - lo)
        if os.path.getsize(partial) != obj.size:
            raise ObjectStoreError(f"{self.where(obj.name)}: download ended short of its size")
        os.replace(partial, dest)
        _write_meta(dest, obj)
        os.remove(_meta_path(partial))
        return obj.size - start

    def _get_into(self, obj: StoredObject, lo: int, hi: int, view: Any, bar: Any) -> None:
        """Bytes [lo, hi) of ``obj`` into ``view``, retrying a body that breaks off."""
        from botocore import exceptions as bx
        from urllib3 import exceptions as ux

        where = self.where(obj.name)
        for attempt in range(RETRIES):
            with _translated(where, self.bucket):
                resp = self.client.get_object(
                    Bucket=self.bucket, Key=obj.key, Range=f"bytes={lo}-{hi - 1}",
                    IfMatch=f'"{obj.etag}"',
                )  # fmt: skip
            try:
                done = _copy_body(resp["Body"], view)
            except (bx.BotoCoreError, ux.HTTPError, OSError):
                if attempt == RETRIES - 1:
                    raise ObjectStoreError(
                        f"{where}: the connection broke off {RETRIES} times"
                    ) from None
                continue
            if done != hi - lo:
                raise ObjectStoreError(f"{where}: bytes {lo}-{hi} came back {done} long")
            if bar is not None:
                bar.update(done)
            return


def _copy_body(body: Any, view: Any) -> int:
    done = 0
    try:
        while done < len(view):
            data = body.read(min(READ_BYTES, len(view) - done))
            if not data:
                break
            view[done : done + len(data)] = data
            done += len(data)
    finally:
        body.close()
    return done


def _ranges(start: int, size: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + CHUNK_BYTES, size)) for lo in range(start, size, CHUNK_BYTES)]


def _in_order(
    pool: ThreadPoolExecutor, fn: Callable[[Any], bytes], items: list[Any], window: int
) -> Iterator[bytes]:
    """``fn(item)`` for each item, computed ``window`` ahead on ``pool``, yielded in order."""
    pending: deque[Future] = deque()
    todo = iter(items)
    for item in todo:
        pending.append(pool.submit(fn, item))
        if len(pending) >= window:
            break
    while pending:
        result = pending.popleft().result()
        nxt = next(todo, None)
        if nxt is not None:
            pending.append(pool.submit(fn, nxt))
        yield result


@contextmanager
def _exclusive(lock_path: str) -> Iterator[None]:
    import fcntl

    os.makedirs(os.path.dirname(lock_path), exist_ok=True)
    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _meta_path(path: str) -> str:
    folder, name = os.path.split(path)
    return os.path.join(folder, CACHE_META, name + ".json")


def _read_meta(path: str) -> dict | None:
    try:
        with open(_meta_path(path)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _write_meta(path: str, obj: StoredObject) -> None:
    meta = _meta_path(path)
    os.makedirs(os.path.dirname(meta), exist_ok=True)
    with open(meta, "w") as f:
        json.dump({"etag": obj.etag, "size": obj.size}, f)


def cached_matches(path: str, obj: StoredObject) -> bool:
    """``path`` holds ``obj``: recorded ETag and size match, and the file has that size."""
    meta = _read_meta(path)
    return (
        meta == {"etag": obj.etag, "size": obj.size}
        and os.path.isfile(path)
        and os.path.getsize(path) == obj.size
    )


def _resume_offset(partial: str, obj: StoredObject) -> int:
    """Bytes of a partial download of this very object (same ETag) to keep; 0 otherwise."""
    meta = _read_meta(partial)
    if (
        meta == {"etag": obj.etag, "size": obj.size}
        and os.path.isfile(partial)
        and os.path.getsize(partial) <= obj.size
    ):
        return os.path.getsize(partial)
    if os.path.exists(partial):
        os.remove(partial)
    return 0
