"""The prefill kernels' ``StageMaps`` parameter: tensor maps of q, k, p and v for Hopper's bulk tensor copy.

``prefill_scan`` (kernels_cu/prefill.cu) stages each chunk's 64 token rows of q, k, p and of its slab of
v from one thread by ``cp.async.bulk.tensor`` where the GPU has the copy engine (compute capability 9.0
on) and the arrays allow it, instead of 16-byte cp.async pieces from every thread.  A tensor map
describes one array as ``[B, T, heads, n]`` (the last axis innermost) and a box of 64 token rows of one
head: for q, k and p ``K + 16`` elements wide (``K + 8`` for ``prefill_scan_wg``) -- the elements past the
key axis lie outside the array and arrive as zeros, so that the rows land at the stage's padded pitch --
and for v one slab of value columns.  ``prefill_scan_wt`` (kernels_cu/prefill_transposed.cu) takes boxes of 64 elements
(128 bytes) by 64 token rows with the copy's 128-byte swizzle, the layout wgmma reads: of q, k and p 64 keys, of v
(bf16 only) 64 value columns.

The maps are opaque 128-byte values made by the CUDA driver (``cuTensorMapEncodeTiled``, through
ctypes: CuPy does not wrap it).  A map holds its array's address, so a launch with other pointers has
its maps' addresses replaced (``cuTensorMapReplaceAddress``) before the kernels see them.  Where
anything does not qualify -- no driver entry point, a GPU without the engine, K = 256 (a box is at most
256 elements wide), keys the stage converts (fp16, or bf16 beside fp32 ones), an innermost axis that is
not contiguous, other strides that are not positive multiples of 16 bytes, an address the driver
refuses -- ``use`` is 0 and the kernels stage by cp.async.
"""

import ctypes
import functools

from ._dtypes import bfloat16
from ._launcher import libcuda

#: sizeof(StageMaps) in kernels_cu/prefill.cuh: four 128-byte maps and a 64-bit flag, aligned to 64 bytes.
STAGE_MAPS_BYTES = 576
_MAP_BYTES = 128
_USE_AT = 4 * _MAP_BYTES
_ROWS = 64  # kPrefillChunk: token rows a box
_PAD = 16   # elements past the key axis in a staged key row

# cuda.h's CUtensorMapDataType (the copy moves bits: unsigned types of the element's size) and options
_DATA_TYPE = {2: 1, 4: 2}  # UINT16, UINT32
_INTERLEAVE_NONE = _SWIZZLE_NONE = _OOB_FILL_ZEROS = 0
_SWIZZLE_128B = 3
_L2_PROMOTION_128B = 2


@functools.cache
def _driver():
    """``(cuTensorMapEncodeTiled, cuTensorMapReplaceAddress)`` from the CUDA driver, or None."""
    try:
        lib = libcuda()
        encode, replace = lib.cuTensorMapEncodeTiled, lib.cuTensorMapReplaceAddress
    except AttributeError:  # no driver (None), or one without tensor maps
        return None
    u64p, u32p = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32)
    encode.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
                       ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int)
    replace.argtypes = (ctypes.c_void_p, ctypes.c_void_p)
    encode.restype = replace.restype = ctypes.c_int
    return encode, replace


def _geometry(a, ragged, itemsize, width):
    """``(data type, dims, byte strides, box)`` of a ``[B, T, heads, n]`` array for boxes of ``width``
    elements of 64 token rows, or None where the copy cannot take it."""
    B, T, heads, n = a.shape
    if a.itemsize != itemsize or a.strides[3] != itemsize or min(B, T, heads, n) < 1 or width > 256:
        return None
    B = 1 if ragged else B  # a packed batch is one row (its batch stride, unused, is any)
    strides = (a.strides[2], a.strides[1], a.strides[0] if B > 1 else -(-T * a.strides[1] // 16) * 16)
    if any(s <= 0 or s % 16 or s >= 1 << 40 for s in strides):
        return None
    return _DATA_TYPE[itemsize], (n, heads, T, B), strides, (width, 1, _ROWS, 1)


def stage_geometries(q, k, p, v, ragged, key_itemsize, slab, pad=_PAD, swizzled=False):
    """The four maps' ``_geometry`` (q, k, p, v; None for a map the scan does not take) of a prefill plan, or None
    where the copy cannot take one it needs (StageMaps' arguments).  p's is None where p is k: Gated DeltaNet's
    plans hand k as p, and its scans read k's rows in p's place."""
    if swizzled and key_itemsize != 2:
        return None

    def key_map(a):
        return _geometry(a, ragged, 2, 64) if swizzled else _geometry(a, ragged, key_itemsize, q.shape[3] + pad)

    if swizzled:
        v_map = _geometry(v, ragged, 2, 64) if v.dtype == bfloat16 else None
    else:
        v_map = _geometry(v, ragged, v.itemsize, slab)
    p_map = None if p is k else key_map(p)
    maps = (key_map(q), key_map(k), p_map, v_map)
    needed = maps if p is not k else (maps[0], maps[1], v_map)
    return maps if all(needed) else None


class StageMaps:
    """The ``StageMaps`` argument of one prefill plan, kept pointing at the launch's arrays.

    Parameters
    ----------
    q, k, p, v : ArraySig
        ``[B, T, Hk, K]`` (k again as p for Gated DeltaNet) and ``[B, T, H, V]``; a decode step's ``[B, Hk, K]``
        (a prefill variant named for one token) gets no maps.
    ragged : bool
        A packed batch: one row of all the tokens (the kernels move to each sequence's first token).
    key_itemsize : int
        Bytes of a staged key (2: bf16 stages, 4: fp32 stages).
    slab : int
        Value columns a scan CTA stages.
    capable : bool
        Whether the GPU has the bulk tensor copy (compute capability 9.0 or higher).
    pad : int
        Elements past the key axis in a staged key row: 16 for ``prefill_scan``, 8 for ``prefill_scan_wg``.
    swizzled : bool
        ``prefill_scan_wt``'s maps: boxes of 64 elements (128 bytes) by 64 token rows swizzled as wgmma reads them
        (128-byte swizzle), v's only where it is bf16, none of p where p is k (``pad`` unused).
    """

    __slots__ = ("_raw", "address", "_maps", "_encoded", "_pointers", "_swizzle")

    def __init__(self, q, k, p, v, ragged, key_itemsize, slab, capable, pad=_PAD, swizzled=False):
        self._raw = ctypes.create_string_buffer(STAGE_MAPS_BYTES + 64)
        self.address = (ctypes.addressof(self._raw) + 63) & ~63  # the driver writes maps at 64-byte alignment
        self._maps, self._encoded, self._pointers = None, False, None
        self._swizzle = _SWIZZLE_128B if swizzled else _SWIZZLE_NONE
        if not capable or len(q.shape) != 4 or _driver() is None:
            return  # a decode step's one token ([B, H, K]) is staged by cp.async
        self._maps = stage_geometries(q, k, p, v, ragged, key_itemsize, slab, pad, swizzled)

    def update(self, pointers):
        """Point the maps at q, k, p and v (``pointers``, in that order); ``use`` 0 where the driver refuses one."""
        if self._maps is None or pointers == self._pointers:
            return
        encode, replace = _driver()
        use = 1
        for i, (ptr, geometry) in enumerate(zip(pointers, self._maps)):
            if geometry is None:
                continue
            dtype, dims, strides, box = geometry
            at = self.address + i * _MAP_BYTES
            if self._encoded:
                status = replace(at, ptr)
            else:
                status = encode(at, dtype, 4, ptr, (ctypes.c_uint64 * 4)(*dims), (ctypes.c_uint64 * 3)(*strides),
                                (ctypes.c_uint32 * 4)(*box), (ctypes.c_uint32 * 4)(1, 1, 1, 1), _INTERLEAVE_NONE,
                                self._swizzle, _L2_PROMOTION_128B, _OOB_FILL_ZEROS)
            if status:
                use = 0
                break
        self._encoded = bool(use)
        ctypes.c_int64.from_address(self.address + _USE_AT).value = use
        self._pointers = pointers if use else None
