"""The adapter pool: registry, host cache, device slots, and the per-step LoRA batch.

`max_loras` device slots hold stacked weights per projection and a scale per slot
(`SlotStacks`, lora_pool/batch.py), which this pool fills and each step's batch reads.
`batch_for` makes a step's adapters resident, pinning them against eviction by each
other, and evicts the least recently used unpinned slot when it needs room.

Counters for the gateway's metrics: `loads` (adapters read from disk), `cache_hits`
(a step's adapter found in a slot or the host cache, no disk read), `slot_loads`
(host -> device copies) and `evictions`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path

import torch

from lora_pool.adapter import AdapterError, AdapterSpec, AdapterWeights, BaseShapes, inspect_adapter, load_adapter
from lora_pool import ops
from lora_pool.batch import LoraBatch, SlotStacks
from lora_pool.host_cache import HostCache


class TooManyAdaptersError(RuntimeError):
    """A step asked for more distinct adapters than there are device slots."""


class LoraPool:
    def __init__(self, shapes: BaseShapes, max_loras: int, max_cpu_loras: int, max_lora_rank: int,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 stack_dtype: torch.dtype | None = None):
        """``dtype``: the activations'. ``stack_dtype``: the adapters' weights, in the slots and the host
        cache (default ``dtype``). bfloat16 stacks under float32 activations run on the CPU kernel
        (``ops.rows_kernel``), which reads half the bytes of float32 ones; without it they are refused."""
        if max_loras < 1 or max_lora_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {max_loras}, {max_lora_rank}")
        if max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras ({max_loras})")
        self.shapes = shapes
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.device = torch.device(device)
        self.dtype = dtype
        self.stack_dtype = dtype if stack_dtype is None else stack_dtype
        self.cpu_kernel = self.device.type == "cpu" and dtype == torch.float32 and ops.rows_kernel() is not None
        # Read once, here: a bad TIERGATE_LORA_PREFETCH stops the start, not a step.
        self.cpu_prefetch_to = ops.prefetch_level() if self.cpu_kernel else 1
        if self.stack_dtype != dtype and not (self.cpu_kernel and self.stack_dtype == torch.bfloat16):
            raise ValueError(f"adapter weights in {self.stack_dtype} under {dtype} activations need the CPU LoRA "
                             "kernel (bfloat16 weights, float32 activations), which is not loaded here")
        self.stacks = SlotStacks.allocate(shapes.projections, shapes.num_layers, max_loras, max_lora_rank,
                                          self.device, self.stack_dtype)
        self._specs: dict[str, AdapterSpec] = {}
        self._host = HostCache(max_cpu_loras)
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # resident adapters, least recent first
        self._slot_spec: list[AdapterSpec | None] = [None] * max_loras
        self._pinned: frozenset[str] = frozenset()
        self._lock = threading.RLock()
        self.cache_hits = 0
        self.slot_loads = 0
        self.evictions = 0

    @property
    def loads(self) -> int:
        return self._host.loads

    # --- registry -------------------------------------------------------------------------

    def register(self, name: str, path: str | Path) -> AdapterSpec:
        """Validate the directory (config and weight shapes, no weight data) and register it.

        Registering a name again replaces the adapter: its cached copies are dropped.
        """
        if not name or not isinstance(name, str):
            raise AdapterError(f"adapter name {name!r} must be a non-empty string")
        spec = inspect_adapter(name, path, self.shapes, self.max_lora_rank)
        with self._lock:
            self._forget(name)
            self._specs[name] = spec
        return spec

    def unregister(self, name: str) -> None:
        """Forget an adapter. A step already running keeps its weights until it ends."""
        with self._lock:
            if name not in self._specs:
                raise AdapterError(f"adapter {name!r} is not registered")
            self._forget(name)
            del self._specs[name]

    def list(self) -> list[str]:
        with self._lock:
            return sorted(self._specs)

    def spec(self, name: str) -> AdapterSpec:
        with self._lock:
            if name not in self._specs:
                raise AdapterError(f"adapter {name!r} is not registered")
            return self._specs[name]

    def _forget(self, name: str) -> None:
        self._host.discard(name)
        slot = self._slot_of.pop(name, None)
        if slot is not None:
            self._slot_spec[slot] = None

    # --- loading --------------------------------------------------------------------------

    def _read(self, spec: AdapterSpec) -> AdapterWeights:
        weights = load_adapter(spec, self.shapes, self.stack_dtype)
        if self.device.type == "cuda":  # page-locked, so the slot copy can run asynchronously
            weights.a = {p: t.pin_memory() for p, t in weights.a.items()}
            weights.b = {p: t.pin_memory() for p, t in weights.b.items()}
        return weights

    def _host_weights(self, name: str) -> AdapterWeights:
        spec = self.spec(name)
        weights = self._host.get(name, lambda: self._read(spec))
        if weights.spec is not spec:  # replaced by a new registration while it was loading
            self._host.discard(name)
            weights = self._host.get(name, lambda: self._read(spec))
        return weights

    def prefetch(self, name: str) -> None:
        """Bring an adapter into the host cache (blocking; call it off the step loop)."""
        with self._lock:
            if name in self._slot_of:
                return
        self._host_weights(name)

    # --- slots ----------------------------------------------------------------------------

    def resident(self) -> dict[str, int]:
        """Adapter name -> slot, least recently used first."""
        with self._lock:
            return dict(self._slot_of)

    def batch_for(self, chunks: list[tuple[str | None, int]]) -> LoraBatch | None:
        """Make the step's adapters resident and return the step's LoRA batch.

        `chunks` lists, in row order, each chunk's adapter (or None) and its number of rows.
        Returns None when no row uses an adapter, so the base path pays nothing.
        """
        names = list(dict.fromkeys(name for name, _ in chunks if name is not None))
        with self._lock:
            self._pinned = frozenset(names)
            if not names:
                return None
            if len(names) > self.max_loras:
                raise TooManyAdaptersError(
                    f"step uses {len(names)} distinct adapters but there are {self.max_loras} slots")
            for name in names:
                self.spec(name)  # raises for an unknown adapter before any slot changes
            slot_of = {name: self._make_resident(name) for name in names}
            chunk_slots = [(slot_of[name] if name is not None else -1, rows) for name, rows in chunks]
            specs = {slot_of[name]: self._slot_spec[slot_of[name]] for name in names}
            return LoraBatch(self.stacks, chunk_slots, specs, self.cpu_kernel, self.cpu_prefetch_to)

    def _make_resident(self, name: str) -> int:
        if name in self._slot_of:
            self._slot_of.move_to_end(name)
            self.cache_hits += 1
            return self._slot_of[name]
        if name in self._host:
            self.cache_hits += 1
        weights = self._host_weights(name)
        slot = self._free_slot()
        self._copy_into(slot, weights)
        self._slot_of[name] = slot
        self._slot_spec[slot] = weights.spec
        self.slot_loads += 1
        return slot

    def _free_slot(self) -> int:
        taken = set(self._slot_of.values())
        for slot in range(self.max_loras):
            if slot not in taken:
                return slot
        victim = next(name for name in self._slot_of if name not in self._pinned)
        self.evictions += 1
        slot = self._slot_of.pop(victim)
        self._slot_spec[slot] = None
        return slot

    def _copy_into(self, slot: int, weights: AdapterWeights) -> None:
        rank = weights.spec.rank
        a, b = self.stacks.a, self.stacks.b
        for proj in a:
            if proj in weights.a:
                a[proj][:, slot, :rank].copy_(weights.a[proj], non_blocking=True)
                a[proj][:, slot, rank:].zero_()
                b[proj][:, slot, :, :rank].copy_(weights.b[proj], non_blocking=True)
                b[proj][:, slot, :, rank:].zero_()
            else:
                a[proj][:, slot].zero_()
                b[proj][:, slot].zero_()
        self.stacks.scales[slot] = weights.spec.scale
