"""Every kernel specialisation compiles with NVRTC (no GPU needed): for sm_90 without spills and with
its state accesses as wide as they are written, and a spread of them for sm_80 and sm_89."""

import itertools
import re

import numpy
import pytest

from cupy_comba import _build, families, tiling

nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="CuPy (and its NVRTC) is not installed")

SPECIALISATIONS = families.specialisations()


def _template_args(expression):
    """The template arguments of a specialisation, ``comba::name<a, b, ...>`` -> ``["a", "b", ...]``."""
    return [x.strip() for x in expression[expression.index("<") + 1:-1].split(",")]


def test_includes_are_expanded_once():
    src = _build.kernel_source("chunked.cu")
    assert "#include" not in src
    assert src.count("unsigned short float_to_bf16_bits(") == 1   # common.cuh, once
    assert src.count("struct Params {") == 1                      # params.cuh, once (also included by kv_slab.cuh)
    assert src.count("struct KvSlab {") == 1


def _expressions(kernel):
    return tuple(e for e in (kernel.expression, kernel.prep, kernel.chain) if e)


def test_the_registry_lists_every_build_once():
    counts = {source: len(e) for source, e in SPECIALISATIONS.items()}
    # token loop: 2 K x (5 kv + 2 vk tilings) + K = 256 x (3 kv + 2 vk tilings), x p or not x (T tokens + decode
    # x 4 dtype builds), vk4x2 at K = 128 and the one-warp kv tilings (2 at K = 64 and 128) x p or not,
    # decode only (x 4), and vk8x8 at K = 128 x p or not, T tokens only;
    # chunked: 2 K x 2 kv + 2 vk at K = 128, x p or not; tensor cores: 9 builds (K, slab, tokens) x p or not x
    # layout; prefill: 3 K x 2 slabs x 2 layouts x p or not scans x 5 numerics (tf32 or fp32, bf16 or wider keys;
    # bf16 products) less the 24 whose stage does not fit (K = 256, wider keys), and 3 K x 5 preps; the wgmma
    # scans: 2 K x 2 slabs x 2 layouts x p or not, and 2 K x its prep (ACC 5); the transposed one, whole and in
    # segments, 2 K x 2 layouts x p or not x one or two warpgroups a CTA, and 2 K x its prep (ACC 6); the segments'
    # chain x p or not (one warpgroup a CTA at K = 64 and with p, one or two at K = 128 without), one build for both
    # layouts; each with and without the serving options
    assert counts == {"token_loop.cu": 464, "chunked.cu": 24, "delta_rule_mma.cu": 72, "prefill.cu": 246,
                      "prefill_wgmma.cu": 36, "prefill_transposed.cu": 78, "copy.cu": 1}
    for source, expressions in SPECIALISATIONS.items():
        assert len(set(expressions)) == len(expressions), source
    reached = {e for t in families.TILINGS for sep in (True, False) for multi in (False, True)
               for f32 in (False, True) for serving in (False, True) for precision in families.PRECISIONS
               for act in families.ACT_CODES
               if (multi or not t.passes_only) and not (multi and t.decode_only)
               if t.family != "prefill_scan" or families.prefill_fits(t.K, t.slab, sep, f32)
               if t.family not in families.WGMMA_FAMILIES or (precision == "bf16" and not f32)
               for e in _expressions(families.kernel(t.layout, t.variant, K=t.K, separate_p=sep, multi=multi,
                                                     f32_keys=f32, serving=serving, precision=precision, act=act))}
    assert reached == {e for s, exprs in SPECIALISATIONS.items() if s != "copy.cu" for e in exprs}


def test_only_the_wgmma_scans_are_built_for_sm90a():
    """prefill_wgmma.cu and prefill_transposed.cu (wgmma, sm_90a instructions) get the arch-specific target on compute
    capability 9.0 and nowhere else; every other source keeps the plain options, so its cache entries stand."""
    wgmma = {"prefill_wgmma.cu", "prefill_transposed.cu"}
    assert set(_build.ARCH_SPECIFIC) == wgmma
    for source in wgmma:
        assert _build.nvrtc_options(source, "sm_90") == _build.NVRTC_OPTIONS + ("-arch=sm_90a",)
        for arch in ("sm_80", "sm_89", "sm_100"):
            assert _build.nvrtc_options(source, arch) == _build.NVRTC_OPTIONS
    for source in SPECIALISATIONS:
        if source not in wgmma:
            assert _build.nvrtc_options(source, "sm_90") == _build.NVRTC_OPTIONS
    assert {t.source for t in families.TILINGS if t.family in families.WGMMA_FAMILIES} == wgmma
    # its staged key rows are K + 8 wide (WgLayout::KP), prefill_scan's K + 16 (the tensor maps' boxes follow)
    scan = {v: families.kernel("kv", v, K=128, separate_p=True, multi=True, precision="bf16", bf16_keys=True)
            for v in ("kv16c64", "kv16c64wg")}
    assert scan["kv16c64"].key_pad == 16 and scan["kv16c64wg"].key_pad == 8
    assert _build.target("prefill_wgmma.cu", "sm_90") == "sm_90a" and _build.target("prefill.cu", "sm_90") == "sm_90"


def test_the_default_half_precision_is_bf16_products():
    """precision=None (16-bit activations): bf16 products on both slabs, with a prep of their own (bf16
    fragments); fp16 keys (staged wide) take the TF32 build."""
    def scan(variant, precision, bf16_keys=True):
        return families.kernel("kv", variant, K=128, separate_p=True, multi=True, precision=precision,
                               bf16_keys=bf16_keys)
    assert scan("kv16c64", None).expression == scan("kv16c64", "bf16").expression
    assert scan("kv32c64", None).expression == scan("kv32c64", "bf16").expression
    assert scan("kv16c64", None).prep == scan("kv16c64", "bf16").prep != scan("kv16c64", "tf32").prep
    assert scan("kv16c64", None, bf16_keys=False).expression == scan("kv16c64", "tf32", False).expression
    assert len({scan("kv16c64", p).expression for p in families.PRECISIONS}) == 3


#: Serving builds that ptxas gives a small stack frame (at the 128-register cap their CTAs an SM set), and
#: its most bytes.  Every other build, and every build without the serving options, has none.
SERVING_STACK = {"comba::delta_rule_vk_chunked<128, 64, false, true>": 8,
                 "comba::delta_rule_mma<128, 32, true, true, 1, true>": 8,
                 "comba::delta_rule_mma<128, 64, true, false, 1, true>": 48,
                 "comba::delta_rule_mma<128, 64, true, true, 1, true>": 32,
                 "comba::delta_rule_mma<128, 64, true, true, 2, true>": 8,
                 "comba::delta_rule_mma<128, 64, false, false, 1, true>": 44,
                 "comba::delta_rule_mma<128, 64, false, true, 1, true>": 48,
                 # the K = 128 chain on two warpgroups, held to 128 registers for two CTAs an SM
                 "comba::prefill_scan_wt<128, false, false, false, 1, 2>": 16,
                 "comba::prefill_scan_wt<128, false, false, true, 1, 2>": 44}


@pytest.mark.parametrize("source", [s for s in SPECIALISATIONS if s != "copy.cu"])
def test_nvrtc_compiles_every_specialisation_for_sm90(source):
    builds = _build.compile_for_arch(source, SPECIALISATIONS[source], "sm_90")
    for expression, (report, ptx, notes) in builds.items():
        spill = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", report)
        regs = re.search(r"Used (\d+) registers", report)
        assert spill and regs, f"no resource report for {expression}:\n{report}"
        allowed = SERVING_STACK.get(expression, 0)
        assert all(int(x) <= allowed for x in spill.groups()), f"{expression} spills or uses a stack frame:\n{report}"
        assert int(regs.group(1)) <= 255
        # Every 8- or 16-byte state load has a store of the same width: NVRTC splits C++ float4 / float2
        # state stores into 4-byte ones (four times the L2 requests), which common.cuh's PTX stores prevent.
        loads = len(re.findall(r"ld\.global(?:\.nc)?\.v[24]\.f32", ptx))
        stores = len(re.findall(r"st\.global\.v[24]\.f32", ptx))
        wt = expression.startswith("comba::prefill_scan_wt")
        if wt and _template_args(expression)[4] == str(families.WT_SEGMENTS):
            # the segments' E maps (float4s the chain stored), at K = 128 loaded at three places: the first, a
            # composition ahead, past E_0 without an initial state
            K = int(_template_args(expression)[0])
            loads -= (3 if K == 128 else 1) * K // 8
        assert stores >= loads, f"{expression}: {loads} vector loads, {stores} vector stores"
        # The tensor-core kernel's kv build loads its state as 4-byte values (32 a lane) straight into
        # the accumulator quads (docs/design.md, "Chunks of 8 on the tensor cores").
        if source == "delta_rule_mma.cu" and _template_args(expression)[3] == "false":  # <K, SLAB, P, VK, SUBS>
            scalar = len(re.findall(r"ld\.global\.f32", ptx))
            assert scalar == 32 and loads == 0, f"{expression}: {scalar} scalar, {loads} vector state loads"
        # The wgmma scans keep their products in flight: ptxas serializes them (C7512 for registers, C7518 for a
        # divergent path) only in the K = 128 chain on two warpgroups, where products in flight need more registers
        # than two of its CTAs an SM leave (docs/design.md, "Segments").
        serialized = [n for n in notes if "serialized" in n]
        serial_chain = expression.startswith("comba::prefill_scan_wt<128,") and _template_args(expression)[4:] == \
            [str(families.WT_CHAIN), "2"]
        if source in _build.ARCH_SPECIFIC:
            assert bool(serialized) == serial_chain, f"{expression}: {serialized or 'no serialized wgmma'}"
        # that chain's 256-thread CTAs fit two an SM, in either build (docs/design.md, "Segments")
        if serial_chain:
            assert int(regs.group(1)) <= 128, f"{expression}: {regs.group(1)} registers"


def _pre_hopper_spread():
    """Every flag combination of every family, at one tiling and K: the code that differs by arch is
    the same for every tiling."""
    picks = []
    for source, expressions in SPECIALISATIONS.items():
        seen = set()
        for e in expressions:
            args = _template_args(e) if "<" in e else []
            family = e.split("<")[0]
            flags = tuple(a for a in args if a in ("true", "false")) + ((args[4],) if "mma" in family else ()) + \
                ((args[4],) if family in ("comba::prefill_scan", "comba::prefill_scan_wg") else
                 (args[1],) if "prefill_prep" in family else ()) + \
                ((args[-2] != "-1",) if family.startswith(("comba::delta_rule_kv", "comba::delta_rule_vk"))
                 and "chunked" not in family else ())  # the token loop's dtype builds
            if (family, flags) not in seen:
                seen.add((family, flags))
                picks.append((source, e))
    return picks


@pytest.mark.parametrize("arch", ["sm_80", "sm_89"])
def test_every_family_also_builds_for_pre_hopper_gpus(arch):
    picks = _pre_hopper_spread()
    # 12 + 12 token loop (the decode step for run-time dtypes and for one dtype), 8 one-warp decode steps, 4 + 4
    # chunked, 16 tensor cores, 5 + 20 prefill (numerics, x p x layout), 4 wgmma scans (p x layout) and their prep,
    # 4 transposed scans (p x layout) and their prep (each with and without serving), the copy; the wgmma scans
    # build empty there
    assert len(picks) == 127
    for source in SPECIALISATIONS:
        expressions = [e for s, e in picks if s == source]
        assert set(_build.compile_for_arch(source, expressions, arch)) == set(expressions)


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("K", families.SUPPORTED_K)
@pytest.mark.parametrize("multi", [False, True], ids=["decode", "multi"])
def test_the_chosen_tiling_can_run_every_supported_v(layout, K, multi):
    for V in range(32, 513, 32):
        for separate_p in (True, False):
            for T in (1, 2, 3, 4, 5, 8, 9, 64):
                for heads in (None, 1, 16, 1024):
                    variant = tiling.choose(layout, K, V, separate_p, multi, T, heads)
                    assert variant in families.variants(layout, K, V, multi), (V, separate_p, T, heads, variant)


def test_mma_stage_bytes_is_the_struct_size():
    """families.mma_stage_bytes (the tensor-core kernel's dynamic shared memory, passed at launch) equals
    NVRTC's sizeof(MmaStage) for every specialisation: a smaller launch would run past the CTA's shared
    memory."""
    checks = []
    for expression in SPECIALISATIONS["delta_rule_mma.cu"]:
        K, slab, sep, _, subs, serving = _template_args(expression)
        if serving == "true":
            continue  # the same stages
        n = families.mma_stage_bytes(int(K), int(slab), sep == "true", 8 * int(subs))
        checks.append(f'static_assert(sizeof(comba::MmaStage<{K}, {slab}, {sep}, {subs}>) == {n}, "{expression}");')
    assert len(checks) == 36
    _compiles_with("delta_rule_mma.cu", checks)


def _compiles_with(source, lines):
    """NVRTC compiles ``kernels_cu/<source>`` with ``lines`` (static_asserts) after it, else the test fails with
    NVRTC's log."""
    text = _build.kernel_source(source) + "\n" + "\n".join(lines) + "\n"
    prog = nvrtc.createProgram(text, "static_asserts.cu", (), ())
    try:
        try:
            nvrtc.compileProgram(prog, _build.NVRTC_OPTIONS + ("--gpu-architecture=compute_90",))
        except nvrtc.NVRTCError:
            pytest.fail(nvrtc.getProgramLog(prog))
    finally:
        nvrtc.destroyProgram(prog)


def test_params_struct_is_the_packed_block():
    """struct Params (kernels_cu/params.cuh) has the size and the field offsets of _launcher.PARAMS, which every
    launch packs: a field out of place would hand every kernel wrong shapes."""
    from cupy_comba._launcher import PARAMS, PARAMS_FIELDS
    lines = [f'static_assert(sizeof(comba::Params) == {PARAMS.itemsize}, "sizeof");']
    lines += [f'static_assert(__builtin_offsetof(comba::Params, {n}) == {PARAMS.fields[n][1]}, "{n}");'
              for n in PARAMS_FIELDS]
    _compiles_with("token_loop.cu", lines)
    assert len(PARAMS_FIELDS) == PARAMS.itemsize // 8


def test_the_chain_s_end_words_are_the_workspace_s():
    """The workspace bytes _plan keeps past the prefill records for the segmented scan's chain (CHAIN_DONE_BYTES) are
    kernels_cu/prefill.cuh's kChainDoneWords, a whole number of 128-byte lines: the maps after them stay line-aligned
    and where the kernels look for them."""
    from cupy_comba._plan import CHAIN_DONE_BYTES
    assert CHAIN_DONE_BYTES % 128 == 0
    _compiles_with("prefill.cu", [f'static_assert(comba::kChainDoneWords * 4 == {CHAIN_DONE_BYTES}, "end words");'])


def test_the_kernels_l2_norm_epsilon_is_the_reference_s():
    """kernels_cu/params.cuh's kL2NormEps, which every kernel adds to a key's sum of squares, is the reference's."""
    from cupy_comba.reference import L2NORM_EPS
    _compiles_with("token_loop.cu", [f'static_assert(comba::kL2NormEps == {float(numpy.float32(L2NORM_EPS))!r}f, '
                                     '"epsilon");'])


def test_programmatic_launch_config_is_cuda_h_layout():
    """The ctypes ``CUlaunchConfig`` and ``CUlaunchAttribute`` that dependent launches hand cuLaunchKernelEx have
    cuda.h's sizes and offsets (CUDA 12: seven uints, the stream at 32, the attributes at 40, their count at 48; an
    attribute a 4-byte id padded to 8 and a 64-byte value), and a dependent launch's config asks for programmatic
    stream serialization (attribute 6, value 1) with the kernel's grid, block and shared memory."""
    import ctypes
    from cupy_comba._launcher import _LaunchAttribute, _LaunchConfig, _programmatic
    assert ctypes.sizeof(_LaunchAttribute) == 72 and _LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(_LaunchConfig) == 56
    assert (_LaunchConfig.shared_bytes.offset, _LaunchConfig.stream.offset, _LaunchConfig.attrs.offset,
            _LaunchConfig.num_attrs.offset) == (24, 32, 40, 48)
    config = _programmatic((96, 2, 1), 128, 70000)
    assert (list(config.grid), list(config.block), config.shared_bytes, config.num_attrs) == ([96, 2, 1], [128, 1, 1],
                                                                                              70000, 1)
    assert (config.attrs[0].id, config.attrs[0].value) == (6, 1)


def test_which_prefill_scans_launch_as_dependents():
    """The whole scans launch as programmatic dependents of their prep, but for those of one-warpgroup CTAs at
    K = 64 (the wgmma scan, the transposed scan on 64 columns); the segmented scan's chain and segments launch in
    turn but on two warpgroups a CTA at K = 128 (docs/design.md, "Host path"); the segments on pairs run their chain
    on two warpgroups a CTA at K = 128 where p is k only."""
    def kernel(variant, K, separate_p=True):
        return families.kernel(variant[:2], variant, K=K, separate_p=separate_p, multi=True, bf16_keys=True,
                               precision="bf16")

    assert kernel("kv16c64wg", 128).dependent and kernel("vk32c64wg", 128).dependent
    assert not kernel("kv16c64wg", 64).dependent and not kernel("vk32c64wg", 64).dependent
    assert all(kernel(v, K).dependent for v in ("kv16c64", "vk128c64wt") for K in (64, 128))
    assert kernel("kv64c64wt", 128).dependent and not kernel("kv64c64wt", 64).dependent
    assert not any(kernel(v, K).dependent for v in ("kv64c64sg", "vk64c64sg") for K in (64, 128))
    assert kernel("vk128c64sg", 128).dependent and kernel("kv128c64sg", 128, False).dependent
    assert not kernel("kv128c64sg", 64).dependent
    assert [kernel("kv128c64sg", K, False).chain_block for K in (64, 128)] == [128, 256]
    assert kernel("kv128c64sg", 128).chain_block == kernel("kv64c64sg", 128, False).chain_block == 128


def test_serving_plans_run_the_chain_s_serving_build():
    """The segmented scan's chain reads no state and writes no o: one build serves both layouts, and a plan with
    serving options runs its serving build, which finds a ragged batch's rows (docs/design.md, "Segments")."""
    for (variant, K), sep in itertools.product((("kv128c64sg", 128), ("vk128c64sg", 128), ("kv64c64sg", 64)),
                                               ("true", "false")):
        dense, serving = (families.kernel(variant[:2], variant, K=K, separate_p=sep == "true", multi=True,
                                          serving=flag, precision="bf16") for flag in (False, True))
        assert dense.chain == f"comba::prefill_scan_wt<{K}, {sep}, false, false, {families.WT_CHAIN}, " \
                              f"{dense.chain_block // 128}>"
        assert serving.chain == dense.chain.replace(f"{sep}, false, false", f"{sep}, false, true")
        assert ", true, " in serving.expression and serving.prep == dense.prep.replace("false>", "true>")


def test_prefill_shared_bytes_are_the_layouts():
    """families.prefill_scan_bytes and prefill_prep_bytes (the dynamic shared memory the launch passes) equal
    ScanLayout::BYTES (kernels_cu/prefill.cu) and PrepLayout::BYTES (prefill_prep.cuh) for every build, the
    workspace's record sizes Record::SIZE (a stage holds its own precision's record), and prefill_fits names exactly
    the builds whose stage fits."""
    checks, wgmma_checks = [], {"prefill_wgmma.cu": [], "prefill_transposed.cu": []}
    for source, source_checks in wgmma_checks.items():
        for expression in SPECIALISATIONS[source]:
            args = _template_args(expression)
            if expression.startswith("comba::prefill_prep"):
                K, acc, _ = args
                assert acc == {"prefill_wgmma.cu": "5", "prefill_transposed.cu": "6"}[source]
                source_checks.append(f'static_assert(comba::PrepLayout<{K}, false>::BYTES == '
                                     f'{families.prefill_prep_bytes(int(K), False)} && comba::PrepLayout<{K}, false>::'
                                     f'SHARED_P_BYTES == {families.prefill_prep_bytes(int(K), False, False)}, '
                                     f'"{expression}");')
            elif expression.startswith("comba::prefill_scan_wt"):
                K, sep, _, _, part, wgs = args
                chain = part == "1"
                layout = f'comba::WtLayout<{K}, {"true" if chain else "false"}, {sep}, {wgs}>'
                n = families.prefill_wt_bytes(int(K), sep == "true", chain, int(wgs))
                source_checks.append(f'static_assert({layout}::BYTES == {n}, "{expression}");')
            else:
                K, slab, sep, _, _ = args
                n = families.prefill_wg_bytes(int(K), int(slab), sep == "true")
                ring = families.prefill_wg_bytes(int(K), int(slab), sep == "true", ring=True)
                layout = f"comba::WgLayout<{K}, {slab}, {sep}, {families.PREFILL_RECORD_BF16}>"
                source_checks.append(f'static_assert({layout}::BYTES == {n} && {layout}::RING == '
                                     f'{"true" if ring else "false"} && (!{layout}::RING || {layout}::RING_BYTES == '
                                     f'{ring}), "{expression}");')
    wg_checks, wt_checks = wgmma_checks.values()
    assert families.prefill_record(5) == families.PREFILL_RECORD_BF16
    wg_checks.append(f'static_assert(comba::Record<5>::SIZE == {families.PREFILL_RECORD_BF16}, "ACC 5");')
    wg_checks.append(f'static_assert(comba::kWgRingChunks == {families.WG_RING_CHUNKS}, "the ring");')
    wt_checks.append(f'static_assert(comba::WtRecord::SIZE == {families.WT_RECORD}, "ACC 6");')
    wt_checks.append(f'static_assert(comba::kWtWhole == {families.WT_WHOLE} && comba::kWtChain == {families.WT_CHAIN} '
                     f'&& comba::kWtSegments == {families.WT_SEGMENTS}, "WtPart");')
    assert (len(wg_checks), len(wt_checks)) == (38, 80)
    for source, source_checks in wgmma_checks.items():
        _compiles_with(source, source_checks)
    for expression in SPECIALISATIONS["prefill.cu"]:
        args = _template_args(expression)
        if expression.startswith("comba::prefill_prep"):
            K, acc, _ = args
            wide = int(acc) in (2, 3)
            layout = f'comba::PrepLayout<{K}, {"true" if wide else "false"}>'
            checks.append(f'static_assert({layout}::BYTES == {families.prefill_prep_bytes(int(K), wide)} && '
                          f'{layout}::SHARED_P_BYTES == {families.prefill_prep_bytes(int(K), wide, False)}, '
                          f'"{expression}");')
        else:
            K, slab, sep, _, acc, _ = args
            wide = int(acc) in (2, 3)
            words = families.prefill_record(int(acc))
            checks.append(f'static_assert(comba::Record<{acc}>::SIZE == {words}, "{expression}");')
            assert families.prefill_fits(int(K), int(slab), sep == "true", wide)
            n = families.prefill_scan_bytes(int(K), int(slab), sep == "true", wide, words)
            checks.append(f'static_assert(comba::ScanLayout<{K}, {slab}, {sep}, {"true" if wide else "false"}, '
                          f'{words}>::BYTES == {n}, "{expression}");')
    assert len(checks) == 246 + 216
    _compiles_with("prefill.cu", checks)
    # what does not fit is not built: K = 256 with fp32 keys, except Gated DeltaNet on 16-column slabs
    assert [(K, slab, sep) for K in families.SUPPORTED_K for slab in families.PREFILL_SLABS for sep in (True, False)
            if not families.prefill_fits(K, slab, sep, True)] == [(256, 32, True), (256, 32, False), (256, 16, True)]
    assert all(families.prefill_fits(K, slab, sep, False) for K in families.SUPPORTED_K
               for slab in families.PREFILL_SLABS for sep in (True, False))


def test_chunk_slots_of_a_ragged_batch_are_distinct():
    """The slot formula of kernels_cu/prefill.cuh ("Workspace"): no two chunks of a ragged batch share a
    record, and every one lies below families.prefill_slots."""
    rng = numpy.random.default_rng(0)
    for _ in range(500):
        lens = rng.integers(0, 300, rng.integers(1, 12))
        lens[rng.random(lens.shape) < 0.2] = 0
        starts = numpy.concatenate([[0], numpy.cumsum(lens)])[:-1]
        slots = [s // 64 + n + c for n, (s, ln) in enumerate(zip(starts, lens)) for c in range(-(-ln // 64))]
        assert len(set(slots)) == len(slots)
        assert max(slots, default=-1) < families.prefill_slots(len(lens), int(lens.sum()), True)
    assert families.prefill_slots(3, 129, False) == 9 and families.prefill_slots(3, 0, False) == 0


def test_the_decode_step_runs_the_build_for_its_activations():
    """A decode step whose q, k, p, v and o share a dtype and a unit last stride runs the build for that dtype
    (families.kernel's ``act``, the code of _dtypes.ACTIVATION_CODES); mixed dtypes or strided rows the build that
    reads them at run time."""
    from cupy_comba import _plan, bfloat16
    from cupy_comba._dtypes import ACTIVATION_CODES
    from cupy_comba.inputs import decode_inputs

    def act(arrays, o_dtype=None, out=None):
        state, q, k, v, p, beta, g = arrays
        plan = _plan._new_plan(True, (q, k, v, p, beta, g, state, out, None) + (None,) * 6, None, True, o_dtype,
                               "kv", "log", False, None, False, None, None)
        return _plan._activation_build(plan.signature)

    for dtype in (numpy.float32, numpy.float16, bfloat16):
        arrays = decode_inputs(2, 4, 64, 64, dtype=dtype, seed=1)
        assert act(arrays) == ACTIVATION_CODES[numpy.dtype(arrays[1].dtype)]
        assert act(arrays, o_dtype="float32" if dtype != numpy.float32 else "float16") is None  # o apart
    state, q, k, v, p, beta, g = decode_inputs(2, 4, 64, 64, seed=1)
    assert act((state, q, k, v, None, beta, g)) == 2  # Gated DeltaNet: no p
    assert act((state, q, k, v, p.astype(numpy.float32), beta, g)) is None
    assert act((state, q, k, v, p, beta.astype(numpy.float32), g.astype(numpy.float16))) == 2  # gates apart: read
    wide = numpy.zeros(q.shape[:-1] + (2 * q.shape[-1],), q.dtype)
    wide[..., ::2] = q
    assert act((state, wide[..., ::2], k, v, p, beta, g)) is None  # a strided row
    out = numpy.zeros((2, 4, 2 * 64), q.dtype)[..., ::2]
    assert act((state, q, k, v, p, beta, g), out=out) is None


def test_the_few_heads_decode_tilings_launch_a_grid_of_heads():
    """kv16w / kv8w and vk4x2's decode step launch a grid of (b, h, slab) (families.Kernel.grid3, Params::grid3);
    every other build B * H * slabs CTAs in x; a grid over 65535 in y or z is refused with the variant named."""
    from cupy_comba import _validate

    def grid(layout, variant, multi=False):
        return families.kernel(layout, variant, K=128, separate_p=False, multi=multi, act=2).grid(3, 5, 128)

    assert grid("kv", "kv16w") == (3, 5, 8) and grid("kv", "kv8w") == (3, 5, 16)
    assert grid("vk", "vk4x2") == (3, 5, 16)
    assert grid("kv", "kv64x8") == (30, 1, 1) and grid("vk", "vk16x2") == (60, 1, 1)
    assert grid("kv", "kv16x32", multi=True) == (120, 1, 1)
    _validate.check_grid((1, 65535, 8), 1, 65535, "kv16w")
    with pytest.raises(ValueError, match=r"variant 'kv16w' launches a grid of \(1, 65536, 8\) CTAs, at most 65535"):
        _validate.check_grid((1, 65536, 8), 1, 65536, "kv16w")
    with pytest.raises(ValueError, match="split the batch"):
        _validate.check_grid((2 ** 31, 1, 1), 2 ** 24, 128, "kv64x8")
