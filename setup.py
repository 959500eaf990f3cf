"""The compiled parts: the quality signals' fused passes (filters/quality/_kernels.c,
_spectra.c for moire's and ghosting's passes around their FFTs, _blocks.c for a large image's
down-sampling, _pass.c for the one pass over the input itself), and JSON numbers written as
Triton writes them (proxy/wire/_floats.c).

Optional: where they cannot be built (no C compiler), the install goes on: the signals run on
their numpy code, which gives the same values (tests/unit/test_quality_kernels.py), and JSON
numbers are written by the same algorithm in Python, slower, to the same bytes
(proxy/wire/json_floats.py)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("filters.quality._kernels",
                             ["filters/quality/_kernels.c", "filters/quality/_spectra.c",
                              "filters/quality/_blocks.c", "filters/quality/_pass.c"],
                             depends=["filters/quality/_kernels.h"],
                             extra_compile_args=["-O3", "-std=c11", "-ffp-contract=off"],
                             libraries=["m"], optional=True),
                   Extension("proxy.wire._floats", ["proxy/wire/_floats.c"],
                             extra_compile_args=["-O2", "-std=gnu11"], libraries=["m"],
                             optional=True)])
