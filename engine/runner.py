"""Runs one scheduler step on the model: plan in, logits of the sampling chunks out.

Owns the KV cache and the per-step tensors (token ids, positions, slots,
block tables) built from ``StepPlan.chunks``; knows nothing of sampling.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from engine.attention import AttentionMetadata
from engine.cpu_threads import ThreadTuner
from engine.kv_cache import KVCache
from engine.kv_quant import KVDtype
from engine.loader import LoadedModel
from engine.lora_hook import LoraBatchLike
from engine.attention_kernels import DecodeKernel, PrefillKernel, decode_kernel_for, prefill_kernel_for
from scheduler.plan import StepPlan


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        num_blocks: int,
        block_size: int,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        decode_kernel: DecodeKernel | None | str = "auto",
        prefill_kernel: PrefillKernel | None | str = "auto",
        kv_dtype: KVDtype | None = None,
    ) -> None:
        """``decode_kernel``: "auto" picks the device's in-place paged attention kernel
        (engine/attention_kernels.py); None keeps the gathered path. ``prefill_kernel``: "auto"
        picks the causal prefill kernel where one serves these shapes; None keeps SDPA.
        ``kv_dtype``: the pool's format, "q8_0" or None (the model's dtype)."""
        self.model = loaded.model
        self.config = loaded.model_config
        self.device = torch.device(device) if device is not None else self.model.device
        self.dtype = dtype or self.model.dtype
        if self.model.device != self.device or self.model.dtype != self.dtype:
            self.model.unpack_weights()
            self.model = self.model.to(device=self.device, dtype=self.dtype)
        self.model.prepare_weights()
        self.block_size = block_size
        self.kv_cache = KVCache.allocate(self.config, num_blocks, block_size, self.device, kv_dtype or self.dtype)
        self.decode_kernel = (decode_kernel_for(self.device, self.config.head_dim)
                              if decode_kernel == "auto" else decode_kernel)
        self.prefill_kernel = (prefill_kernel_for(self.device, self.dtype, self.config.head_dim)
                               if prefill_kernel == "auto" else prefill_kernel)
        self.thread_tuner = ThreadTuner.from_env() if self.device.type == "cpu" else None
        # LongRoPE: sequences past this many tokens rotate with the long factors (engine/rope.py).
        self.long_context_after = self.config.long_context_after

    def execute(
        self,
        plan: StepPlan,
        lora: LoraBatchLike | None = None,
        between_layers: Callable[[], None] | None = None,
        nested: bool = False,
    ) -> torch.Tensor:
        """Float32 logits ``[rows that sample, vocab]``, in plan order: one row per chunk that samples,
        and one more per draft it carries (engine/speculative.py)."""
        return self.execute_with_hidden(plan, [], lora, between_layers, nested)[0]

    def execute_with_hidden(
        self,
        plan: StepPlan,
        hidden_rows: list[int],
        lora: LoraBatchLike | None = None,
        between_layers: Callable[[], None] | None = None,
        nested: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The sampling chunks' logits (as ``execute``) and the final hidden states of ``hidden_rows``
        (indices into the step's tokens, chunk after chunk in plan order) for ``head_logits``.

        ``between_layers``: called between the model's layers (``DecoderModel.final_hidden``).
        ``nested``: this step runs inside another's ``between_layers``; it keeps that step's
        thread count and is left out of the thread tuner's trials, as its time is of that step's.
        """
        if self.thread_tuner is None or nested:
            return self._execute(plan, hidden_rows, lora, between_layers)
        paused = 0.0

        def timed_pause() -> None:
            nonlocal paused
            began = time.perf_counter()
            between_layers()
            paused += time.perf_counter() - began

        self.thread_tuner.before_step(plan.num_tokens, plan.bound_slack)
        started = time.perf_counter()
        out = self._execute(plan, hidden_rows, lora, timed_pause if between_layers is not None else None)
        self.thread_tuner.after_step(time.perf_counter() - started - paused)
        return out

    @torch.inference_mode()
    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of hidden states from ``execute_with_hidden``."""
        return self.model.head_logits(hidden)

    @torch.inference_mode()
    def _execute(
        self, plan: StepPlan, hidden_rows: list[int], lora: LoraBatchLike | None,
        between_layers: Callable[[], None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if plan.is_empty:
            return (torch.empty(0, self.config.vocab_size, dtype=torch.float32, device=self.device),
                    torch.empty(0, self.config.hidden_size, dtype=self.dtype, device=self.device))
        token_ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        specs: list[tuple[int, int, list[int]]] = []
        for chunk in plan.chunks:
            seq, start, end = chunk.seq, chunk.start, chunk.end
            needed = (end + self.block_size - 1) // self.block_size
            if len(seq.block_table) < needed:
                raise ValueError(
                    f"sequence {seq.seq_id} needs {needed} KV blocks for positions [{start}, {end}) "
                    f"but its block table has {len(seq.block_table)}"
                )
            token_ids.extend(chunk.token_ids)
            positions.extend(range(start, end))
            specs.append((start, chunk.num_tokens, seq.block_table))
            if chunk.samples:  # the newest token's row, then one row per draft
                sample_rows.extend(range(len(token_ids) - 1 - len(chunk.draft_token_ids), len(token_ids)))
        as_tensor = lambda data: torch.tensor(data, dtype=torch.long, device=self.device)  # noqa: E731
        long_rows = self._long_rows(plan) if self.long_context_after is not None else None
        meta = AttentionMetadata.build(specs, self.block_size, self.device, self.decode_kernel, self.config.sliding_window,
                                       self.prefill_kernel)
        hidden = self.model.final_hidden(as_tensor(token_ids), as_tensor(positions), meta, self.kv_cache,
                                         as_tensor(sample_rows + hidden_rows), lora, long_rows, between_layers)
        return self.model.head_logits(hidden[:len(sample_rows)]), hidden[len(sample_rows):]

    def _long_rows(self, plan: StepPlan) -> torch.Tensor | None:
        """Bool ``[T]``: the rows of sequences in the model's long-context regime (LongRoPE); None if none."""
        flags = [(c.seq.is_long_context(self.long_context_after), c.num_tokens) for c in plan.chunks]
        if not any(long for long, _ in flags):
            return None
        rows = [long for long, n in flags for _ in range(n)]
        return torch.tensor(rows, dtype=torch.bool, device=self.device)
