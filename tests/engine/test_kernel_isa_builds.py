"""The C++ kernels build for a CPU that has none of the instruction sets their fast paths use.

Each path past the build's baseline is a function compiled for its own target (``target(...)``), picked at
run time. A path that uses an instruction its target attribute does not name builds on a CPU that has it
(``-march=native`` brings it in) and fails on every other one, which then serves the slow fallbacks; the
machine a session gets decides which. Compiling each such source for x86-64-v2 (SSE4.2, no AVX) shows it
on any machine.
"""

from __future__ import annotations

import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from torch.utils.cpp_extension import include_paths

CSRC = Path(__file__).resolve().parents[2] / "engine" / "csrc"
DISPATCHED = sorted(p for p in CSRC.glob("*.cpp") if "target(" in p.read_text())


def compile_errors(source: Path, out_dir: Path, march: str) -> str:
    includes = [flag for path in [*include_paths(), sysconfig.get_paths()["include"]] for flag in ("-isystem", path)]
    # -O0: the target mismatch is an inlining error, reported at any level; the object is thrown away.
    command = ["c++", "-std=c++20", "-O0", "-fopenmp", "-fPIC", f"-march={march}", *includes, f"-I{CSRC}",
               "-DTORCH_EXTENSION_NAME=isa_check", "-DTORCH_API_INCLUDE_EXTENSION_H",
               "-c", str(source), "-o", str(out_dir / f"{source.stem}.o")]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    return "" if run.returncode == 0 else "\n".join(line for line in run.stderr.splitlines() if "error" in line)


def test_the_sources_with_dispatched_paths_are_found():
    names = {p.name for p in DISPATCHED}
    assert {"quant_gemv.cpp", "quant_gemv_avx2.cpp", "quant_gemv_avx512.cpp", "quant_linear.cpp"} <= names


@pytest.mark.timeout(600)
def test_every_dispatched_kernel_source_compiles_for_a_cpu_without_avx(tmp_path):
    with ThreadPoolExecutor(2) as pool:
        errors = dict(zip(DISPATCHED, pool.map(lambda p: compile_errors(p, tmp_path, "x86-64-v2"), DISPATCHED)))
    failed = {p.name: e for p, e in errors.items() if e}
    assert not failed, "\n".join(f"{name}:\n{error[:2000]}" for name, error in failed.items())
