"""The memory roofline a kernel is judged against: a device-to-device copy, measured now.

Bandwidth counts bytes read plus bytes written.  Two copies are timed over a
buffer well above 4x the L2 cache: ``cudaMemcpyAsync`` device-to-device and
a vectorised float4 copy kernel (``kernels_cu/copy.cu``).  The better of the
two is the denominator of every "fraction of copy".
"""

from dataclasses import asdict, dataclass

import numpy

from .._backend import cupy
from .._build import get_kernel
from .timing import time_calls, time_cpu


@dataclass
class Roofline:
    backend: str
    buffer_bytes: int
    memcpy_gbps: float
    kernel_gbps: float
    peak_gbps: float | None

    @property
    def copy_gbps(self):
        return max(self.memcpy_gbps, self.kernel_gbps)

    def as_dict(self):
        return dict(asdict(self), copy_gbps=self.copy_gbps)


def theoretical_peak_gbps(device=None):
    """DRAM peak from the device's memory clock and bus width (double data rate)."""
    dev = cupy.cuda.Device(device)
    clock_khz = dev.attributes.get("MemoryClockRate")
    bus_bits = dev.attributes.get("GlobalMemoryBusWidth")
    if not clock_khz or not bus_bits:
        return None
    return 2.0 * clock_khz * 1e3 * bus_bits / 8 / 1e9


def default_buffer_bytes(device=None):
    """8x the L2 cache, at least 1 GiB: no copy or kernel timed here is served by L2."""
    l2 = cupy.cuda.Device(device).attributes.get("L2CacheSize", 64 << 20)
    return max(1 << 30, 8 * l2)


def measure_copy(buffer_bytes=None, *, iters=20, warmup=3):
    """Copy bandwidth of the current CUDA device (see module docstring)."""
    device = cupy.cuda.Device().id
    nbytes = buffer_bytes or default_buffer_bytes(device)
    nbytes -= nbytes % 64
    src = cupy.random.default_rng(0).random(nbytes // 4, dtype=cupy.float32)
    dst = cupy.empty_like(src)
    kernel = get_kernel("copy.cu", "comba::copy_float4", device)
    sms = cupy.cuda.Device(device).attributes["MultiProcessorCount"]
    n4 = numpy.int64(nbytes // 16)
    stream = cupy.cuda.get_current_stream()

    def memcpy():
        cupy.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, nbytes,
                                      cupy.cuda.runtime.memcpyDeviceToDevice, stream.ptr)

    def copy_kernel():
        kernel((sms * 4,), (512,), (src, dst, n4))

    # Each call moves gigabytes, so launch overhead is noise: plain events around one call.
    # (A memcpy captured into a CUDA graph may run on a copy engine, slower than the SMs.)
    t_memcpy = time_calls(memcpy, iters=iters, warmup=warmup)
    t_kernel = time_calls(copy_kernel, iters=iters, warmup=warmup)
    if not bool(cupy.array_equal(src, dst)):
        raise RuntimeError("copy kernel produced a wrong copy")
    moved = 2.0 * nbytes
    return Roofline("cuda", nbytes, moved / t_memcpy / 1e3, moved / t_kernel / 1e3, theoretical_peak_gbps(device))


def measure_copy_cpu(buffer_bytes=256 << 20, *, iters=5):
    """NumPy fallback: host memory copy bandwidth (labelled as such by the callers)."""
    src = numpy.random.default_rng(0).random(buffer_bytes // 8)
    dst = numpy.empty_like(src)
    t = time_cpu(lambda: numpy.copyto(dst, src), iters=iters)
    gbps = 2.0 * src.nbytes / t.median_us / 1e3
    return Roofline("numpy", src.nbytes, gbps, gbps, None)
