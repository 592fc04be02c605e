"""CUDA C++ sources of the cupy_comba kernels (data files, compiled by NVRTC at run time)."""
