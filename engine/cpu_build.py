"""Builds the engine's C++ CPU operators (engine/csrc/) on first use and loads them into ``torch.ops.tiergate``.

The sources are compiled together, in parallel by ninja, into one extension (the quantized
kernels, ``csrc/quant*.cpp``, into a second one of their own) with
``torch.utils.cpp_extension.load`` (JIT, into ``TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``) and cached there for later starts. Built at run time rather than by ``pip install`` because
a build step in pip runs in an isolated environment that would download a CUDA
torch to compile against, and because ``-march=native`` is only right on the
machine that runs it. A source that cannot be built (no compiler, no ninja, a
build error) is logged once and reported as unavailable; its caller keeps a
slower path that is always correct. A build killed halfway does not stop the next
start (``sole_builder``).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from tiergate_common.errors import first_line

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
# -fopenmp makes at::parallel_for in the headers run on torch's OpenMP threads;
# the symbols resolve to the libgomp that torch itself loaded.
CFLAGS = ["-O3", "-march=native", "-fopenmp"]


# The quantized kernels (csrc/quant*.cpp) build apart from the others: an edit to either
# set leaves the other's cached build in use.
QUANT_PREFIX = "quant"


@functools.cache
def cpu_kernels_loaded() -> bool:
    """Compile (or find compiled) every ``engine/csrc/*.cpp`` but the quantized kernels and load the
    operators, once per process; False when they cannot be built."""
    sources = sorted(str(p) for p in CSRC.glob("*.cpp") if not p.name.startswith(QUANT_PREFIX))
    return _load("tiergate_cpu_kernels_", sources)


QUANT_BUILD = "tiergate_quant_kernels_"


@functools.cache
def quant_kernels_loaded() -> bool:
    """As ``cpu_kernels_loaded``, for the quantized kernels (``engine/csrc/quant*.cpp``)."""
    return _load(QUANT_BUILD, quant_sources())


def quant_sources() -> list[str]:
    return sorted(str(p) for p in CSRC.glob(QUANT_PREFIX + "*.cpp"))


def build_folder(prefix: str, sources: list[str]) -> Path:
    """Where torch builds and caches ``sources`` under ``prefix``: torch's own rule (TORCH_EXTENSIONS_DIR,
    or its default root), so the flock of ``sole_builder`` sits beside the lock file it guards."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(prefix + _build_name(sources), verbose=False))


def _load(prefix: str, sources: list[str]) -> bool:
    try:
        _ensure_ninja_on_path()
        from torch.utils.cpp_extension import load

        log.info("loading the CPU kernels %s (built once, then cached)", prefix.rstrip("_"))
        folder = build_folder(prefix, sources)
        with sole_builder(folder):
            load(name=folder.name, sources=sources, extra_cflags=CFLAGS, is_python_module=False, verbose=False)
        return True
    except Exception as error:  # any build failure leaves the callers' fallbacks, which are always correct
        log.warning("CPU kernels unavailable, the engine uses its slower fallbacks: %s", first_line(error))
        return False


@contextlib.contextmanager
def sole_builder(folder: Path) -> Iterator[None]:
    """Hold an exclusive flock on the build in ``folder`` while torch builds or loads it, and first clear
    the ``lock`` file a builder killed mid-build left there.

    torch marks a build under way with a plain file that its builder deletes when done; one killed
    mid-build (Ctrl-C during ``make serve``'s first start, a SIGKILL) leaves it behind, and every later
    start would wait on it forever. An flock ends with its process: while this one holds it, no live
    tiergate process builds here, so a ``lock`` file is a dead builder's."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "tiergate.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            left = folder / "lock"
            if left.exists():
                log.warning("removing %s, left by a build that did not finish", left)
                left.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build_name(sources: list[str]) -> str:
    """The build's name carries the CPU's model and flags: torch reuses a cached build by source
    and flags only, and a -march=native build from another CPU sharing the cache could crash here.
    It carries the sources and their headers too, so checkouts of different sources sharing the cache (worktrees,
    an upgrade beside a running server) each keep their build instead of rebuilding in turn."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    digest = hashlib.sha1("".join(lines).encode())
    for source in [*sources, *sorted(str(path) for path in CSRC.glob("*.h"))]:
        digest.update(Path(source).read_bytes())
    return digest.hexdigest()[:10]


def _ensure_ninja_on_path() -> None:
    """torch's JIT build runs ``ninja`` from PATH; the ``ninja`` wheel's binary sits in the
    venv's bin, which is not on PATH when the venv's tiergate runs unactivated."""
    if shutil.which("ninja"):
        return
    import ninja

    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])
