"""Builds the engine's C++ CPU operators (engine/csrc/) on first use and loads them into ``torch.ops.tiergate``.

The sources are compiled together, in parallel by ninja, into one extension with
``torch.utils.cpp_extension.load`` (JIT, into ``TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``) and cached there for later starts. Built at run time rather than by ``pip install`` because
a build step in pip runs in an isolated environment that would download a CUDA
torch to compile against, and because ``-march=native`` is only right on the
machine that runs it. A source that cannot be built (no compiler, no ninja, a
build error) is logged once and reported as unavailable; its caller keeps a
slower path that is always correct.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
# -fopenmp makes at::parallel_for in the headers run on torch's OpenMP threads;
# the symbols resolve to the libgomp that torch itself loaded.
CFLAGS = ["-O3", "-march=native", "-fopenmp"]


@functools.cache
def cpu_kernels_loaded() -> bool:
    """Compile (or find compiled) every ``engine/csrc/*.cpp`` and load the operators, once per
    process; False when they cannot be built."""
    try:
        _ensure_ninja_on_path()
        from torch.utils.cpp_extension import load

        log.info("loading the CPU kernels (built once, then cached)")
        sources = sorted(str(path) for path in CSRC.glob("*.cpp"))
        load(name=_build_name(sources), sources=sources, extra_cflags=CFLAGS, is_python_module=False, verbose=False)
        return True
    except Exception as error:  # any build failure leaves the callers' fallbacks, which are always correct
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        log.warning("CPU kernels unavailable, the engine uses its slower fallbacks: %s", first_line)
        return False


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
    return "tiergate_cpu_kernels_" + digest.hexdigest()[:10]


def _ensure_ninja_on_path() -> None:
    """torch's JIT build runs ``ninja`` from PATH; the ``ninja`` wheel's binary sits in the
    venv's bin, which is not on PATH when the venv's tiergate runs unactivated."""
    if shutil.which("ninja"):
        return
    import ninja

    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])
