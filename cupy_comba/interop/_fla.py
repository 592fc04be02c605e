"""flash-linear-attention's calls mapped onto cupy_comba's forward passes, for any framework.

A framework adapter (:mod:`cupy_comba.interop.torch`, :mod:`cupy_comba.interop.jax`) takes its four
public functions from :func:`calls` and gives them a *frame*, which knows its arrays: how to check
them, make small ones, allocate the outputs, view them as CuPy arrays on the right device and stream,
and hand the results back.  Everything else -- the signatures, the options, their defaults and what
is refused -- is here, once.
"""

from .. import comba_forward, gated_delta_forward
from .._backend import cupy

#: Options flash-linear-attention takes that the kernels here do not need: accepted, unused.
UNUSED = frozenset({"chunk_size", "chunk_indices", "cu_seqlens_cpu"})


def run(frame, name, comba, q, k, v, p, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
        use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, cu_seqlens,
        ssm_state_indices, num_accepted_tokens, inplace_final_state, kwargs):
    """``(o, final_state)`` in ``frame``'s arrays: a flash-linear-attention call (with vLLM's pool keywords)
    run by :func:`cupy_comba.comba_forward` / :func:`cupy_comba.gated_delta_forward`."""
    unknown = sorted(set(kwargs) - UNUSED - {"transpose_state_layout"})
    if unknown:
        raise TypeError(f"{name}() got unexpected keyword arguments {unknown}")
    if "transpose_state_layout" in kwargs:  # flash-linear-attention's earlier name for state_v_first
        state_v_first = bool(kwargs["transpose_state_layout"]) or state_v_first
    if allow_neg_eigval:
        raise NotImplementedError("allow_neg_eigval (beta = 2 sigmoid(b)) is not supported")
    if cupy is None:
        raise RuntimeError("CuPy is not installed: install cupy_comba with its cuda13 or cuda12 extra")
    device = frame.device(q, k, v)
    if len(v.shape) != 4:
        raise ValueError(f"v must have shape [B, T, HV, V], got {tuple(v.shape)}")
    B, T, HV, V = v.shape
    K = k.shape[-1]
    pool = ssm_state_indices is not None
    if pool:
        if initial_state is None:
            raise ValueError("ssm_state_indices index a pool of states: pass the pool as initial_state")
        if not inplace_final_state:
            raise ValueError("ssm_state_indices write each sequence's final state back into its slot of the pool: "
                             "inplace_final_state must be True")
        if len(ssm_state_indices.shape) == 2 and cu_seqlens is not None:
            raise NotImplementedError("a slot per token (2-D ssm_state_indices) takes (N, T, ...) tokens: view the "
                                      "packed (1, N * T, ...) tensors as (N, T, ...) and drop cu_seqlens")
    if use_gate_in_kernel and A_log is None:
        raise ValueError("use_gate_in_kernel=True takes A_log (and dt_bias, zeros when None)")

    with frame.on(device):
        if g is None:  # no decay: a log gate of 0
            g = frame.full((B, T, HV), 0.0, device)
        if beta is None:
            beta = frame.full((B, T, HV), 1.0, device)
        if use_gate_in_kernel:
            A_log = frame.float32(A_log)
            dt_bias = frame.full((HV,), 0.0, device) if dt_bias is None else frame.float32(dt_bias)
        else:
            A_log = dt_bias = None
        if pool:
            write_final, state = True, frame.pool(initial_state)  # the pool the final states go into
            state_out = None
        else:
            write_final = bool(output_final_state)
            state = None if initial_state is None else frame.float32(initial_state)
            N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
            head = (V, K) if state_v_first else (K, V)
            state_out = frame.empty((N, HV) + head, None, device) if write_final else None
        o = frame.empty((B, T, HV, V), v, device)
        c = {n: frame.cupy(x, n, device) for n, x in (
            ("q", q), ("k", k), ("v", v), ("p", p), ("g", g), ("beta", beta), ("initial_state", state),
            ("cu_seqlens", cu_seqlens), ("ssm_state_indices", ssm_state_indices),
            ("num_accepted_tokens", num_accepted_tokens), ("A_log", A_log), ("dt_bias", dt_bias), ("o", o),
            ("final_state", state_out))}
        opts = dict(initial_state=c["initial_state"], output_final_state=write_final,
                    state_indices=c["ssm_state_indices"], A_log=c["A_log"], dt_bias=c["dt_bias"],
                    use_beta_sigmoid=bool(use_beta_sigmoid_in_kernel), cu_seqlens=c["cu_seqlens"],
                    num_accepted_tokens=c["num_accepted_tokens"], out=c["o"], state_out=c["final_state"],
                    state_layout="vk" if state_v_first else "kv", use_qk_l2norm=bool(use_qk_l2norm_in_kernel))
        if comba:
            comba_forward(c["q"], c["k"], c["v"], c["p"], c["beta"], c["g"], scale, **opts)
        else:
            gated_delta_forward(c["q"], c["k"], c["v"], c["beta"], c["g"], scale, **opts)
    return frame.results(o, state if pool else state_out)  # after the frame's stream is left (JAX: waited for)


def calls(frame_class, module, docs):
    """flash-linear-attention 0.6's four calls with its signatures (and vLLM's keywords), on the arrays of a
    ``frame_class`` (made at the first call, when the framework is imported); functions of ``module`` with the
    docstrings ``docs`` (by name)."""
    made_frame = []

    def frame():
        if not made_frame:
            made_frame.append(frame_class())
        return made_frame[0]

    def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                               state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None,
                               cp_context=None, *, use_gate_in_kernel=False, A_log=None, dt_bias=None,
                               ssm_state_indices=None, num_accepted_tokens=None, inplace_final_state=True, **kwargs):
        if cp_context is not None:
            raise NotImplementedError("context parallelism (cp_context) is not supported")
        return run(frame(), "chunk_gated_delta_rule", False, q, k, v, None, g, beta, scale, initial_state,
                   output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias,
                   use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, cu_seqlens, ssm_state_indices,
                   num_accepted_tokens, inplace_final_state, kwargs)

    def fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None,
                                         initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
                                         use_gate_in_kernel=False, A_log=None, dt_bias=None,
                                         use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False,
                                         cu_seqlens=None, *, ssm_state_indices=None, num_accepted_tokens=None,
                                         inplace_final_state=True, **kwargs):
        if gk is not None or gv is not None:
            raise NotImplementedError("per-key / per-value decays (gk, gv) are not supported: pass g (HV,) a token")
        return run(frame(), "fused_recurrent_gated_delta_rule", False, q, k, v, None, g, beta, scale, initial_state,
                   output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias,
                   use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, cu_seqlens, ssm_state_indices,
                   num_accepted_tokens, inplace_final_state, kwargs)

    def chunk_comba(q, k, v, p, g, beta=None, scale=None, initial_state=None, output_final_state=False,
                    use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None, *, state_v_first=False,
                    use_gate_in_kernel=False, A_log=None, dt_bias=None, use_beta_sigmoid_in_kernel=False,
                    ssm_state_indices=None, num_accepted_tokens=None, inplace_final_state=True, **kwargs):
        return run(frame(), "chunk_comba", True, q, k, v, p, g, beta, scale, initial_state, output_final_state,
                   use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, False,
                   state_v_first, cu_seqlens, ssm_state_indices, num_accepted_tokens, inplace_final_state, kwargs)

    def fused_recurrent_comba(q, k, p, v, g, beta=None, scale=None, initial_state=None, output_final_state=False,
                              use_qk_l2norm_in_kernel=False, cu_seqlens=None, *, state_v_first=False,
                              use_gate_in_kernel=False, A_log=None, dt_bias=None, use_beta_sigmoid_in_kernel=False,
                              ssm_state_indices=None, num_accepted_tokens=None, inplace_final_state=True, **kwargs):
        return run(frame(), "fused_recurrent_comba", True, q, k, v, p, g, beta, scale, initial_state,
                   output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias,
                   use_beta_sigmoid_in_kernel, False, state_v_first, cu_seqlens, ssm_state_indices,
                   num_accepted_tokens, inplace_final_state, kwargs)

    made = (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, chunk_comba, fused_recurrent_comba)
    for f in made:
        f.__module__, f.__qualname__, f.__doc__ = module, f.__name__, docs[f.__name__]
    return made
