"""The compiled CPU kernels build wherever a compiler is present.

The eager fallback is for machines with no compiler: where there is one, a failed build is a
bug (a torch release whose headers need a newer C++ standard, say), not a reason for the kernel
tests to skip themselves.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
from torch.utils.cpp_extension import include_paths

import fluidserve.kernels as kernels
from fluidserve.kernels import build_error, cflags, cpu_ops, cxx_standard


def test_kernels_build_wherever_a_compiler_is_present():
    if os.environ.get("FLUIDSERVE_NO_KERNELS") or not shutil.which(os.environ.get("CXX", "c++")):
        pytest.skip("no compiler, or kernels disabled on purpose")
    assert cpu_ops() is not None, build_error()


def test_the_build_takes_torchs_own_language_standard():
    """torch's cpp_extension adds the ``-std`` its headers and library were built for; one of
    ours after it overrode that: C++20 against a C++17 torch (2.11) built a module whose failed
    checks crashed the process instead of raising."""
    assert not any(f.startswith("-std=") for f in cflags())
    assert cxx_standard() in ("-std=c++17", "-std=c++20")


def test_every_instruction_set_branch_of_the_source_compiles():
    """The AMX branch (amx.h) and the no-AVX2 branch (stubs) compile only for CPUs this
    machine may not be, so the suite checks their syntax with the compiler's -march: an edit
    of a shared header that breaks them fails here, not on the first AMX or SSE-only user."""
    cxx = os.environ.get("CXX", "c++")
    if os.environ.get("FLUIDSERVE_NO_KERNELS") or not shutil.which(cxx):
        pytest.skip("no compiler, or kernels disabled on purpose")
    marches = ("sapphirerapids", "x86-64")
    for march in marches:  # a compiler too old to know the CPU cannot check its branch
        known = subprocess.run([cxx, f"-march={march}", "-E", "-x", "c++", "/dev/null"],
                               capture_output=True)
        if known.returncode != 0:
            pytest.skip(f"{cxx} does not know -march={march}")
    main = Path(kernels.__file__).parent / "csrc" / "cpu_kernels.cpp"
    incs = [f"-I{p}" for p in (*include_paths(), sysconfig.get_paths()["include"])]
    procs = {march: subprocess.Popen(
        [cxx, *[f for f in cflags(march) if f != "-O3"], cxx_standard(), "-O0",
         "-fsyntax-only", *incs,
         "-DTORCH_EXTENSION_NAME=syntax_check", str(main)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for march in marches}
    for march, p in procs.items():
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0, f"-march={march}:\n{out[-3000:]}"


def test_a_benchmark_variant_that_is_not_there_is_named_before_any_build(tmp_path):
    missing = tmp_path / "csrc" / "cpu_kernels.cpp"
    with pytest.raises(FileNotFoundError, match=r"kernel variant .*cpu_kernels.cpp: no such"):
        kernels.variant_ops(missing)
