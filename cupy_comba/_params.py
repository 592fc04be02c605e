"""Host-side mirror of the kernels' parameter structs, passed by value in one argument.

One struct instead of thirty scalars keeps the launch cheap on the host (CuPy
converts each kernel argument separately); the struct is built once per call
signature and cached by the op.
"""

import numpy

# Field order of ``struct DecodeParams`` in kernels_cu/comba_decode.cu; every field is int64.
DECODE_FIELDS = (
    "B", "H", "group", "V",
    "q_sb", "q_sh", "q_sk",
    "k_sb", "k_sh", "k_sk",
    "p_sb", "p_sh", "p_sk",
    "v_sb", "v_sh", "v_sv",
    "beta_sb", "beta_sh",
    "g_sb", "g_sh",
    "o_sb", "o_sh", "o_sv",
    "q_t", "k_t", "p_t", "v_t", "beta_t", "g_t", "o_t",
)
DECODE_PARAMS = numpy.dtype([(name, numpy.int64) for name in DECODE_FIELDS], align=True)


def pack(dtype, values):
    """A ``numpy.void`` scalar of struct ``dtype`` from ``{field: int}``."""
    missing = set(dtype.names) - set(values)
    if missing:
        raise KeyError(f"missing struct fields: {sorted(missing)}")
    return numpy.array(tuple(int(values[n]) for n in dtype.names), dtype=dtype)[()]



# Field order of ``struct ForwardParams`` in kernels_cu/delta_rule.cu; every field is int64.
FORWARD_FIELDS = (
    "B", "T", "H", "group", "V",
    "q_sb", "q_st", "q_sh", "q_sk",
    "k_sb", "k_st", "k_sh", "k_sk",
    "p_sb", "p_st", "p_sh", "p_sk",
    "v_sb", "v_st", "v_sh", "v_sv",
    "beta_sb", "beta_st", "beta_sh",
    "g_sb", "g_st", "g_sh",
    "o_sb", "o_st", "o_sh", "o_sv",
    "q_t", "k_t", "p_t", "v_t", "beta_t", "g_t", "o_t",
    "gate_linear", "l2norm", "has_initial", "write_final",
)
FORWARD_PARAMS = numpy.dtype([(name, numpy.int64) for name in FORWARD_FIELDS], align=True)
