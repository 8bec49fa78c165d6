"""A real S3 API server for tests: moto's server mode on 127.0.0.1, reached over HTTP by boto3.

Credentials come from the environment (boto3's standard chain), set here to moto's test keys;
the user's own AWS files are kept out of reach.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator

ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}
CLEARED = ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def s3_environment() -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in (*ENV, *CLEARED)}
    os.environ.update(ENV)
    for k in CLEARED:
        os.environ.pop(k, None)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    """Start the server; yields its endpoint URL."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@contextlib.contextmanager
def authentication_on() -> Iterator[None]:
    """Make the server check every request's access key against its IAM users (moto accepts
    any key by default)."""
    from moto import settings

    before = settings.INITIAL_NO_AUTH_ACTION_COUNT
    settings.INITIAL_NO_AUTH_ACTION_COUNT = 0
    try:
        yield
    finally:
        settings.INITIAL_NO_AUTH_ACTION_COUNT = before


def client(endpoint: str):
    import boto3

    return boto3.session.Session().client("s3", endpoint_url=endpoint)


def upload_folder(s3, folder: str, bucket: str, prefix: str) -> None:
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            s3.upload_file(path, bucket, f"{prefix}/{name}")
