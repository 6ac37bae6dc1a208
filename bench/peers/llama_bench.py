"""llama.cpp measured by its own rules through llama-cpp-python: llama-bench's pp512 and tg128, the
``llama_decode`` call they time, and its log lines (which buffers and layouts it used), which a bench
must print beside any ratio against it.

Imports llama_cpp only inside each call, so the benches that import this run without it.
"""

from __future__ import annotations

import ctypes
import statistics
import time
from collections import Counter
from pathlib import Path

PP_TOKENS = 512


class LlamaLog:
    """llama.cpp's log lines, collected in place of llama-cpp-python's printing them."""

    KEYS = ("buffer size", "REPACK", "repack", "AMX", "flash_attn", "n_ctx ", "type_k", "file type")

    def __init__(self) -> None:
        import llama_cpp

        self.pieces: list[str] = []
        self._callback = llama_cpp.llama_log_callback(self._on_log)  # kept: llama.cpp holds only its address
        llama_cpp.llama_log_set(self._callback, ctypes.c_void_p(0))

    def _on_log(self, level: int, text: bytes, user_data) -> None:
        self.pieces.append(text.decode("utf-8", errors="replace"))

    def lines(self) -> list[str]:
        """The distinct lines that say which buffers, layouts and attention llama.cpp used; its one line
        per repacked tensor summed into one per layout."""
        seen: dict[str, None] = {}
        repacked: Counter[str] = Counter()
        text = "".join(self.pieces).replace("repack: repack tensor", "\nrepack: repack tensor")
        for line in text.splitlines():
            line = " ".join(line.strip(". ").split())
            if line.startswith("repack: repack tensor") and " with " in line:
                repacked[line.rsplit(" with ", 1)[1]] += 1
            elif any(k in line for k in self.KEYS) and not line.startswith("~"):  # not the teardown's
                seen.setdefault(line, None)
        return list(seen) + [f"repack: {n} tensors repacked to {layout}" for layout, n in repacked.items()]


def llama_decode(ctx, batch, tokens: list[int], start: int) -> None:
    """``tokens`` of sequence 0 at positions ``start``.. through ``llama_decode``, the last one's logits only,
    waited for (llama-bench's way of timing a batch)."""
    import llama_cpp

    for i, token in enumerate(tokens):
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, start + i, 1
        batch.seq_id[i][0], batch.logits[i] = 0, i == len(tokens) - 1
    batch.n_tokens = len(tokens)
    if llama_cpp.llama_decode(ctx, batch) != 0:
        raise RuntimeError("llama_decode failed")
    llama_cpp.llama_synchronize(ctx)


def llama_bench_check(path: Path, threads: int, reps: int = 3) -> dict:
    """pp512 and tg128 as llama-bench measures them: a fresh context of 640 tokens, n_batch = n_ubatch =
    512, threads fixed, flash attention at llama.cpp's default; pp: one 512-token batch, the last token's
    logits only; tg: 128 one-token decodes from an empty cache. Median of ``reps``."""
    import llama_cpp

    model = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_cpp.llama_model_default_params())
    params = llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch = PP_TOKENS + 128, PP_TOKENS, PP_TOKENS
    params.n_threads = params.n_threads_batch = threads
    ctx = llama_cpp.llama_init_from_model(model, params)
    memory = llama_cpp.llama_get_memory(ctx)
    batch = llama_cpp.llama_batch_init(PP_TOKENS, 0, 1)

    def decode(tokens: list[int], start: int) -> None:
        llama_decode(ctx, batch, tokens, start)

    try:
        prompt = [100 + (i * 37) % 20000 for i in range(PP_TOKENS)]
        decode(prompt, 0)  # warm-up, as llama-bench does
        pp, tg = [], []
        for _ in range(reps):
            llama_cpp.llama_memory_clear(memory, True)
            began = time.perf_counter()
            decode(prompt, 0)
            pp.append(time.perf_counter() - began)
            llama_cpp.llama_memory_clear(memory, True)
            began = time.perf_counter()
            for i in range(128):
                decode([200 + i], i)
            tg.append(time.perf_counter() - began)
        flash = {getattr(llama_cpp, f"LLAMA_FLASH_ATTN_TYPE_{n}"): n.lower() for n in ("AUTO", "DISABLED", "ENABLED")}
        return {"pp512": PP_TOKENS / statistics.median(pp), "tg128": 128 / statistics.median(tg),
                "settings": f"n_batch=n_ubatch={PP_TOKENS}, {threads} threads, flash attention "
                            f"{flash.get(params.flash_attn_type, params.flash_attn_type)} (its default)"}
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
