"""A disk cache of the tokenizers built from GGUF files.

transformers builds a GGUF file's tokenizer by converting the vocabulary in its metadata: seconds
and a transient peak of memory, on every start. The
built tokenizer is saved once, as transformers' own files (``save_pretrained``: tokenizer.json
and its config), under ``$XDG_CACHE_HOME/lightwell/tokenizers/<key>`` and loaded from there
afterwards. The key covers the file (absolute path, size, modification time) and the
transformers and tokenizers versions, so a changed file or library builds afresh. Saving is
best effort: a cache folder that cannot be written leaves the build as it was, and an entry
that cannot be read is built and written again. The newest ``KEEP`` entries are kept.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

from lightwell.envs import cache_dir

logger = logging.getLogger(__name__)

KEEP = 16  # entries kept (the most recently written)


def cache_root() -> str:
    return cache_dir("tokenizers")


def entry(path: str, mtime_ns: int, size: int) -> str:
    """The cache folder of the GGUF file at ``path`` as it is now."""
    import tokenizers
    import transformers

    key = f"{path}\0{size}\0{mtime_ns}\0{transformers.__version__}\0{tokenizers.__version__}"
    return os.path.join(cache_root(), hashlib.sha256(key.encode()).hexdigest()[:32])


def cached_tokenizer(path: str, mtime_ns: int, size: int, build: Callable[[], Any]) -> Any:
    """The tokenizer of the GGUF file at ``path``: from the cache, else ``build()`` (saved)."""
    folder = entry(path, mtime_ns, size)
    tok = _load(folder)
    if tok is None:
        tok = build()
        _save(tok, folder)
    return tok


def _load(folder: str) -> Any | None:
    if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - a damaged entry is built again
        logger.debug("tokenizer cache entry %s unreadable (%s): building it again", folder, e)
        return None


def _save(tok: Any, folder: str) -> None:
    root, tmp = os.path.dirname(folder), None
    try:
        os.makedirs(root, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=os.path.basename(folder) + ".tmp", dir=root)  # unique
        tok.save_pretrained(tmp)
        shutil.rmtree(folder, ignore_errors=True)  # a damaged entry
        os.replace(tmp, folder)
    except OSError as e:  # a read-only or full cache folder, or another writer's entry
        logger.debug("tokenizer cache entry %s not written (%s)", folder, e)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        return
    _prune(root)


def _prune(root: str) -> None:
    """Remove all but the ``KEEP`` most recently written entries, and partial ones (a process
    that stopped while saving) older than an hour."""
    try:
        paths = [os.path.join(root, n) for n in os.listdir(root)]
        partial = {p for p in paths if ".tmp" in os.path.basename(p)}
        entries = sorted(set(paths) - partial, key=os.path.getmtime, reverse=True)
        now = time.time()
        stale = [p for p in partial if now - os.path.getmtime(p) > 3600]
    except OSError:  # another process pruning at the same time
        return
    for old in entries[KEEP:] + stale:
        shutil.rmtree(old, ignore_errors=True)
