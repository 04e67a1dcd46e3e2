"""Compiled CPU kernels, built once per machine on first use.

The C++ sources ship in the package and are compiled with the machine's own compiler
(``torch.utils.cpp_extension``, ``-march=native``) into the user cache, keyed by the source,
the torch version and the CPU's instruction-set flags, so a cache shared between machines never
loads a binary built for another CPU. When no compiler is available, or the build fails, callers
fall back to the eager PyTorch code (the reference implementation) and say so once.

``cpu_ops(march="x86-64-v3")`` builds the same sources for another instruction set (there:
AVX2 and FMA, the kernels' AVX2 paths), so that those paths are tested and timed on a CPU
that would build its wider ones natively.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
from importlib import resources
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

_MAIN = "cpu_kernels.cpp"  # the one translation unit; it includes the headers beside it
# No -std: torch's cpp_extension names the standard its own headers and library were built
# for (C++17 up to torch 2.12, C++20 from 2.13); forcing C++20 on an older torch built a module
# whose failed TORCH_CHECKs with numbers in their messages crashed the process.
_CFLAGS = ("-O3", "-fopenmp", "-fno-math-errno")


def cflags(march: str = "native") -> list[str]:
    """The compiler flags of a build for ``-march=MARCH`` (beside torch's own)."""
    return [*_CFLAGS, f"-march={march}"]


def cxx_standard() -> str:
    """The ``-std`` that torch's cpp_extension adds for this torch (for a compiler run
    outside it, such as a syntax check)."""
    import torch

    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    return "-std=c++20" if (major, minor) >= (2, 13) else "-std=c++17"

_lock = threading.Lock()
_cache: dict[str, ModuleType | None] = {}
_errors: dict[str, str] = {}


def _cpuinfo(field: str) -> str | None:
    """The first value of ``field`` in /proc/cpuinfo, or None."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_flags() -> str:
    """This CPU's instruction-set flags (/proc/cpuinfo), space-separated."""
    flags = _cpuinfo("flags")
    return flags if flags is not None else platform.processor()


def cpu_vendor() -> str:
    """This CPU's vendor id (/proc/cpuinfo: AuthenticAMD, GenuineIntel, ...), or ''."""
    return _cpuinfo("vendor_id") or ""


def _build_key(sources: list[Path], march: str) -> str:
    """The build's cache key: every file of the source directory (the main file and the
    headers it includes), the torch version, the flags and this CPU's instruction sets."""
    import torch

    h = hashlib.sha256()
    for src in sources:
        # The path too: the build records it, and two checkouts sharing a build directory
        # would rebuild each other's binary on every first use.
        h.update(str(src.resolve()).encode())
        h.update(src.read_bytes())
    h.update(" ".join((torch.__version__, *cflags(march), cpu_flags())).encode())
    return h.hexdigest()[:16]


def cpu_ops(march: str = "native") -> ModuleType | None:
    """The compiled CPU kernels (built for ``-march=MARCH``), or None when they cannot be built
    here (see ``build_error``)."""
    with _lock:
        if march not in _cache:
            _cache[march] = _build_cpu(march)
        return _cache[march]


def build_error(march: str = "native") -> str | None:
    return _errors.get(march)


def _build_cpu(march: str) -> ModuleType | None:
    from fluidserve.model.builder import cache_root

    if os.environ.get("FLUIDSERVE_NO_KERNELS"):
        _errors[march] = "disabled by FLUIDSERVE_NO_KERNELS"
        return None
    try:
        srcdir = Path(str(resources.files("fluidserve.kernels").joinpath("csrc")))
        main = srcdir / _MAIN
        key = _build_key(sorted(p for p in srcdir.iterdir() if p.suffix in (".cpp", ".h")), march)
        build_dir = cache_root() / "kernels" / key
        build_dir.mkdir(parents=True, exist_ok=True)
        if not (build_dir / f"fluidserve_cpu_{key}.so").exists():
            log.info("compiling fluidserve CPU kernels (-march=%s) into %s (once per machine)",
                     march, build_dir)
        return _load(f"fluidserve_cpu_{key}", main, build_dir, march)
    except Exception as e:  # no compiler, missing headers, a failed build: use eager code
        lines = str(e).strip().splitlines() or [""]
        first = next((ln for ln in lines if "error:" in ln), lines[-1])  # the compiler's own
        _errors[march] = f"{type(e).__name__}: {first.strip()[:300]}"
        log.warning("compiled CPU kernels (-march=%s) unavailable (%s); using eager attention",
                    march, _errors[march])
        return None


def variant_ops(path: Path, index: int = 0, march: str = "native") -> ModuleType:
    """Build another version of the kernels into a fresh temporary directory, as module
    ``fluidserve_kernel_variant{index}``, so that benchmarks can time it beside the package's
    own build in one process: ``path`` is the main file of a copy of ``csrc/`` (its headers
    are found beside it), or one self-contained source file. Raises on a failed build."""
    import tempfile

    if not Path(path).is_file():
        raise FileNotFoundError(f"kernel variant {path}: no such file (the main file of an"
                                " edited copy of fluidserve/kernels/csrc, or one source)")
    build = Path(tempfile.mkdtemp(prefix="fluidserve-kernel-variant-"))
    return _load(f"fluidserve_kernel_variant{index}", path, build, march)


def _load(name: str, main: Path, build_dir: Path, march: str) -> ModuleType:
    """Compile ``main`` (one translation unit) for ``-march=MARCH`` into ``build_dir`` and
    import it as module ``name``."""
    from torch.utils.cpp_extension import load

    return load(name=name, sources=[str(main)], extra_cflags=cflags(march),
                extra_ldflags=["-fopenmp", "-lm"], build_directory=str(build_dir),
                verbose=False)


def variant_label(path: Path) -> str:
    """How benchmarks name a variant: its file name, or for the main file of a copied
    ``csrc/`` directory, the directory's name."""
    return path.parent.name if path.name == _MAIN else path.stem
