"""Every kernel specialisation compiles with NVRTC for sm_90 (no GPU needed) without spills, its state
accesses as wide as they are written."""

import re

import pytest

from cupy_comba import _build, tiling


def test_includes_are_expanded_once():
    src = _build.kernel_source("delta_rule.cu")
    assert "#include" not in src
    assert src.count("unsigned short float_to_bf16_bits(") == 1   # common.cuh, once
    assert src.count("struct Params {") == 1                      # params.cuh, once


def _template_args(expression):
    """The template arguments of a specialisation, ``comba::name<a, b, ...>`` -> ``["a", "b", ...]``."""
    return [x.strip() for x in expression[expression.index("<") + 1:-1].split(",")]


@pytest.mark.parametrize("module", sorted(_build.SPECIALISATIONS))
def test_nvrtc_compiles_every_specialisation_for_sm90(module):
    builds = _build.compile_for_arch(module, "sm_90")
    assert set(builds) == set(_build.SPECIALISATIONS[module][1])
    for expression, (report, ptx) in builds.items():
        spill = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", report)
        regs = re.search(r"Used (\d+) registers", report)
        assert spill and regs, f"no resource report for {expression}:\n{report}"
        assert spill.groups() == ("0", "0", "0"), f"{expression} spills or uses a stack frame:\n{report}"
        assert int(regs.group(1)) <= 255
        # Every 8- or 16-byte state load has a store of the same width: NVRTC had split the C++ float4 /
        # float2 state stores into 4-byte ones (four times the L2 requests), which common.cuh's PTX
        # stores prevent.
        loads = len(re.findall(r"ld\.global(?:\.nc)?\.v[24]\.f32", ptx))
        stores = len(re.findall(r"st\.global\.v[24]\.f32", ptx))
        assert stores >= loads, f"{expression}: {loads} vector loads, {stores} vector stores"
        # The tensor-core kernel's kv build loads its state as 4-byte values (32 a lane): a lane's two
        # values adjacent in memory sit in registers 0 and 2 of an mma.sync accumulator quad, and from
        # 8-byte loads ptxas moved them over right after the loads, where every warp then waited for its
        # whole state (design.md, "Tensor-core kernel").
        if module == "delta_rule_mma" and _template_args(expression)[3] == "false":  # <K, SLAB, SEPARATE_P, VK, SUBS>
            scalar = len(re.findall(r"ld\.global\.f32", ptx))
            assert scalar == 32 and loads == 0, f"{expression}: {scalar} scalar, {loads} vector state loads"


@pytest.mark.parametrize("arch", ["sm_80", "sm_89"])
def test_every_module_also_builds_for_pre_hopper_gpus(arch):
    for module in _build.SPECIALISATIONS:
        assert set(_build.compile_for_arch(module, arch)) == set(_build.SPECIALISATIONS[module][1])


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("K", _build.SUPPORTED_K)
@pytest.mark.parametrize("multi", [False, True], ids=["decode", "multi"])
def test_the_chosen_tiling_can_run_every_supported_v(layout, K, multi):
    for V in range(32, 257, 32):
        for separate_p in (True, False):
            for T in (1, 2, 3, 4, 5, 8, 9, 64):
                for heads in (None, 1, 16, 1024):
                    variant = tiling.choose(layout, K, V, separate_p, multi, T, heads)
                    assert variant in tiling.variants(layout, K, V, multi), (V, separate_p, T, heads, variant)


def test_mma_stage_bytes_is_the_struct_size():
    """tiling.mma_stage_bytes (the tensor-core kernel's dynamic shared memory, passed at launch) equals
    NVRTC's sizeof(MmaStage) for every specialisation: a smaller launch would run past the CTA's shared
    memory."""
    from cupy_backends.cuda.libs import nvrtc

    checks = []
    for expression in _build.SPECIALISATIONS["delta_rule_mma"][1]:
        K, slab, sep, _, subs = _template_args(expression)
        n = tiling.mma_stage_bytes(int(K), int(slab), sep == "true", 8 * int(subs))
        checks.append(f'static_assert(sizeof(comba::MmaStage<{K}, {slab}, {sep}, {subs}>) == {n}, "{expression}");')
    assert len(checks) == 36  # 2 K x 2 slabs x 2 x 2 x 2 chunk lengths, and the wide slab's four
    source = _build.kernel_source("delta_rule_mma.cu") + "\n" + "\n".join(checks) + "\n"
    prog = nvrtc.createProgram(source, "stage_bytes.cu", (), ())
    try:
        try:
            nvrtc.compileProgram(prog, _build.NVRTC_OPTIONS + ("--gpu-architecture=compute_90",))
        except nvrtc.NVRTCError:
            pytest.fail(nvrtc.getProgramLog(prog))
    finally:
        nvrtc.destroyProgram(prog)
