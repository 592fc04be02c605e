"""The experiment behind the kernels of delta_rule.cu: CTA tiling and cache hints of the state accesses.

    PYTHONPATH=. python benchmarks/state_access_experiment.py

A minimal fp32 Comba step kernel (CTA per COLS-column slab, RG row groups) and a
scale-only kernel of the same access pattern, for hints 0 = plain, 1 = `.cs` loads and
stores, 2 = `ld.global.nc.L1::no_allocate`; functional and in place; against the op's own
tilings and a same-size memcpy.  docs/design.md quotes the results.
"""

import statistics
import cupy
import numpy
from cupy_comba.bench import measure_copy
from cupy_comba.comba import _decode_step
from cupy_comba.inputs import decode_inputs
from cupy_comba import reference, bfloat16

SRC = r"""
template <int HINT> __device__ __forceinline__ float4 ld(const float* p) {
  if constexpr (HINT == 1) return __ldcs(reinterpret_cast<const float4*>(p));
  else if constexpr (HINT == 2) { float4 r; asm volatile("ld.global.nc.L1::no_allocate.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(r.x),"=f"(r.y),"=f"(r.z),"=f"(r.w) : "l"(p)); return r; }
  else return *reinterpret_cast<const float4*>(p);
}
template <int HINT> __device__ __forceinline__ void st(float* p, float4 x) {
  if constexpr (HINT == 1) __stcs(reinterpret_cast<float4*>(p), x);
  else *reinterpret_cast<float4*>(p) = x;
}
template <int K, int COLS, int RG, int HINT>
__global__ void __launch_bounds__(COLS / 4 * RG) slab(const float* S, float* So, const float* __restrict__ q,
    const float* __restrict__ k, const float* __restrict__ p, const float* __restrict__ v,
    const float* __restrict__ beta, const float* __restrict__ g, float* __restrict__ o, int V, float scale) {
  constexpr int LC = COLS / 4, NT = LC * RG, R = K / RG;
  __shared__ float sv[3][K];
  __shared__ float4 red[2][RG][LC];
  __shared__ float rqk[RG];
  const int tid = threadIdx.x, lc = tid % LC, rg = tid / LC;
  const int slabs = V / COLS;
  const long long bh = blockIdx.x / slabs;
  const int col = (blockIdx.x % slabs) * COLS + lc * 4;
  const float* src = S + bh * K * V + col;
  float4 s[R];
#pragma unroll
  for (int i = 0; i < R; ++i) s[i] = ld<HINT>(src + (long long)(rg + i * RG) * V);
  for (int j = tid; j < K; j += NT) { sv[0][j] = q[bh * K + j]; sv[1][j] = k[bh * K + j]; sv[2][j] = p[bh * K + j]; }
  const float4 vv = *reinterpret_cast<const float4*>(v + bh * V + col);
  const float bt = beta[bh], e = expf(g[bh]);
  __syncthreads();
  float4 P = make_float4(0.f, 0.f, 0.f, 0.f), Q = P; float qk = 0.f;
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int r = rg + i * RG; const float pr = sv[2][r], qr = sv[0][r];
    P.x = fmaf(pr, s[i].x, P.x); P.y = fmaf(pr, s[i].y, P.y); P.z = fmaf(pr, s[i].z, P.z); P.w = fmaf(pr, s[i].w, P.w);
    Q.x = fmaf(qr, s[i].x, Q.x); Q.y = fmaf(qr, s[i].y, Q.y); Q.z = fmaf(qr, s[i].z, Q.z); Q.w = fmaf(qr, s[i].w, Q.w);
    qk = fmaf(qr, sv[1][r], qk);
  }
  red[0][rg][lc] = P; red[1][rg][lc] = Q; if (lc == 0) rqk[rg] = qk;
  __syncthreads();
  P = red[0][0][lc]; Q = red[1][0][lc]; qk = rqk[0];
#pragma unroll
  for (int w = 1; w < RG; ++w) { float4 a = red[0][w][lc], c = red[1][w][lc];
    P.x += a.x; P.y += a.y; P.z += a.z; P.w += a.w; Q.x += c.x; Q.y += c.y; Q.z += c.z; Q.w += c.w; qk += rqk[w]; }
  const float u0 = bt * (vv.x - e * P.x), u1 = bt * (vv.y - e * P.y), u2 = bt * (vv.z - e * P.z), u3 = bt * (vv.w - e * P.w);
  float* dst = So + bh * K * V + col;
#pragma unroll
  for (int i = 0; i < R; ++i) { const int r = rg + i * RG; const float kr = sv[1][r];
    st<HINT>(dst + (long long)r * V, make_float4(fmaf(e, s[i].x, kr * u0), fmaf(e, s[i].y, kr * u1), fmaf(e, s[i].z, kr * u2), fmaf(e, s[i].w, kr * u3))); }
  if (rg == 0) { float* ob = o + bh * V + col;
    ob[0] = scale * fmaf(e, Q.x, qk * u0); ob[1] = scale * fmaf(e, Q.y, qk * u1); ob[2] = scale * fmaf(e, Q.z, qk * u2); ob[3] = scale * fmaf(e, Q.w, qk * u3); }
}
template <int K, int COLS, int RG, int HINT>
__global__ void __launch_bounds__(COLS / 4 * RG) scale_only(const float* S, float* So, int V) {
  constexpr int LC = COLS / 4, R = K / RG;
  const int tid = threadIdx.x, lc = tid % LC, rg = tid / LC;
  const int slabs = V / COLS;
  const long long bh = blockIdx.x / slabs;
  const int col = (blockIdx.x % slabs) * COLS + lc * 4;
  const float* src = S + bh * K * V + col; float* dst = So + bh * K * V + col;
  float4 s[R];
#pragma unroll
  for (int i = 0; i < R; ++i) s[i] = ld<HINT>(src + (long long)(rg + i * RG) * V);
#pragma unroll
  for (int i = 0; i < R; ++i) st<HINT>(dst + (long long)(rg + i * RG) * V, make_float4(0.5f*s[i].x, 0.5f*s[i].y, 0.5f*s[i].z, 0.5f*s[i].w));
}
"""
CFGS = [
    (c, r, h)
    for (c, r) in [(32, 4), (64, 4), (128, 4), (32, 8), (64, 8), (128, 8), (64, 2), (16, 2), (16, 4)]
    for h in (0, 1, 2)
]
K = 128
names = [f"slab<{K},{c},{r},{h}>" for c, r, h in CFGS] + [f"scale_only<{K},{c},{r},{h}>" for c, r, h in CFGS]
mod = cupy.RawModule(code=SRC, options=("-std=c++17",), name_expressions=names)


def ev(fn, n=10, reps=7):
    fn()
    cupy.cuda.Device().synchronize()
    ts = []
    for _ in range(reps):
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        a.record()
        for _ in range(n):
            fn()
        b.record()
        b.synchronize()
        ts.append(cupy.cuda.get_elapsed_time(a, b) * 1e3 / n)
    return statistics.median(ts)


roof = measure_copy()
print(f"copy {roof.copy_gbps:.0f} (memcpy {roof.memcpy_gbps:.0f} kernel {roof.kernel_gbps:.0f})", flush=True)
res = []
for B, H in [(896, 16), (256, 16), (1792, 8)]:
    V = 128
    BH = B * H
    inputs = decode_inputs(B, H, K, V, xp=cupy, seed=1)
    state = inputs[0]
    f32 = [x.astype(cupy.float32) for x in inputs[1:]]
    q, k, v, p, beta, g = f32
    So = cupy.empty_like(state)
    o = cupy.empty((B, H, V), cupy.float32)
    nbytes = 8 * state.size
    S_ref, o_ref = reference.comba_step(state, q, k, v, p, beta, g)
    tm = ev(
        lambda: cupy.cuda.runtime.memcpyAsync(
            So.data.ptr, state.data.ptr, state.nbytes, cupy.cuda.runtime.memcpyDeviceToDevice, 0
        )
    )
    print(
        f"B={B} H={H} state {state.nbytes / 1e6:.0f} MB  memcpy-same-size {nbytes / tm / 1e3:.0f} GB/s ({nbytes / tm / 1e3 / roof.copy_gbps:.3f})",
        flush=True,
    )
    for variant in ("warp32", "warp16", "warp32k2", "pipe16"):
        ob = cupy.empty((B, H, V), bfloat16)
        t = ev(lambda: _decode_step(*inputs, None, ob, So, None, variant))
        print(f"  ours {variant:10s} {t:8.1f} us {nbytes / t / 1e3 / roof.copy_gbps:.3f}", flush=True)
    for c, r, h in CFGS:
        kern = mod.get_function(f"slab<{K},{c},{r},{h}>")
        grid = (BH * (V // c),)
        blk = (c // 4 * r,)
        So.fill(numpy.nan)
        o.fill(numpy.nan)
        run = lambda: kern(grid, blk, (state, So, q, k, p, v, beta, g, o, numpy.int32(V), numpy.float32(K**-0.5)))
        run()
        es = float(reference.relative_error(So, S_ref))
        eo = float(reference.relative_error(o, o_ref))
        t = ev(run)
        sk = mod.get_function(f"scale_only<{K},{c},{r},{h}>")
        t2 = ev(lambda: sk(grid, blk, (state, So, numpy.int32(V))))
        ti = ev(lambda: kern(grid, blk, (So, So, q, k, p, v, beta, g, o, numpy.int32(V), numpy.float32(K**-0.5))))
        print(
            f"  slab cols={c:3d} rg={r} hint={h}: {t:8.1f} us {nbytes / t / 1e3 / roof.copy_gbps:.3f}  inplace {nbytes / ti / 1e3 / roof.copy_gbps:.3f}  scale-only {nbytes / t2 / 1e3 / roof.copy_gbps:.3f}  err {es:.1e} {eo:.1e} regs {kern.num_regs}",
            flush=True,
        )
