"""Keyed Gumbel noise: one number per (seed, absolute position, token id), the same bits in numpy and in torch.

A coupled draw (:mod:`dsi.coupling`) takes the token that maximises ``log p[x] + G[x]``, where ``G[x]`` is
standard Gumbel noise; the drafter and the target use the same noise at a position, so the target's draw is
exact (the Gumbel-max trick) and the drafter's equals it as often as their laws allow. The noise must be the same
function wherever a draw is made: dsi's host code (numpy) and an engine's logits processor (torch, in vLLM's own
environment, which has no dsi installed: this module imports nothing).

The function. Four 32-bit keys come from the seed and the position (BLAKE2b, :func:`keys`); each token id is
hashed twice (murmur3's 32-bit finalizer, :func:`_mix`, around a key) into 53 random bits, a uniform
``u`` in (0, 1), and ``G = -log(-log(u))``. Only operators that numpy and torch integer arrays share are used
(``^ * & >>`` on int64; a product's overflow wraps and only its low 32 bits are kept), so both compute the same
integers; the two ``log`` may differ in the last bit, which moves a draw only where two candidates' scores tie
within it.
"""

from __future__ import annotations

import hashlib
import struct

MASK32 = 0xFFFFFFFF
_PERSON = b"dsi-gumbel"


def keys(seed: int, position: int) -> tuple[int, int, int, int]:
    """The four 32-bit keys of ``(seed, position)`` (both integers in [0, 2**64))."""
    digest = hashlib.blake2b(struct.pack("<QQ", seed, position), digest_size=16, person=_PERSON).digest()
    return struct.unpack("<IIII", digest)


def _fmix32(h):
    """murmur3's 32-bit finalizer on an int64 array of values in [0, 2**32)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & MASK32
    return h ^ (h >> 16)


def _mix(ids, a: int, b: int):
    return _fmix32(_fmix32(ids ^ a) ^ b)


def uniform_bits(ids, seed: int, position: int):
    """53 random bits per id of ``ids`` (an int64 numpy array or torch tensor of token ids), as int64 in
    [0, 2**53): a function of (seed, position, id) only."""
    k0, k1, k2, k3 = keys(seed, position)
    return (_mix(ids, k0, k1) >> 5) * 67108864 + (_mix(ids, k2, k3) >> 6)


def gumbel_from_bits(bits, log):
    """Standard Gumbel noise from :func:`uniform_bits` (converted to float64 by the caller), with the array
    library's ``log``: ``u = (bits + 0.5) / 2**53`` in (0, 1), ``-log(-log(u))``."""
    u = (bits + 0.5) * (1.0 / 9007199254740992.0)
    return -log(-log(u))
