"""Paged decode attention kernels: each decode row attends to its context read from the block pool in place.

A kernel is called as ``kernel(q, kv_cache, block_tables, context_lens, scale,
window, softcap)`` with ``q`` ``[B, heads, head_dim]`` (rows may be strided), one
layer of the cache ``[blocks, block_size, 2, kv_heads, head_dim]``, int64 block
tables ``[B, max_blocks]``, int64 context lengths ``[B]``, a sliding window
(0: none) and a score soft-cap (0.0: none); it returns ``[B, heads * head_dim]``. Without a kernel, attention.py gathers each context
into a padded copy and runs SDPA over it, which is the fallback.

- CPU: a C++ operator (csrc/paged_attention.cpp) built on first use with
  ``torch.utils.cpp_extension.load`` (JIT, into ``TORCH_EXTENSIONS_DIR``, by
  default ``~/.cache/torch_extensions``) and cached there for later starts. Built
  at run time rather than by ``pip install`` because a build step in pip runs in
  an isolated environment that would download a CUDA torch to compile against,
  and because ``-march=native`` is only right on the machine that runs it.
  When it cannot be built (no compiler, no ninja, a build error), the failure is
  logged once and the engine keeps the gathered path.
- CUDA: the Triton kernel of engine/triton_paged_attention.py.

``TIERGATE_PAGED_ATTENTION=off`` keeps the gathered path on every device.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

DecodeKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, int, float], torch.Tensor]

SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
# -fopenmp makes at::parallel_for in the header run on torch's OpenMP threads;
# the symbols resolve to the libgomp that torch itself loaded.
CFLAGS = ["-O3", "-march=native", "-fopenmp"]


def decode_kernel_for(device: torch.device | str) -> DecodeKernel | None:
    """The in-place kernel for ``device``, or None where the gathered path must serve."""
    if os.environ.get("TIERGATE_PAGED_ATTENTION", "auto").lower() in ("off", "0", "false"):
        return None
    kind = torch.device(device).type
    if kind == "cpu":
        return cpu_decode_kernel()
    if kind == "cuda":
        return cuda_decode_kernel()
    return None


@functools.cache
def cpu_decode_kernel() -> DecodeKernel | None:
    """Build (or find already built) and load the C++ operator, once per process."""
    if not hasattr(torch.ops.tiergate, "paged_decode_attention"):
        try:
            _ensure_ninja_on_path()
            from torch.utils.cpp_extension import load

            log.info("loading the CPU paged attention kernel (built once, then cached)")
            load(name=_build_name(), sources=[str(SOURCE)], extra_cflags=CFLAGS, is_python_module=False, verbose=False)
        except Exception as error:  # any build failure leaves the gathered path, which is always correct
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            log.warning("CPU paged attention kernel unavailable, decode attention gathers contexts instead: %s",
                        first_line)
            return None
    return torch.ops.tiergate.paged_decode_attention


@functools.cache
def cuda_decode_kernel() -> DecodeKernel | None:
    try:
        from engine.triton_paged_attention import paged_decode_attention
    except Exception as error:  # triton missing or broken: the gathered path still works
        log.warning("Triton paged attention kernel unavailable, decode attention gathers contexts instead: %s", error)
        return None
    return paged_decode_attention


def _build_name() -> str:
    """The build's name carries the CPU's model and flags: torch reuses a cached build by source
    and flags only, and a -march=native build from another CPU sharing the cache could crash here.
    It carries the source too, so checkouts of different sources sharing the cache (worktrees,
    an upgrade beside a running server) each keep their build instead of rebuilding in turn."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    digest = hashlib.sha1("".join(lines).encode() + SOURCE.read_bytes()).hexdigest()[:10]
    return "tiergate_paged_attention_" + digest


def _ensure_ninja_on_path() -> None:
    """torch's JIT build runs ``ninja`` from PATH; the ``ninja`` wheel's binary sits in the
    venv's bin, which is not on PATH when the venv's tiergate runs unactivated."""
    if shutil.which("ninja"):
        return
    import ninja

    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])
