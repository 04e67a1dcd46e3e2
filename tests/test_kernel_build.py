"""The compiled CPU kernels build wherever a compiler is present.

The eager fallback is for machines with no compiler: where there is one, a failed build is a
bug (a torch release whose headers need a newer C++ standard, say), not a reason for the kernel
tests to skip themselves.
"""

from __future__ import annotations

import os
import shutil

import pytest

from fluidserve.kernels import build_error, cpu_ops


def test_kernels_build_wherever_a_compiler_is_present():
    if os.environ.get("FLUIDSERVE_NO_KERNELS") or not shutil.which(os.environ.get("CXX", "c++")):
        pytest.skip("no compiler, or kernels disabled on purpose")
    assert cpu_ops() is not None, build_error()
