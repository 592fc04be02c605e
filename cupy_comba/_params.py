"""Host-side mirror of ``struct Params`` (kernels_cu/params.cuh), passed by value in one argument.

One struct instead of forty scalars keeps the launch cheap on the host; it is
built once per call signature and cached by the op's launch plan.
"""

import numpy

# Field order of ``struct Params``; every field is int64.
FIELDS = (
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
PARAMS = numpy.dtype([(name, numpy.int64) for name in FIELDS], align=True)


def pack(values):
    """A ``numpy.void`` scalar of ``struct Params`` from ``{field: int}``."""
    missing = set(FIELDS) - set(values)
    if missing:
        raise KeyError(f"missing struct fields: {sorted(missing)}")
    return numpy.array(tuple(int(values[n]) for n in FIELDS), dtype=PARAMS)[()]
