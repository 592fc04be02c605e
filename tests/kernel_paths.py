"""The kernel each path test of test_recurrent_gpu.py expects the rules to choose, written out: the GPU tests assert
it before they run it, and test_tiling.py holds the rules to it on the CPU (either op), so that a change of the rules
that moves a path test off its kernel fails where every test runs, not only on a GPU."""


def _both_layouts(table):
    return {(layout,) + key: f"{layout}{variant}" for layout in ("kv", "vk") for key, variant in table.items()}


#: test_tensor_core_path: B = 3, H = 4, over (layout, K, V, T) -- the tensor-core kernel, but for the prefill
#: kernels' lengths at K = 64 (from T = 17 over up to 16 heads, tiling.PREFILL_MIN_T)
FEW_HEADS = 12
FEW_HEADS_CHOICE = _both_layouts({(128, 128, 8): "32tc", (128, 128, 11): "32tc16", (128, 128, 21): "32tc",
                                  (64, 96, 8): "32tc", (64, 96, 11): "32tc16", (64, 96, 21): "16c64"})

#: test_tensor_core_path_many_heads: B = 33, H = 4, V = 128, over (layout, K, T) -- the tensor-core kernel, 16
#: tokens a pass from T = 9 (at K = 64 in 128-column slabs), but the vk layout's chunked kernel at K = 128 to T = 7
MANY_HEADS = 132
MANY_HEADS_CHOICE = _both_layouts({(128, 5): "64tc", (128, 8): "64tc", (128, 9): "64tc16", (128, 13): "64tc16",
                                   (128, 16): "64tc16", (64, 5): "64tc", (64, 8): "64tc", (64, 9): "128tc16",
                                   (64, 13): "128tc16", (64, 16): "128tc16"}) | {("vk", 128, 5): "vk64c4"}

#: test_chunked_kernel_path: B = 35, H = 4, V = 128, over (layout, K, T) -- the chunked kernels
CHUNKED_HEADS = 140
CHUNKED_CHOICE = {("kv", 128, 2): "kv64x8c4", ("kv", 128, 3): "kv64x8c4", ("kv", 128, 4): "kv64x8c4",
                  ("kv", 64, 2): "kv64x8c4", ("kv", 64, 4): "kv64x8c4", ("vk", 128, 2): "vk64c4",
                  ("vk", 128, 3): "vk64c4", ("vk", 128, 4): "vk64c4", ("vk", 128, 7): "vk64c4"}
