"""The machine a bench ran on, for the report: CPU model, cores, memory, load, versions."""

from __future__ import annotations

import os
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path


def _proc_field(path: str, key: str) -> str | None:
    try:
        for line in Path(path).read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == key:
                return value.strip()
    except OSError:
        pass
    return None


SIMD_FLAG_PREFIXES = ("sse", "ssse", "avx", "fma", "f16c", "amx")


def _simd_flags() -> list[str]:
    flags = (_proc_field("/proc/cpuinfo", "flags") or "").split()
    return sorted(f for f in flags if f.startswith(SIMD_FLAG_PREFIXES))


def _cpu_model() -> str:
    """The model name, with the family and model numbers: some guests name only the vendor's line
    ("AMD EPYC"), which says nothing of the generation (family 25 model 1 is a Zen 3, model 17 a Zen 4)."""
    name = _proc_field("/proc/cpuinfo", "model name") or platform.processor() or platform.machine()
    family, model = _proc_field("/proc/cpuinfo", "cpu family"), _proc_field("/proc/cpuinfo", "model")
    return f"{name} (family {family}, model {model})" if family and model else name


def describe() -> dict:
    mem_kb = _proc_field("/proc/meminfo", "MemTotal")
    versions = {"python": sys.version.split()[0]}
    for name in ("torch", "transformers", "llama_cpp"):
        try:
            versions[name] = __import__(name).__version__
        except Exception:  # a missing or broken peer only drops its version line
            versions[name] = None
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": _cpu_model(),
        # The SIMD the kernels can use decides most of the engine numbers (AVX-512, bf16, VNNI...).
        "cpu_flags": _simd_flags(),
        "cores": os.cpu_count(),
        "ram_gb": round(int(mem_kb.split()[0]) / 2**20, 1) if mem_kb else None,
        "load_average": os.getloadavg(),
        "versions": versions,
    }


def render_markdown(machine: dict) -> str:
    v = ", ".join(f"{k} {val}" for k, val in machine["versions"].items() if val)
    load = ", ".join(f"{x:.1f}" for x in machine["load_average"])
    flags = " ".join(machine.get("cpu_flags") or []) or "not read"
    return (f"{machine['date']}; {machine['cpu']}, {machine['cores']} cores, {machine['ram_gb']} GB RAM; "
            f"load average {load} at start; {v}; CPU SIMD flags: {flags}")
