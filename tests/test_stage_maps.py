"""Which arrays the prefill scan stages by bulk tensor copies, and the tensor-map geometry it asks the driver
for (cupy_comba/_tma.py; no GPU needed).  The GPU side -- the copies themselves, against the float64
reference -- is tests/test_prefill_gpu.py's."""

import ctypes

import numpy
import pytest

from cupy_comba import _tma, bfloat16
from cupy_comba._validate import ArraySig

F16, F32 = numpy.dtype(numpy.float16), numpy.dtype(numpy.float32)


def _sig(shape, dtype=bfloat16, view=None):
    a = numpy.zeros(shape, dtype)
    return ArraySig(a if view is None else view(a))


def test_a_dense_key_box_is_one_head_s_64_rows_padded_by_16_zero_elements():
    q = _sig((2, 100, 4, 128))
    dtype, dims, strides, box = _tma._geometry(q, False, 2, 128 + 16)
    assert dtype == 1  # 16-bit elements, copied as bits
    assert dims == (128, 4, 100, 2)  # innermost first: key, head, token, row
    assert strides == (256, 1024, 102400)
    assert box == (144, 1, 64, 1)


def test_a_v_box_is_one_slab_of_64_rows():
    v = _sig((2, 100, 8, 64), F32)
    assert _tma._geometry(v, False, 4, 16) == (2, (64, 8, 100, 2), (256, 2048, 204800), (16, 1, 64, 1))


def test_the_transposed_scan_takes_its_rows_in_boxes_of_64_elements():
    """prefill_scan_wt's maps (``swizzled``): q, k and p in boxes of 64 keys (128 bytes) by 64 token rows, v in
    boxes of 64 value columns; none of p where it is k (Gated DeltaNet's plans hand k as p), and none at all for
    keys staged as fp32 or a v that is not bf16 (the stage holds bf16)."""
    q, k, p, v = _sig((2, 100, 4, 128)), _sig((2, 100, 4, 128)), _sig((2, 100, 4, 128)), _sig((2, 100, 8, 128))
    qm, km, pm, vm = _tma.stage_geometries(q, k, p, v, False, 2, 64, swizzled=True)
    assert qm == km == pm == (1, (128, 4, 100, 2), (256, 1024, 102400), (64, 1, 64, 1))
    assert vm == (1, (128, 8, 100, 2), (256, 2048, 204800), (64, 1, 64, 1))
    assert _tma.stage_geometries(q, k, k, v, False, 2, 64, swizzled=True) == (qm, km, None, vm)
    assert _tma.stage_geometries(q, q, q, v, False, 4, 64, swizzled=True) is None
    for dtype in (F16, F32):
        assert _tma.stage_geometries(q, q, q, _sig((2, 100, 8, 128), dtype), False, 2, 64, swizzled=True) is None
    assert _tma.stage_geometries(q, q, q, v, False, 2, 16)[0][3] == (144, 1, 64, 1)  # prefill_scan's, padded
    assert _tma.stage_geometries(q, k, k, v, False, 2, 16)[2] is None  # its p's, where p is k, neither


def test_a_packed_batch_is_one_row():
    k = _sig((1, 300, 4, 64))
    _, dims, strides, _ = _tma._geometry(k, True, 2, 80)
    assert dims == (64, 4, 300, 1)
    assert strides[:2] == (128, 512) and strides[2] % 16 == 0 and strides[2] >= 300 * 512


@pytest.mark.parametrize("case", ["k256", "fp16-into-fp32-stage", "bf16-into-fp32-stage", "strided-keys",
                                  "rows-off-16-bytes", "reversed-tokens"])
def test_what_the_copy_cannot_take_stays_with_cp_async(case):
    if case == "k256":  # K + 16 = 272 elements: more than a box holds
        a, itemsize, width = _sig((1, 64, 2, 256)), 2, 272
    elif case == "fp16-into-fp32-stage":
        a, itemsize, width = _sig((1, 64, 2, 128), F16), 4, 144
    elif case == "bf16-into-fp32-stage":  # beside fp32 keys, bf16 ones are staged as floats
        a, itemsize, width = _sig((1, 64, 2, 128)), 4, 144
    elif case == "strided-keys":
        a, itemsize, width = _sig((1, 64, 2, 256), view=lambda x: x[..., ::2]), 2, 144
    elif case == "rows-off-16-bytes":  # 68-element rows: 136 bytes apart
        a, itemsize, width = _sig((1, 64, 2, 68), view=lambda x: x[..., :64]), 2, 80
    else:
        a, itemsize, width = _sig((1, 64, 2, 128), view=lambda x: x[:, ::-1]), 2, 144
    assert _tma._geometry(a, False, itemsize, width) is None


def test_stage_maps_are_off_where_the_gpu_has_no_bulk_copy():
    q = _sig((1, 128, 2, 128))
    v = _sig((1, 128, 2, 64))
    maps = _tma.StageMaps(q, q, q, v, False, 2, 16, capable=False)
    maps.update((1 << 20,) * 4)  # never reaches the driver
    assert maps.address % 64 == 0  # where the driver writes maps
    assert ctypes.c_int64.from_address(maps.address + 4 * 128).value == 0  # StageMaps::use: the kernels' cp.async


def test_a_decode_step_s_one_token_gets_no_maps():
    """A prefill variant named for a decode step: [B, Hk, K] activations stay with cp.async (no key axis at 3)."""
    q, v = _sig((3, 2, 256)), _sig((3, 4, 128))
    maps = _tma.StageMaps(q, q, q, v, False, 2, 32, capable=True)
    maps.update((1 << 20,) * 4)
    assert ctypes.c_int64.from_address(maps.address + 4 * 128).value == 0
