"""The one compiled part: the quality signals' fused passes (filters/quality/_kernels.c,
_spectra.c for moire's and ghosting's passes around their FFTs, _blocks.c for a large image's
down-sampling, _pass.c for the one pass over the input itself).

Optional: where it cannot be built (no C compiler), the install goes on and the signals run on
their numpy code, which gives the same values (tests/unit/test_quality_kernels.py)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("filters.quality._kernels",
                             ["filters/quality/_kernels.c", "filters/quality/_spectra.c",
                              "filters/quality/_blocks.c", "filters/quality/_pass.c"],
                             depends=["filters/quality/_kernels.h"],
                             extra_compile_args=["-O3", "-std=c11", "-ffp-contract=off"],
                             libraries=["m"], optional=True)])
