"""An independent NumPy implementation of Philox4x32-10 and of the documented dropout mapping,
used by the tests to prove that the native kernels implement exactly what docs/dropout.md says
(written from the docs, independently of cuda/common/philox.h)."""

import numpy as np

M0, M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
W0, W1 = 0x9E3779B9, 0xBB67AE85
MASK32 = np.uint64(0xFFFFFFFF)


def philox4x32_10(counters, key):
    """counters: uint32[..., 4]; key: 2 ints. Returns uint32[..., 4]."""
    c = [np.asarray(counters[..., i], dtype=np.uint64) for i in range(4)]
    k0, k1 = int(key[0]), int(key[1])
    for r in range(10):
        if r:
            k0 = (k0 + W0) & 0xFFFFFFFF
            k1 = (k1 + W1) & 0xFFFFFFFF
        p0 = M0 * c[0]
        p1 = M1 * c[2]
        hi0, lo0 = p0 >> np.uint64(32), p0 & MASK32
        hi1, lo1 = p1 >> np.uint64(32), p1 & MASK32
        c = [hi1 ^ c[1] ^ np.uint64(k0), lo1, hi0 ^ c[3] ^ np.uint64(k1), lo0]
    return np.stack([x.astype(np.uint32) for x in c], axis=-1)


def dropout_words(key, n, offset=0):
    """The Philox word that decides each of n elements with global indices offset .. offset+n-1."""
    g = np.arange(n, dtype=np.uint64) + np.uint64(offset)
    block = g // np.uint64(4)
    counters = np.stack(
        [block & MASK32, block >> np.uint64(32), np.zeros_like(block), np.zeros_like(block)], axis=-1
    ).astype(np.uint32)
    words = philox4x32_10(counters, key)
    return words[np.arange(n), (g % np.uint64(4)).astype(np.int64)]


def keep_mask(key, n, rate, offset=0):
    threshold = min(int(round(rate * 2.0**32)), 2**32 - 1)
    return dropout_words(key, n, offset) >= np.uint32(threshold)
