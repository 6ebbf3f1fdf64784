"""DARE's uniforms without torch's serial loop: ``torch.rand(n, generator=g)`` for a CPU generator seeded with
``g.manual_seed(s)``, bit for bit, at several times its speed (numba, GIL released).

torch's CPU generator is MT19937 seeded with the low 32 bits of s (``init_genrand``, the reference
algorithm's, also numpy's legacy ``RandomState``), and its float32 uniform is the low 24 bits of one 32-bit
output times 2^-24 (ATen's ``uniform_real_distribution<float>``: exact, no rounding). torch draws it one
element at a time through the generator's virtual call (~0.45 G/s here); this draws the 624-word state a block
at a time with loops LLVM vectorizes. docs/SEMANTICS.md defines the masks by torch's formula, and the tests
compare against it (tests/operators/test_operators.py) over seeds and sizes.
"""

from __future__ import annotations

import numba
import numpy as np

_N, _M = 624, 397
_UPPER, _LOWER, _MATRIX_A = np.uint32(0x80000000), np.uint32(0x7FFFFFFF), np.uint32(0x9908B0DF)
_ONE, _LOW24 = np.uint32(1), np.uint32(0xFFFFFF)
_INIT_MUL = np.uint32(1812433253)
_SCALE = np.float32(2.0 ** -24)


@numba.njit(cache=True, nogil=True)
def _seed_state(state: np.ndarray, seed: np.uint32) -> None:
    """init_genrand: state[0] = seed, state[j] = 1812433253 * (state[j-1] ^ (state[j-1] >> 30)) + j (mod 2^32)."""
    state[0] = seed
    for j in range(1, _N):
        prev = state[j - 1]
        state[j] = np.uint32(_INIT_MUL * (prev ^ (prev >> np.uint32(30))) + np.uint32(j))


@numba.njit(cache=True, nogil=True)
def _twist(state: np.ndarray) -> None:
    """The next 624 words (MT19937's generation step, in the reference order: each word reads the already
    twisted word 227 places back once k >= 227)."""
    for k in range(_N - _M):
        y = (state[k] & _UPPER) | (state[k + 1] & _LOWER)
        state[k] = state[k + _M] ^ (y >> _ONE) ^ (_MATRIX_A * (state[k + 1] & _ONE))
    for k in range(_N - _M, _N - 1):
        y = (state[k] & _UPPER) | (state[k + 1] & _LOWER)
        state[k] = state[k + _M - _N] ^ (y >> _ONE) ^ (_MATRIX_A * (state[k + 1] & _ONE))
    y = (state[_N - 1] & _UPPER) | (state[0] & _LOWER)
    state[_N - 1] = state[_M - 1] ^ (y >> _ONE) ^ (_MATRIX_A * (state[0] & _ONE))


@numba.njit(cache=True, nogil=True)
def _temper(y: np.uint32) -> np.uint32:
    """MT19937's tempering of one state word."""
    y ^= y >> np.uint32(11)
    y ^= (y << np.uint32(7)) & np.uint32(0x9D2C5680)
    y ^= (y << np.uint32(15)) & np.uint32(0xEFC60000)
    y ^= y >> np.uint32(18)
    return y


@numba.njit(cache=True, nogil=True)
def _temper_into(state: np.ndarray, out: np.ndarray) -> None:
    """The uniforms of the first out.shape[0] words of a freshly twisted state: MT19937's tempering, then the
    low 24 bits times 2^-24."""
    for i in range(out.shape[0]):
        # below 2^24: as a signed int32 it converts exactly and in one vector instruction on any x86 (an
        # unsigned one has none before AVX-512, and numba's is slower even there): 0.39 -> 0.22 ns a uniform
        out[i] = np.float32(np.int32(_temper(state[i]) & _LOW24)) * _SCALE


@numba.njit(cache=True, nogil=True)
def _uniforms(seed: np.uint32, out: np.ndarray) -> None:
    state = np.empty(_N, np.uint32)
    _seed_state(state, seed)
    for pos in range(0, out.shape[0], _N):
        _twist(state)
        _temper_into(state, out[pos:pos + _N])


@numba.njit(cache=True, nogil=True, parallel=True)
def _uniforms_blocks(seeds: np.ndarray, bounds: np.ndarray, out: np.ndarray) -> None:
    """Block b's uniforms into ``out[bounds[b]:bounds[b + 1]]`` from its own generator (seed ``seeds[b]``): the
    blocks are independent streams, drawn on numba's threads (the bits do not depend on how many)."""
    for b in numba.prange(seeds.shape[0]):
        _uniforms(seeds[b], out[bounds[b]:bounds[b + 1]])


# A stream drawn piecewise: its state, and where a caller draws counts that are not whole twists, the uniforms of
# its current twist and how many of them are used (`stream_fill`). The DARE kernels of `kernels.merge` draw a
# tile of whole twists at a time (`merge._MT_TILE`, `stream_fill_words`); DELLA's draws a row at a time
# (`row_ranks.della_keep_blocks`). numba compiles these into those kernels, whose on-disk cache does not notice
# edits here: after changing this file, delete mergepipe_db/kernels/__pycache__/{merge,row_ranks}.*.nb* (a
# fresh install has no cache).

@numba.njit(cache=True, nogil=True)
def stream_start(state: np.ndarray, seed: np.int64) -> None:
    """Seed a stream as ``manual_seed(seed)`` does (0 <= seed < 2^63)."""
    _seed_state(state, np.uint32(seed & np.int64(0xFFFFFFFF)))


@numba.njit(cache=True, nogil=True)
def stream_fill_words(out: np.ndarray, state: np.ndarray) -> None:
    """The stream's next out.shape[0] uniforms, tempered straight into `out`, `STATE_WORDS` (one twist) at a
    time. The words of a last twist that `out` does not take whole are lost: only a stream's last draw may
    take a count that is not a multiple of `STATE_WORDS`."""
    for pos in range(0, out.shape[0], _N):
        _twist(state)
        _temper_into(state, out[pos:pos + _N])


@numba.njit(nogil=True, inline="always")
def stream_fill(out: np.ndarray, state: np.ndarray, twist: np.ndarray, pos: int) -> int:
    """The stream's next out.shape[0] uniforms, any count: taken from `twist` (the uniforms of its current
    twist, `STATE_WORDS` of them, the first `pos` used; a fresh stream's `pos` is `STATE_WORDS`), twisting
    again as they run out. Returns the new `pos`."""
    i = 0
    n = out.shape[0]
    while i < n:
        if pos == _N:
            _twist(state)
            _temper_into(state, twist)
            pos = 0
        take = min(_N - pos, n - i)
        out[i:i + take] = twist[pos:pos + take]
        i += take
        pos += take
    return pos


STATE_WORDS = _N


@numba.njit(cache=True, nogil=True)
def _randint_indices(seed32: np.uint32, n: np.uint32, idx: np.ndarray) -> None:
    """idx = torch.randint(n, (len(idx),)) of a generator seeded with seed32: one tempered MT19937 output
    modulo n each, in order."""
    state = np.empty(_N, np.uint32)
    _seed_state(state, seed32)
    m = idx.shape[0]
    for pos in range(0, m, _N):
        _twist(state)
        for i in range(min(_N, m - pos)):
            idx[pos + i] = _temper(state[i]) % n


_GATHER_CHUNKS = 16  # a fixed number of chunks (numba cannot cache a kernel that asks for its thread count)


@numba.njit(cache=True, nogil=True, parallel=True)
def _gather(values: np.ndarray, idx: np.ndarray, out: np.ndarray) -> None:
    """out[i] = values[idx[i]], in contiguous chunks on numba's threads (random reads: more in flight)."""
    m = out.shape[0]
    for t in numba.prange(_GATHER_CHUNKS):
        for i in range(m * t // _GATHER_CHUNKS, m * (t + 1) // _GATHER_CHUNKS):
            out[i] = values[idx[i]]


def randint_gather(values: np.ndarray, seed: int, out: np.ndarray, idx: np.ndarray | None = None) -> None:
    """out = values[torch.randint(len(values), (len(out),), generator=g)] for g given ``manual_seed(seed)``
    (0 <= seed < 2^63; 0 < len(values) < 2^32): torch draws each index as one 32-bit MT19937 output modulo the
    range, in order (ATen's ``uniform_int_from_to_distribution``); the indices are drawn in one pass (into
    `idx`, uint32 of len(out), when given) and gathered on numba's threads."""
    if idx is None:
        idx = np.empty(out.shape[0], np.uint32)
    _randint_indices(np.uint32(int(seed) & 0xFFFFFFFF), np.uint32(values.shape[0]), idx)
    _gather(values, idx, out)


def torch_rand_into(seed: int, out: np.ndarray) -> None:
    """Fill the flat float32 array `out` with ``torch.rand(out.size)`` of a generator given
    ``manual_seed(seed)`` (0 <= seed < 2^64)."""
    assert out.dtype == np.float32 and out.ndim == 1
    _uniforms(np.uint32(seed & 0xFFFFFFFF), out)


def torch_rand_blocks_into(seeds: list[int], bounds: np.ndarray, out: np.ndarray) -> None:
    """`torch_rand_into` of several blocks at once, in parallel: block b (seed ``seeds[b]``) fills
    ``out[bounds[b]:bounds[b + 1]]`` (`bounds`: len(seeds) + 1 non-decreasing int64 offsets into the flat float32
    `out`)."""
    assert out.dtype == np.float32 and out.ndim == 1 and len(bounds) == len(seeds) + 1
    _uniforms_blocks(np.array([s & 0xFFFFFFFF for s in seeds], np.uint32), np.asarray(bounds, np.int64), out)
