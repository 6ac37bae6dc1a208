"""The model's projections on CPU, each weight packed once at load into the form its matmul reads fastest.

Three forms of a projection weight, chosen once per model by ``weight_form``:

- ``panels`` (the default on CPU): tiergate's own kernel (csrc/panel_linear.cpp,
  built on first use by engine/cpu_build.py) over the weight stored in panels of
  16 outputs. It streams the weight at memory speed for decode steps, where the
  libraries below do not, and keeps pace with them on prefill chunks.
- ``onednn``: oneDNN's linear over a weight reordered once into its blocked
  layout (``_reorder_linear_weight``); the fallback when the kernel cannot be
  built. Both ops are private to torch, so they are used only on the torch
  releases they were checked against (``PACKED_OPS_TORCH``).
- ``plain``: an ``[in, out]`` tensor multiplied with ``torch.mm``: CUDA, other
  dtypes, and ``TIERGATE_PACKED_WEIGHTS=0``.

The panels serve float32 and the bfloat16 opt-in (``--dtype bfloat16``); oneDNN's
packing here serves float32 only. A bfloat16 call with many rows (a prefill chunk) goes to
oneDNN's AMX micro-kernel over the same panels (csrc/panel_linear_amx.cpp) where the CPU runs
it: ``TIERGATE_BF16_AMX_ROWS`` sets the fewest rows that do (``off``: none); unset or ``auto``,
``AMX_MIN_ROWS``. float32 calls never do: they stay exact. MKL behind ``torch.mm`` re-packs its
  weight operand on every call.

``TIERGATE_PACKED_WEIGHTS`` picks a form (``panels``, ``onednn``, ``0`` for plain);
unset or ``auto``, the fastest one available. Packing replaces the plain weight,
so memory does not grow.
"""

from __future__ import annotations

import ctypes
import functools
import math

import torch
import torch.nn.functional as F

from engine.amx_rows import parse_min_rows
from engine.cpu_build import cpu_kernels_loaded
from engine.huge_pages import advise_huge_pages
from engine.norms import add_rms_norm_
from tiergate_common.env import BF16_AMX_ROWS, PACKED_WEIGHTS

# The torch releases whose private mkldnn linear ops this module calls with these
# signatures; tests/engine/test_packed_linear.py fails when the installed torch is not one.
PACKED_OPS_TORCH = ("2.13.",)
# The batch-size hint oneDNN picks the packed layout for: one layout serves every row
# count (decode rows to prefill chunks), and 32 kept small batches fast too.
PACK_HINT_ROWS = 32
# Outputs per panel of the panels form; csrc/panel_linear.cpp reads the same number.
PANEL = 16
FORMS = ("panels", "onednn", "plain")
# Rows of a bfloat16 call from which the AMX micro-kernel beat the panel kernel on the CPU it was
# measured on (bench/kernels/projections.py, bench/RESULTS.md).
AMX_MIN_ROWS = 32


def _onednn_present() -> bool:
    ops = torch.ops.mkldnn
    return (
        torch.__version__.startswith(PACKED_OPS_TORCH)
        and torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


def panel_kernel_present() -> bool:
    """Whether the panels kernel is built and loaded (built here on the first call)."""
    return cpu_kernels_loaded()


def amx_min_rows() -> int | None:
    """The fewest rows of a bfloat16 call that take the AMX micro-kernel now, None where none does:
    ``TIERGATE_BF16_AMX_ROWS`` if set, else ``AMX_MIN_ROWS`` where the CPU runs it. Raises ValueError
    for a value that is not a positive count, ``off`` or ``auto``, or a count where this CPU cannot run it."""
    return _amx_rows(BF16_AMX_ROWS.get())


@functools.cache
def _amx_rows(asked: str) -> int | None:
    """``amx_min_rows`` for a value of the variable, looked up once."""
    return parse_min_rows("TIERGATE_BF16_AMX_ROWS", asked, AMX_MIN_ROWS,
                          lambda: panel_kernel_present() and bool(torch.ops.tiergate.panel_amx_supported()))


def weight_form(device: torch.device | str, dtype: torch.dtype) -> str:
    """The form projections take on this device and dtype (see the module docstring)."""
    asked = PACKED_WEIGHTS.get()
    if asked in ("off", "plain") or torch.device(device).type != "cpu":
        return "plain"
    if dtype == torch.bfloat16:  # the bfloat16 opt-in: panels only (oneDNN's packing here is float32's)
        return "panels" if asked != "onednn" and panel_kernel_present() else "plain"
    if dtype != torch.float32:
        return "plain"
    if asked == "onednn":
        return "onednn" if _onednn_present() else "plain"
    if panel_kernel_present():
        return "panels"
    return "onednn" if _onednn_present() else "plain"


class PackedWeight:
    """A projection weight packed for a CPU kernel; ``x [rows, in] -> [rows, out]``."""

    in_features: int
    out_features: int
    form: str  # its name in FORMS

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dense(self) -> torch.Tensor:
        """The plain ``[in, out]`` weight back (a new tensor, exact)."""
        raise NotImplementedError

    def add_rms_norm_(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> torch.Tensor | None:
        """``residual += x @ self`` in place and its RMSNorm, where this form's kernel does both in one
        call (quantized weights); None: it does not, and ``linear_add_rms_norm_`` makes the two calls."""
        return None

    @property
    def nbytes(self) -> int:
        raise NotImplementedError


class PanelWeight(PackedWeight):
    """The weight as ``[panels, in, 16]``: panel p holds outputs 16p..16p+15 (zero-padded at the end)."""

    form = "panels"

    def __init__(self, weight_in_out: torch.Tensor, out: torch.Tensor | None = None) -> None:
        """``out``: where to store the panels (``panel_storage``'s views), else a buffer of their own."""
        if not panel_kernel_present():
            raise RuntimeError("the panel kernel could not be built here; pack for oneDNN or keep the plain weight")
        self.in_features, self.out_features = weight_in_out.shape
        panels = F.pad(weight_in_out, (0, -self.out_features % PANEL)).view(self.in_features, -1, PANEL).transpose(0, 1)
        self.panels = out if out is not None else panel_storage([weight_in_out.shape], weight_in_out.dtype)[0]
        self.panels.copy_(panels)

    @staticmethod
    def shape_of(in_features: int, out_features: int) -> tuple[int, int, int]:
        return (-(-out_features // PANEL), in_features, PANEL)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.stride(-1) != 1:
            x = x.contiguous()
        if x.dtype == torch.bfloat16:
            least = _amx_rows(BF16_AMX_ROWS.get())
            if least is not None and x.shape[0] >= least:
                return torch.ops.tiergate.panel_linear_amx(x, self.panels, self.out_features)
        return torch.ops.tiergate.panel_linear(x, self.panels, self.out_features)

    def dense(self) -> torch.Tensor:
        return self.panels.transpose(0, 1).reshape(self.in_features, -1)[:, : self.out_features].contiguous()

    @property
    def nbytes(self) -> int:
        return self.panels.nbytes


class OneDnnWeight(PackedWeight):
    """The weight in oneDNN's blocked layout."""

    form = "onednn"

    def __init__(self, weight_in_out: torch.Tensor) -> None:
        self.in_features, self.out_features = weight_in_out.shape
        # oneDNN wants the weight [out, in], as F.linear does.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight_in_out.t().contiguous(), PACK_HINT_ROWS)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")

    def dense(self) -> torch.Tensor:
        return self.packed.to_dense().t().contiguous()

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes


Weight = torch.Tensor | PackedWeight


def panel_storage(shapes: list[torch.Size | tuple[int, int]], dtype: torch.dtype) -> list[torch.Tensor]:
    """Empty panel tensors for weights of ``shapes`` (``[in, out]``), side by side in one buffer
    advised to huge pages: weights stored together (a layer's) cover whole 2 MB pages that each
    alone (an o projection of 1.3 MB) would not."""
    sizes = [PanelWeight.shape_of(*shape) for shape in shapes]
    counts = [math.prod(size) for size in sizes]
    buffer = torch.empty(sum(counts), dtype=dtype)
    advise_huge_pages(buffer)  # before the copies into it touch the pages
    return [view.view(size) for view, size in zip(buffer.split(counts), sizes)]


def pack(weight_in_out: torch.Tensor, form: str, out: torch.Tensor | None = None) -> Weight:
    """``weight_in_out`` in ``form`` (one of ``FORMS``); ``out``: a ``panel_storage`` view for the panels."""
    if form == "panels":
        return PanelWeight(weight_in_out, out)
    if form == "onednn":
        return OneDnnWeight(weight_in_out)
    return weight_in_out


def linear(x: torch.Tensor, weight: Weight) -> torch.Tensor:
    """``x @ weight`` for a plain ``[in, out]`` weight or a packed one."""
    if isinstance(weight, PackedWeight):
        return weight(x)
    return torch.mm(x, weight)


def linear_add_rms_norm_(x: torch.Tensor, weight: Weight, residual: torch.Tensor, norm: torch.Tensor,
                         eps: float) -> torch.Tensor:
    """``residual += x @ weight`` in place, then its RMSNorm on the fused CPU kernels: one call where the
    weight's kernel takes the add and the norm in, the projection and ``add_rms_norm_`` otherwise."""
    if isinstance(weight, PackedWeight):
        out = weight.add_rms_norm_(x, residual, norm, eps)
        if out is not None:
            return out
    return add_rms_norm_(residual, linear(x, weight), norm, eps, fused=True)


def release_freed_heap() -> None:
    """Hand the heap pages freed by packing back to the OS (glibc only; elsewhere a no-op).

    Packing frees the plain weights and the transposed copies it packs from, a few MB
    each; glibc keeps such freed chunks inside the heap rather than returning them, and the
    process stayed about that much larger than the unpacked engine.
    """
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def dense(weight: Weight) -> torch.Tensor:
    """The plain ``[in, out]`` weight behind either form."""
    return weight.dense() if isinstance(weight, PackedWeight) else weight
