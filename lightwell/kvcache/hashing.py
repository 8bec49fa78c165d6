"""Chained hashes of full KV-cache blocks, the keys of the prefix cache.

The hash of block ``i`` is ``hash((hash of block i-1, tuple(token ids of block i)))``, with a fixed
root in place of the parent for block 0. A block hash therefore names the whole prefix up to and
including that block, not just its own tokens: two sequences share block ``i``'s hash only if they
share every token of blocks ``0..i``. Only full blocks are hashed; a partial last block never is.

Isolation: a request's ``cache_salt`` (a tenant's secret, say) replaces the root by a hash of
the root and the salt, so every block hash of a salted prefix differs from the unsalted one's and
from any other salt's: blocks are shared only between requests with the same salt (or none).

Determinism: Python randomizes the hashes of ``str`` and ``bytes`` per process
(``PYTHONHASHSEED``), but not of ``int`` or of tuples of ints, so these hashes are stable within
one process and across processes of one Python build. The prefix cache lives in one process (the
scheduler's), so that is all it needs.

Collisions: the value is a 64-bit tuple hash (an xxHash-style mix of the element hashes; small
ints hash to themselves, so distinct tokens never collide at the element level). For ``N`` distinct
cached prefixes the chance that any two share a hash is about ``N**2 / 2**65``: below 1e-5 even for
``N = 10**7`` blocks, far more than one cache ever holds. The hash is not cryptographic, so a client
who controls prompts could search for a collision on purpose; a multi-tenant deployment that
fears that should switch :func:`hash_block_tokens` to a keyed cryptographic hash (e.g. ``blake2b``
over the token bytes).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

# Parent "hash" of the first block: any fixed int works; this one is an arbitrary 61-bit constant.
ROOT_HASH = 0x1B873593_5C4BB2A1 & ((1 << 61) - 1)


def root_hash(cache_salt: str | None = None) -> int:
    """The parent of the first block: ``ROOT_HASH``, or one derived from a cache salt (blake2b,
    so the salt's hash does not depend on the process)."""
    if cache_salt is None:
        return ROOT_HASH
    digest = hashlib.blake2b(cache_salt.encode(), digest_size=8, person=b"lw-salt").digest()
    return hash((ROOT_HASH, int.from_bytes(digest, "little")))


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Hash of one full block given the hash of the block before it (None for the first block)."""
    parent = ROOT_HASH if parent_hash is None else parent_hash
    return hash((parent, tuple(token_ids)))


def extend_block_hashes(
    block_hashes: list[int],
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
) -> list[int]:
    """Append to ``block_hashes`` the hashes of the full blocks of ``token_ids`` it lacks.

    ``block_hashes`` must already hold the hashes of the first ``len(block_hashes)`` blocks of
    ``token_ids``; the work done is proportional to the newly full blocks only. Returns the list.
    """
    num_full = len(token_ids) // block_size
    parent = block_hashes[-1] if block_hashes else root_hash(cache_salt)
    for i in range(len(block_hashes), num_full):
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size])
        block_hashes.append(parent)
    return block_hashes


def compute_block_hashes(
    token_ids: Sequence[int], block_size: int, cache_salt: str | None = None
) -> list[int]:
    """Hashes of every full block of ``token_ids``, in order."""
    return extend_block_hashes([], token_ids, block_size, cache_salt)
