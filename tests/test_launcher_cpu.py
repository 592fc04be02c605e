"""The launcher's workspaces, without a GPU: the driver calls a launch makes are replaced by recorders, so that what
each kernel would receive in its workspace slot is read as it is launched."""

import threading

import numpy
import pytest

cupy = pytest.importorskip("cupy")

from cupy_comba import _launcher  # noqa: E402


class _Buffer:
    """What _launcher._allocate returns: a size and a device address."""

    addresses = iter(range(1 << 40, 1 << 41, 1 << 32))

    def __init__(self, nbytes):
        self.nbytes = nbytes
        self.data = type("Pointer", (), {"ptr": next(self.addresses)})()


class _Kernel:
    def __init__(self, ptr):
        self.kernel = type("Function", (), {"ptr": ptr})()


@pytest.fixture
def driver(monkeypatch):
    """Launches recorded as ``(function, stream, workspace slot)``; allocations as _Buffer; streams that capture
    named in ``capturing``; ``hold`` makes the launch of one function wait on an event."""
    rec = type("Driver", (), {})()
    rec.launches, rec.capturing, rec.hold = [], set(), {}
    rec.lock = threading.Lock()
    launchers = []

    def launch_kernel(fn, gx, gy, gz, bx, by, bz, shared, stream, argv, extra):
        launcher = next(x for x in launchers if x._argv == argv)
        with rec.lock:
            rec.launches.append((fn, stream, launcher._slots[_launcher._WORKSPACE]))
        if fn in rec.hold:
            started, release = rec.hold[fn]
            started.set()
            assert release.wait(5)

    monkeypatch.setattr(cupy.cuda.driver, "launchKernel", launch_kernel)
    monkeypatch.setattr(cupy.cuda.runtime, "streamIsCapturing", lambda stream: stream in rec.capturing)
    monkeypatch.setattr(_launcher, "_allocate", _Buffer)
    monkeypatch.setattr(_launcher, "_DRIVER", None)  # plain launches: no graphs
    monkeypatch.setattr(_launcher, "_LAUNCH_EX", None)
    monkeypatch.setattr(_launcher, "_WORKSPACES", type(_launcher._WORKSPACES)())
    monkeypatch.setattr(_launcher, "_CAPTURED", {})

    def make(workspace, prep, scan):
        """A prefill-like Launcher: kernel ``prep`` then ``scan``, ``workspace`` bytes."""
        params = numpy.zeros((), _launcher.PARAMS)[()]
        launcher = _launcher.Launcher(_Kernel(scan), (4, 1, 1), 128, params, numpy.float32(1), 0,
                                      before=[(_Kernel(prep), (8, 1, 1), 128, 0)], workspace=workspace)
        launchers.append(launcher)
        return launcher

    rec.make, rec.register = make, launchers.append
    return rec


POINTERS = tuple(range(0x1000, 0x1000 + 16 * _launcher.N_POINTERS, 16))


def test_calls_on_one_stream_share_one_workspace_grown_to_the_largest(driver, monkeypatch):
    """Plans of different sizes on one stream use one buffer, grown (in WORKSPACE_STEP steps) when a call needs
    more and reused by smaller calls; each kernel finds the buffer's address in its workspace slot."""
    step = _launcher.WORKSPACE_STEP
    small, large, middle = driver.make(3 * step // 2, 1, 2), driver.make(5 * step, 3, 4), driver.make(step, 5, 6)
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 0)
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda: type("Stream", (), {"ptr": 7})())
    for launcher in (small, large, middle, small):
        launcher(POINTERS, 0)  # on device 0's current stream, 7
    scratch = _launcher.workspace(0, 7)
    assert scratch.buffer.nbytes == 5 * step
    first = driver.launches[0][2]
    assert [at for _, _, at in driver.launches[2:]] == [scratch.buffer.data.ptr] * 6
    assert first != scratch.buffer.data.ptr  # the 2 MiB buffer of the first call, let go when the second grew it
    assert [fn for fn, _, _ in driver.launches] == [1, 2, 3, 4, 5, 6, 1, 2]
    assert len(_launcher._WORKSPACES) == 1


def test_streams_devices_and_per_thread_default_streams_have_their_own(driver):
    """A workspace a (device, stream); cudaStreamPerThread is a different stream in every thread, so each thread
    gets its own there, where every thread shares the legacy default stream's."""
    launcher = driver.make(1000, 1, 2)
    per_thread = _launcher._PER_THREAD_STREAM
    for stream, device in ((7, 0), (8, 0), (7, 1), (0, 0), (per_thread, 0)):
        launcher._launch(POINTERS, stream, device)
    others = []

    def other_thread():
        for stream in (per_thread, 0):
            others.append(_launcher.workspace(0, stream))

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join()
    assert others[0] is not _launcher.workspace(0, per_thread)
    assert others[1] is _launcher.workspace(0, 0)
    addresses = [at for fn, _, at in driver.launches if fn == 1]
    assert len(set(addresses)) == 5


def test_at_most_max_workspaces_are_kept(driver, monkeypatch):
    """Past MAX_WORKSPACES streams the least recently used one is let go (a new one is made if it comes back), and
    release_workspace lets go of one."""
    monkeypatch.setattr(_launcher, "MAX_WORKSPACES", 3)
    launcher = driver.make(1000, 1, 2)
    for stream in (10, 11, 12, 10, 13):
        launcher._launch(POINTERS, stream, 0)
    assert [key[1] for key in _launcher._WORKSPACES] == [12, 10, 13]
    _launcher.release_workspace(0, 10)  # a stream about to be destroyed (the timing helpers')
    assert [key[1] for key in _launcher._WORKSPACES] == [12, 13]


def test_a_capture_pins_the_workspace_it_used(driver):
    """A captured graph holds the workspace's address: that buffer stays allocated after the stream's workspace
    grows past it."""
    step = _launcher.WORKSPACE_STEP
    small, large = driver.make(step, 1, 2), driver.make(4 * step, 3, 4)
    small._launch(POINTERS, 7, 0)
    driver.capturing.add(7)
    small._launch(POINTERS, 7, 0)
    captured = _launcher.workspace(0, 7).buffer
    driver.capturing.clear()
    large._launch(POINTERS, 7, 0)
    assert _launcher.workspace(0, 7).buffer is not captured
    assert list(_launcher._CAPTURED.values()) == [captured]


@pytest.mark.parametrize("same_stream", [True, False])
def test_a_call_s_kernels_are_not_interleaved_with_another_call_s_on_its_stream(driver, same_stream):
    """Two threads, two plans: while one thread is between its prep and its scan, the other's launches on the same
    stream wait (its prep would overwrite the records the scan reads); on another stream they go ahead."""
    first, second = driver.make(1000, 1, 2), driver.make(2000, 3, 4)
    started, release = threading.Event(), threading.Event()
    driver.hold[1] = (started, release)
    one = threading.Thread(target=first._launch, args=(POINTERS, 7, 0))
    one.start()
    assert started.wait(5)
    two = threading.Thread(target=second._launch, args=(POINTERS, 7 if same_stream else 8, 0))
    try:
        two.start()
        two.join(0.3)
        waited = two.is_alive()
    finally:
        release.set()
        one.join(5)
        two.join(5)
    assert waited == same_stream
    order = [fn for fn, _, _ in driver.launches]
    assert order == ([1, 2, 3, 4] if same_stream else [1, 3, 4, 2])


def test_a_launcher_without_workspace_takes_none(driver):
    """The decode and token-loop kernels: no workspace is made, the slot keeps the caller's pointer."""
    params = numpy.zeros((), _launcher.PARAMS)[()]
    launcher = _launcher.Launcher(_Kernel(9), (4, 1, 1), 128, params, numpy.float32(1))
    driver.register(launcher)
    launcher._launch(POINTERS, 7, 0)
    assert launcher._slots[_launcher._WORKSPACE] == POINTERS[_launcher._WORKSPACE]
    assert not _launcher._WORKSPACES


def test_the_sanitizer_scripts_give_each_call_a_workspace_at_its_size(driver, monkeypatch):
    """tests/sanitized.py: under compute-sanitizer every call allocates its own workspace, at its size (no 1 MiB
    steps, no buffer a larger call left), so that memcheck sees a kernel run past its records."""
    import sanitized

    monkeypatch.setattr(_launcher, "workspace", _launcher.workspace)  # restored after the test
    monkeypatch.setattr(_launcher, "WORKSPACE_STEP", _launcher.WORKSPACE_STEP)
    freed = []
    monkeypatch.setattr(cupy, "get_default_memory_pool", lambda: type("Pool", (), {
        "free_all_blocks": lambda self: freed.append(True)})())
    sizes = []
    monkeypatch.setattr(_launcher, "_allocate", lambda nbytes: sizes.append(nbytes) or _Buffer(nbytes))
    sanitized.exact_workspaces()
    large, small = driver.make(5000, 1, 2), driver.make(3000, 3, 4)
    large._launch(POINTERS, 7, 0)
    small._launch(POINTERS, 7, 0)
    first, second = driver.launches[0][2], driver.launches[2][2]
    assert first != second and sizes == [5000, 3000] and len(freed) == 2
    assert not _launcher._WORKSPACES
