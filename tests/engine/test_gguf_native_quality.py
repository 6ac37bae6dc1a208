"""The bundled Q4_1 file served natively stays as close to the file's exact weights as llama.cpp does.

The reference is the file's weights computed exactly (the dequantized ``--dtype float32`` path, equal
to HF transformers). Teacher-forced over the few hundred tokens of plain English in
``data/plain_english.txt``, the native model's next-token logprobs must differ from it by no more
than llama.cpp's on the same file and the same tokens do (its figures on this text, and how they
were taken, are in docs/quantization.md; issue #30 quotes mean 0.0525 nats, max 0.259, top-1 97.8%
over another 180 tokens). The kernels' rounding of activations is the only difference allowed to
move them (to int8 on the int8 tiles; x and the weights to bfloat16 on the AMX panel path, which
serves a prefill's many rows where the CPU has it): without it the native logprobs equal the
reference's (tests/engine/test_gguf_native.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.loader import load_model
from engine.quant_linear import panel_min_rows
from tests.engine.test_gguf_native import prompt_logits

TEXT = Path(__file__).parent / "data" / "plain_english.txt"
# llama.cpp on the bundled file over TEXT's tokens, against the same reference (docs/quantization.md).
LLAMA_CPP_MEAN, LLAMA_CPP_MAX, LLAMA_CPP_TOP1 = 0.0537, 0.284, 0.978


@pytest.fixture(scope="module")
def deltas(bundled_model, engine_cache_dir) -> tuple[torch.Tensor, float]:
    """|Δ logprob| of each next token, and the top-1 agreement, native against the exact weights."""
    native = load_model("bundled", cache_dir=engine_cache_dir, native_gguf=True)
    assert native.model.weight_forms() == {"quant"}
    ids = bundled_model.tokenizer.encode(TEXT.read_text()).ids
    assert len(ids) > 300
    exact = torch.log_softmax(prompt_logits(bundled_model, ids), dim=-1)[:-1]
    served = torch.log_softmax(prompt_logits(native, ids), dim=-1)[:-1]
    targets = torch.tensor(ids[1:])[:, None]
    delta = (served.gather(1, targets) - exact.gather(1, targets)).abs().squeeze(1)
    top1 = (served.argmax(-1) == exact.argmax(-1)).float().mean().item()
    print(f"\nbundled Q4_1 natively vs float32 over {len(delta)} tokens: mean |dlogprob| {delta.mean():.4f}, "
          f"max {delta.max():.4f}, top-1 agreement {top1:.1%} (llama.cpp: {LLAMA_CPP_MEAN}, {LLAMA_CPP_MAX}, "
          f"{LLAMA_CPP_TOP1:.1%})")
    return delta, top1


def test_the_native_logprobs_are_on_average_as_close_to_the_exact_weights_as_llama_cpps(deltas):
    delta, _ = deltas
    assert delta.mean().item() <= LLAMA_CPP_MEAN


@pytest.mark.xfail(panel_min_rows() is None, strict=False,
                   reason="issue #30: where the int8 kernels serve prefill (no AMX panel path) the top-1 agreement "
                          "sits at llama.cpp's 97.8% (316 of 323 tokens) within a token: 97.8% on an AMD Zen 4 box "
                          "once the 32-input kernels scaled a block's halves by x before the weights' scale (mean "
                          "0.038, max 0.209 nats), 97.5% before (0.038, 0.199), 96.6% on an AVX2-only EPYC earlier")
def test_the_native_model_picks_the_exact_weights_top_token_as_often_as_llama_cpp(deltas):
    _, top1 = deltas
    assert top1 >= LLAMA_CPP_TOP1


@pytest.mark.xfail(panel_min_rows() is None, strict=False,
                   reason="issue #30: where the int8 tiles serve prefill (no AMX panel path) the worst token measured "
                          "0.336 nats on an AMD Zen 4 box and 0.276 on an Intel one, against llama.cpp's 0.284 "
                          "(docs/quantization.md)")
def test_the_native_logprobs_worst_token_is_as_close_as_llama_cpps(deltas):
    delta, _ = deltas
    assert delta.max().item() <= LLAMA_CPP_MAX
