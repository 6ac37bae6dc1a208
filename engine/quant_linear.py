"""Projections whose weights stay in a GGUF block format (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K).

A ``QuantWeight`` keeps a weight's rows exactly as the GGUF stores them (ggml's row is one
output feature, its blocks run along the inputs) and multiplies activations by them with
tiergate's kernels (csrc/quant_linear.cpp, built on first use by engine/cpu_build.py): each
activation row is quantized once per call to int8 in blocks of 32 with a float scale, and the
dot products run on integers, as llama.cpp does, so a decode step reads the file's bytes, not a
float32 copy 4-7x their size. ``stack_outputs`` puts several weights side by side behind one
call (a fused q|k|v or gate|up whose parts may differ in type).

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K weights are repacked at load (``REPACKED_TYPES``) into an
interleaved layout of 16 output rows (csrc/quant_packed.h; docs/quantization.md says why) that the packed
kernels (csrc/quant_gemv*.cpp) read at every row count with one integer dot product per 16 rows and 4
inputs. Only bytes move (and Q5's high bits within their word): ``blocks`` unpacks the file's bytes back
exactly, and the packed copy is the only one kept. ``TIERGATE_QUANT_REPACK=0`` keeps every weight in the
file's layout.

Where the kernels cannot be built, the weight is dequantized in slices and multiplied by
``torch.mm``: slower, exact in the weight, and with no activation rounding.

``TIERGATE_QUANT_ISA`` forces a kernel path (``avx512``, ``avxvnni``: AVX2 with AVX-VNNI,
``avx2`` or ``scalar``); unset or ``auto``, the best this CPU runs.

On one row of x (a single stream's decode step) the kernels of the 32-input formats (Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0) ask for their tiles ahead of the walk only where that pays: on an Intel core (a Xeon's read
well short of its memory's speed without) and not on an AMD one (a Zen 4's read well short with them);
bench/RESULTS.md has both. ``TIERGATE_QUANT_ROW_PREFETCH`` (``on``, ``off``) overrides ``auto``.

A call with many rows of x (a prefill chunk, a batch of many streams) takes the panel path
instead where the CPU runs oneDNN's bfloat16 micro-kernel (AMX): csrc/quant_dequant_panel.cpp
decodes the weight a panel of outputs at a time to bfloat16 and multiplies on the tiles, with
float32 sums. ``TIERGATE_QUANT_PANEL_ROWS`` sets the fewest rows that take it (``off``: never);
unset or ``auto``, ``PANEL_MIN_ROWS`` where the CPU runs it, never elsewhere.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import gguf
import numpy as np
import torch

from engine.amx_rows import parse_min_rows
from engine.cpu_build import quant_kernels_loaded
from engine.huge_pages import advise_huge_pages
from engine.packed_linear import PackedWeight
from engine.quantize import quantize_rows
from tiergate_common.env import QUANT_ISA, QUANT_PANEL_ROWS, QUANT_REPACK, QUANT_ROW_PREFETCH, EnvError

T = gguf.GGMLQuantizationType
SERVED_TYPES: frozenset[gguf.GGMLQuantizationType] = frozenset({T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K,
                                                             T.Q5_K, T.Q6_K})
# --quantize's names for the formats it writes.
QUANTIZE_KINDS: dict[str, gguf.GGMLQuantizationType] = {"q8_0": T.Q8_0, "q4_0": T.Q4_0, "q4_k": T.Q4_K}
# Kernel paths as csrc/quant_kernels.h numbers them, and the order auto prefers them in.
ISAS = ("avx512", "avx2", "scalar", "avxvnni")
AUTO_ORDER = ("avx512", "avxvnni", "avx2", "scalar")
# Output rows per group of csrc/quant_packed.h's layout (its PACK_ROWS).
PACK_ROWS = 16
# Formats repacked at load into csrc/quant_packed.h's layout for the few-row kernels.
REPACKED_TYPES: frozenset[gguf.GGMLQuantizationType] = frozenset({T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K,
                                                               T.Q5_K, T.Q6_K})
# Rows of x from which the panel path beat the int8 tiles on the AMX CPU it was measured on
# (bench/kernels/quant_kernels.py, bench/RESULTS.md).
PANEL_MIN_ROWS = 64
# Output rows the fallback dequantizes at a time: bounds its float copy to a few MB.
FALLBACK_SLICE_ROWS = 256


def quant_kernels_present() -> bool:
    """Whether the quantized kernels are built and loaded (built here on the first call)."""
    return quant_kernels_loaded()


def kernel_isa() -> str:
    """The kernel path calls take now: ``TIERGATE_QUANT_ISA`` if set, else the best this CPU runs.
    Raises ValueError for a name not in ``ISAS`` or a path this CPU cannot run."""
    return ISAS[_isa_index(QUANT_ISA.get())]


@functools.cache
def _isa_index(asked: str) -> int:
    """``kernel_isa``'s index for a value of the variable, looked up once: a call reads the variable only."""
    if not quant_kernels_present():
        raise RuntimeError("the quantized kernels could not be built here")
    asked = asked.strip().lower()
    if asked in ("", "auto"):
        return next(ISAS.index(n) for n in AUTO_ORDER if torch.ops.tiergate.quant_isa_supported(ISAS.index(n)))
    if asked not in ISAS:
        raise ValueError(f"TIERGATE_QUANT_ISA={asked!r}: expected one of {', '.join(ISAS)} or auto")
    if not torch.ops.tiergate.quant_isa_supported(ISAS.index(asked)):
        raise ValueError(f"TIERGATE_QUANT_ISA={asked}: this CPU cannot run that path")
    return ISAS.index(asked)


@dataclass(frozen=True)
class KernelSwitches:
    """``TIERGATE_QUANT_ISA``, ``TIERGATE_QUANT_PANEL_ROWS`` and ``TIERGATE_QUANT_ROW_PREFETCH`` as a call uses them."""

    isa: int  # an index into ISAS
    panel_rows: int | None  # panel_min_rows()
    row_prefetch: bool  # row_prefetch()


def kernel_switches() -> KernelSwitches:
    """The switches as the environment sets them now."""
    return KernelSwitches(_isa_index(QUANT_ISA.get()), panel_min_rows(), row_prefetch())


def row_prefetch() -> bool:
    """Whether one row of x asks for the 32-input formats' tiles ahead: ``TIERGATE_QUANT_ROW_PREFETCH``
    (``on``, ``off``), or with ``auto`` on Intel cores only (the module's docstring says why)."""
    asked = QUANT_ROW_PREFETCH.get().strip().lower()
    if asked == "auto":
        return cpu_vendor() == "GenuineIntel"
    if asked in ("on", "off"):
        return asked == "on"
    raise EnvError(f"{QUANT_ROW_PREFETCH.env_name} must be auto, on or off, not {asked!r}")


@functools.cache
def cpu_vendor(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's vendor string (GenuineIntel, AuthenticAMD, ...); empty where the kernel does not say."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def panel_min_rows() -> int | None:
    """The fewest rows of x that take the panel path now, None where no call does: ``TIERGATE_QUANT_PANEL_ROWS``
    if set, else ``PANEL_MIN_ROWS`` where the CPU runs the panels. Raises ValueError for a value that is not
    a positive count, ``off`` or ``auto``, or a count where this CPU cannot run the panels."""
    return _panel_rows(QUANT_PANEL_ROWS.get())


@functools.cache
def _panel_rows(asked: str) -> int | None:
    """``panel_min_rows`` for a value of the variable, looked up once."""
    return parse_min_rows("TIERGATE_QUANT_PANEL_ROWS", asked, PANEL_MIN_ROWS,
                          lambda: quant_kernels_present() and bool(torch.ops.tiergate.quant_panel_supported()))


def _check_blocks(blocks: torch.Tensor, ggml_type: gguf.GGMLQuantizationType, in_features: int,
                  out_features: int) -> None:
    if ggml_type not in SERVED_TYPES:
        raise ValueError(f"no quantized kernel for {ggml_type.name}; served: {sorted(t.name for t in SERVED_TYPES)}")
    block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    if in_features % block_size:
        raise ValueError(f"{ggml_type.name} needs the input size to be a multiple of {block_size}, got {in_features}")
    expected = (out_features, in_features // block_size * type_size)
    if blocks.dtype != torch.uint8 or tuple(blocks.shape) != expected:
        raise ValueError(f"{ggml_type.name} blocks for [{in_features} in, {out_features} out] must be uint8 "
                         f"{list(expected)}, got {blocks.dtype} {list(blocks.shape)}")


def _dequantize(blocks: torch.Tensor, ggml_type: gguf.GGMLQuantizationType) -> torch.Tensor:
    """Rows of ``blocks`` as float32 ``[rows, in]``, exactly as gguf-py's reference dequantizers give them
    (the kernels' op where built: it runs in parallel, without numpy's temporaries)."""
    if quant_kernels_present():
        in_features = blocks.shape[1] // gguf.GGML_QUANT_SIZES[ggml_type][1] * gguf.GGML_QUANT_SIZES[ggml_type][0]
        return torch.ops.tiergate.quant_dequantize(blocks.contiguous(), int(ggml_type), in_features)
    return torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), ggml_type).astype(np.float32, copy=False))


def repack_enabled(ggml_type: gguf.GGMLQuantizationType) -> bool:
    """Whether a weight of this format is repacked at load (see the module docstring)."""
    return ggml_type in REPACKED_TYPES and QUANT_REPACK.get() != "off" and quant_kernels_present()


class QuantWeight(PackedWeight):
    """One projection weight in a GGUF block format: ``blocks`` uint8 ``[out, bytes_per_row]`` as the
    file stores them; ``storage`` what the kernels read (those blocks, or their packed layout)."""

    form = "quant"

    def __init__(self, blocks: torch.Tensor, ggml_type: gguf.GGMLQuantizationType, in_features: int,
                 out_features: int) -> None:
        ggml_type = gguf.GGMLQuantizationType(ggml_type)
        _check_blocks(blocks, ggml_type, in_features, out_features)
        self.ggml_type, self.in_features, self.out_features = ggml_type, in_features, out_features
        self.packed = repack_enabled(ggml_type)
        if self.packed:  # the source (a view of the mapped file, or a copy) is not kept
            block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
            out = torch.empty(-(-out_features // PACK_ROWS), in_features // block_size, PACK_ROWS * type_size,
                              dtype=torch.uint8)
            advise_huge_pages(out)  # a decode step streams it whole: a TLB miss per 4 KB page otherwise
            self.storage = torch.ops.tiergate.quant_repack(blocks.contiguous(), int(ggml_type), out)
        else:  # read in place (an mmap's view stays one); rows must be contiguous for the kernels
            self.storage = blocks if blocks.is_contiguous() else blocks.contiguous()
        self._op_args = ([self.storage], [int(ggml_type)], [out_features])
        # Set once by the engine (DecoderModel.prepare_weights): reading two variables per call costs a
        # small model's decode step a few percent. None: read at each call, as tests that flip them expect.
        self.switches: KernelSwitches | None = None

    @property
    def blocks(self) -> torch.Tensor:
        """The file's bytes, ``[out, bytes_per_row]`` (unpacked anew from a packed weight)."""
        if not self.packed:
            return self.storage
        return self._unpack(torch.arange(self.out_features))

    def _unpack(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.ops.tiergate.quant_unpack_rows(self.storage, int(self.ggml_type), self.in_features, ids)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return quant_matmul(x, [self], self._op_args, self.switches)

    @property
    def kernel_args(self) -> tuple[list[torch.Tensor], list[int], list[int]]:
        """The kernels' arguments for this weight: its blocks, types and output counts, one of each."""
        return self._op_args

    def add_rms_norm_(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> torch.Tensor | None:
        return quant_matmul_add_rms_norm_(x, self._op_args, self.switches, residual, weight, eps)

    def dense(self) -> torch.Tensor:
        return _dequantize(self.blocks, self.ggml_type).t().contiguous()

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Float32 ``[len(ids), in]``: the rows (output features) ``ids``, e.g. a quantized token embedding's."""
        flat = ids.reshape(-1).to(torch.long)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.out_features):
            raise IndexError(f"row ids must be in [0, {self.out_features})")
        blocks = self._unpack(flat) if self.packed else self.storage.index_select(0, flat)
        return _dequantize(blocks, self.ggml_type).view(*ids.shape, self.in_features)

    @property
    def nbytes(self) -> int:
        return self.storage.nbytes


class StackedQuantWeight(PackedWeight):
    """Several ``QuantWeight``s sharing their input, their outputs side by side: one call quantizes
    the activations once for all of them."""

    form = "quant"

    def __init__(self, parts: list[QuantWeight]) -> None:
        if not parts:
            raise ValueError("stack_outputs needs at least one weight")
        if len({p.in_features for p in parts}) != 1:
            raise ValueError(f"stacked weights must share their input size, got {[p.in_features for p in parts]}")
        self.parts = list(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self._op_args = ([p.storage for p in parts], [int(p.ggml_type) for p in parts], [p.out_features for p in parts])
        self.switches: KernelSwitches | None = None  # as QuantWeight's

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return quant_matmul(x, self.parts, self._op_args, self.switches)

    @property
    def kernel_args(self) -> tuple[list[torch.Tensor], list[int], list[int]]:
        """The kernels' arguments for the parts side by side: their blocks, types and output counts."""
        return self._op_args

    def add_rms_norm_(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> torch.Tensor | None:
        return quant_matmul_add_rms_norm_(x, self._op_args, self.switches, residual, weight, eps)

    def dense(self) -> torch.Tensor:
        return torch.cat([p.dense() for p in self.parts], dim=1)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


def stack_outputs(parts: list[QuantWeight]) -> PackedWeight:
    """One weight whose outputs are ``parts``' outputs side by side (a fused q|k|v or gate|up)."""
    flat = [q for p in parts for q in (p.parts if isinstance(p, StackedQuantWeight) else [p])]
    return flat[0] if len(flat) == 1 else StackedQuantWeight(flat)


def quant_matmul(x: torch.Tensor, parts: list[QuantWeight], op_args: tuple | None = None,
                 switches: KernelSwitches | None = None) -> torch.Tensor:
    """``x [rows, in]`` (float32 or bfloat16) times ``parts`` side by side: float32 ``[rows, sum(out)]``.
    ``op_args``: the parts' (blocks, types, out_features) lists, kept by a weight so a decode step
    does not rebuild them per call; ``switches``: the kernel switches (None: as the environment sets them now)."""
    if x.dim() != 2 or x.shape[1] != parts[0].in_features:
        raise ValueError(f"x must be [rows, {parts[0].in_features}], got {list(x.shape)}")
    if x.dtype != torch.float32:
        x = x.float()
    if x.stride(-1) != 1:
        x = x.contiguous()
    if not quant_kernels_present():
        return _fallback_matmul(x, parts)
    if op_args is None:
        op_args = ([p.storage for p in parts], [int(p.ggml_type) for p in parts], [p.out_features for p in parts])
    if switches is None:
        switches = kernel_switches()
    if switches.panel_rows is not None and x.shape[0] >= switches.panel_rows:
        return torch.ops.tiergate.quant_panel_linear(x, *op_args)
    return torch.ops.tiergate.quant_linear(x, *op_args, switches.isa, switches.row_prefetch)


def quant_matmul_add_rms_norm_(x: torch.Tensor, op_args: tuple, switches: KernelSwitches | None,
                               residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """``residual += x @ weights`` in place, then its RMSNorm, in one call of the kernels (``quant_matmul``'s
    product, the same bits); None where that call does not serve and the caller adds and norms apart: switches
    not yet set, an x the kernels would convert first, no kernels, or a row count the panel path takes."""
    if switches is None or x.dtype != torch.float32 or x.dim() != 2 or x.stride(-1) != 1 or not quant_kernels_present():
        return None
    if switches.panel_rows is not None and x.shape[0] >= switches.panel_rows:
        return None
    return torch.ops.tiergate.quant_linear_add_rms_norm_(x, *op_args, switches.isa, switches.row_prefetch,
                                                         residual, weight, eps)


def _fallback_matmul(x: torch.Tensor, parts: list[QuantWeight]) -> torch.Tensor:
    """The kernels' result without them: each slice of output rows dequantized, then ``torch.mm``."""
    out = torch.empty(x.shape[0], sum(p.out_features for p in parts), dtype=torch.float32)
    first = 0
    for part in parts:
        blocks = part.blocks
        for lo in range(0, part.out_features, FALLBACK_SLICE_ROWS):
            rows = _dequantize(blocks[lo:lo + FALLBACK_SLICE_ROWS], part.ggml_type)
            out[:, first + lo:first + lo + rows.shape[0]] = torch.mm(x, rows.t())
        first += part.out_features
    return out


def quantize_weight(weight_in_out: torch.Tensor, kind: str) -> QuantWeight:
    """A float ``[in, out]`` weight quantized into ``kind`` (``q8_0``, ``q4_0``, ``q4_k``) as llama.cpp's
    reference quantizers do (engine/quantize.py), for an HF checkpoint served with ``--quantize``."""
    if kind not in QUANTIZE_KINDS:
        raise ValueError(f"unknown quantization {kind!r}: expected one of {', '.join(QUANTIZE_KINDS)}")
    ggml_type = QUANTIZE_KINDS[kind]
    in_features, out_features = weight_in_out.shape
    block_size = gguf.GGML_QUANT_SIZES[ggml_type][0]
    if in_features % block_size:
        raise ValueError(f"{kind} needs the input size to be a multiple of {block_size}, got {in_features}")
    rows = weight_in_out.detach().t().to(torch.float32).contiguous().numpy()
    blocks = torch.from_numpy(quantize_rows(rows, ggml_type))
    return QuantWeight(blocks, ggml_type, in_features, out_features)
