"""The ops on two GPUs, from one thread and from one thread per device (``pytest -m gpu``; skipped where
fewer than two CUDA devices are visible)."""

import threading

import numpy
import pytest

from cupy_comba import _build, _launcher, _plan, comba_decode_step, comba_forward, gated_delta_decode_step, reference
from cupy_comba.inputs import decode_inputs, forward_inputs

cupy = pytest.importorskip("cupy")


def _devices():
    try:
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 - no driver (a CPU machine)
        return 0


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_devices() < 2, reason="needs two GPUs")]

#: Copies n bytes after spinning for `cycles` clock ticks: work queued ahead of an op on the same stream.
_SPIN_COPY = r"""
extern "C" __global__ void spin_copy(unsigned char* dst, const unsigned char* src, long long n, long long cycles) {
    const long long start = clock64();
    while (clock64() - start < cycles) {
    }
    for (long long i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}
"""


def _on(device, arrays):
    with cupy.cuda.Device(device):
        return [None if a is None else cupy.asarray(a) for a in arrays]


def _host(arrays):
    return [None if a is None else cupy.asnumpy(a) for a in arrays]


def test_arrays_on_device_1_run_there_on_its_current_stream():
    """Device 0 current, the arrays on device 1: the op runs on device 1, ordered on device 1's current
    stream behind work queued there, and equals the same call made with device 1 current."""
    state, q, k, v, p, beta, g = decode_inputs(8, 4, 128, 128, seed=1)
    args1 = _on(1, (state, q, k, v, p, beta, g))
    with cupy.cuda.Device(1):
        S_ref, o_ref = comba_decode_step(*args1)
        fresh_q = cupy.asarray(decode_inputs(8, 4, 128, 128, seed=2)[1])
        stream = cupy.cuda.Stream(non_blocking=True)
        spin = cupy.RawKernel(_SPIN_COPY, "spin_copy")
        S_new_ref, o_new_ref = comba_decode_step(args1[0], fresh_q, *args1[2:])
    with cupy.cuda.Device(0):
        S, o = comba_decode_step(*args1)
        assert S.device.id == 1 and o.device.id == 1
        assert bool((S == S_ref).all()) and bool((o == o_ref).all())
        with cupy.cuda.Device(1):
            stream.use()  # device 1's current stream, set while device 0 stays current for the call
            spin((1,), (256,), (args1[1], fresh_q, numpy.int64(fresh_q.nbytes), numpy.int64(40_000_000)))
        assert cupy.cuda.runtime.getDevice() == 0
        S2, o2 = comba_decode_step(*args1)  # must wait for the copy of fresh_q into q
    with cupy.cuda.Device(1):
        stream.synchronize()
        assert bool((S2 == S_new_ref).all()) and bool((o2 == o_new_ref).all())
        cupy.cuda.Stream.null.use()


def test_forward_passes_on_device_1():
    for T, variant in ((5, None), (300, "kv16c64")):
        args = forward_inputs(2, T, 4, 128, 128, seed=T, xp=numpy)
        S_ref, o_ref = reference.comba_loop(args[6], *args[:6])
        with cupy.cuda.Device(0):
            o, S = comba_forward(*_on(1, args[:6]), initial_state=_on(1, args[6:])[0], variant=variant,
                                 precision="fp32")
        assert o.device.id == 1 and S.device.id == 1
        assert reference.relative_error(S, S_ref) <= 1e-6
        assert reference.relative_error(o, o_ref) <= 4e-3


def test_arrays_on_two_devices_are_refused():
    step = decode_inputs(2, 2, 64, 64, seed=3)
    on0, on1 = _on(0, step), _on(1, step)
    with pytest.raises(ValueError, match="one device"):
        comba_decode_step(on0[0], on1[1], *on0[2:])
    args = forward_inputs(2, 5, 4, 64, 64, seed=3, xp=numpy)
    on0, on1 = _on(0, args), _on(1, args)
    with pytest.raises(ValueError, match="one device"):
        comba_forward(on0[0], on1[1], *on0[2:6], initial_state=on0[6])
    with pytest.raises(ValueError, match="one device"):
        comba_forward(*on0[:6], initial_state=on1[6])


def _per_device(fn):
    """fn(device) on one thread per device at once; their results by device, after every thread ended
    (an exception in one is raised here)."""
    results, errors = {}, []

    def run(device):
        try:
            results[device] = fn(device)
        except BaseException as e:  # noqa: BLE001 - raised by the calling thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(d,)) for d in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results


def _work(device, inputs, iterations):
    """Decode steps and forward passes (tensor-core and prefill kernels) on one device, graph launches on."""
    state, q, k, v, p, beta, g, fq, fk, fv, fp, fbeta, fg, fS = inputs
    out = []
    with cupy.cuda.Device(device):
        for _ in range(iterations):
            S, o = gated_delta_decode_step(state, q, k, v, beta, g)
            o1, S1 = comba_forward(fq[:, :16], fk[:, :16], fv[:, :16], fp[:, :16], fbeta[:, :16], fg[:, :16],
                                   initial_state=fS)
            o2, S2 = comba_forward(fq, fk, fv, fp, fbeta, fg, initial_state=fS)
            out.append((S, o, o1, S1, o2, S2))
        cupy.cuda.Device().synchronize()
    return out


def test_one_thread_per_device():
    """Two threads, one per device, many iterations each: every result equals the single-thread one; each
    device has its own plans, launchers and kernels."""
    host = list(decode_inputs(4, 4, 128, 128, seed=5)) + list(forward_inputs(1, 512, 16, 128, 128, seed=6))
    inputs = {d: _on(d, host) for d in (0, 1)}
    single = {d: _work(d, inputs[d], 1)[0] for d in (0, 1)}
    results = _per_device(lambda d: _work(d, inputs[d], 40))
    for d in (0, 1):
        for got in results[d]:
            for a, b in zip(got, single[d]):
                assert a.device.id == d and bool((a == b).all())
    plans = [p for p in _plan.PLANS.values() if p.launcher is not None]
    assert {p.device for p in plans} == {0, 1}
    for d0 in (p for p in plans if p.device == 0):
        twins = [p for p in plans if p.device == 1 and p.kernel == d0.kernel and p.signature.T == d0.signature.T]
        assert all(t.launcher is not d0.launcher and t.launcher._steps != d0.launcher._steps for t in twins)
    # the long prompt's workspace: one for each device's stream, on that device
    held = [(key[0], w.buffer) for key, w in _launcher._WORKSPACES.items() if w.buffer is not None]
    assert {d for d, _ in held} >= {0, 1} and all(buf.device.id == d for d, buf in held)


def test_first_calls_on_both_devices_compile_once_each(monkeypatch):
    """The same first call on both devices at once: one NVRTC module, one kernel loaded on each device."""
    source, expression = "token_loop.cu", "comba::delta_rule_vk<64, 8, 2, true, false, false>"
    for key in [key for key in _build._kernels if key[:2] == (source, expression)]:
        del _build._kernels[key]
    _build._modules.pop((source, expression), None)
    modules = []
    real = cupy.RawModule

    def counting(*a, **kw):
        modules.append(kw.get("name_expressions"))
        return real(*a, **kw)

    monkeypatch.setattr(cupy, "RawModule", counting)
    _plan.PLANS.clear()
    host = decode_inputs(4, 2, 64, 64, seed=7, state_layout="vk")
    inputs = {d: _on(d, host) for d in (0, 1)}
    barrier = threading.Barrier(2)

    def first(device):
        with cupy.cuda.Device(device):
            barrier.wait()
            comba_decode_step(*inputs[device], state_layout="vk", variant="vk8x2")
            cupy.cuda.Device().synchronize()

    _per_device(first)
    assert modules == [[expression]]
    assert {key[2] for key in _build._kernels if key[:2] == (source, expression)} == {0, 1}


def test_a_decode_batch_sharded_by_heads_equals_one_gpu():
    """Half the value heads (with their key heads) on each GPU: the concatenated results equal the
    one-GPU result bit for bit (the same variant on both, each head computed by its own CTAs)."""
    B, H, Hk, K, V = 16, 8, 4, 128, 128
    state, q, k, v, p, beta, g = decode_inputs(B, H, K, V, Hk=Hk, seed=8)
    with cupy.cuda.Device(0):
        S_all, o_all = comba_decode_step(*_on(0, (state, q, k, v, p, beta, g)), variant="kv64x8")
    halves = []
    for d, (hv, hk) in enumerate(((slice(0, 4), slice(0, 2)), (slice(4, 8), slice(2, 4)))):
        part = (state[:, hv], q[:, hk], k[:, hk], v[:, hv], p[:, hk], beta[:, hv], g[:, hv])
        with cupy.cuda.Device(d):
            halves.append(comba_decode_step(*_on(d, [numpy.ascontiguousarray(a) for a in part]), variant="kv64x8"))
    S_cat = numpy.concatenate([cupy.asnumpy(h[0]) for h in halves], axis=1)
    o_cat = numpy.concatenate([cupy.asnumpy(h[1]) for h in halves], axis=1)
    assert numpy.array_equal(S_cat, cupy.asnumpy(S_all))
    assert numpy.array_equal(o_cat.view(numpy.uint16), cupy.asnumpy(o_all).view(numpy.uint16))
