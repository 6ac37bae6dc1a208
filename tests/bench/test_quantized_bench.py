"""The quantized-serving bench: the random-weight GGUF builder (and llama.cpp's quantizer on its
output), the bytes a decode step reads, the all-streams decode window, and the report's ratios."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from bench.common import model_files
from bench.common.gguf_shapes import LlamaShape, quantize, write_random_gguf
from bench.offline.quantized_report import decode_window, engine_summary, gguf_weight_summary, ratios, render_markdown

TINY = LlamaShape("tiny", hidden=64, layers=2, heads=4, kv_heads=2, ffn=96)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_random_gguf(TINY, tmp_path_factory.mktemp("gguf") / "tiny.F16.gguf", model_files.bundled_gguf())


def test_random_gguf_has_the_shape_the_bundled_tokenizer_and_spread_weights(tiny_gguf):
    reader = gguf.GGUFReader(tiny_gguf)
    template = gguf.GGUFReader(model_files.bundled_gguf())
    assert reader.fields["llama.embedding_length"].contents() == 64
    assert reader.fields["llama.block_count"].contents() == 2
    assert reader.fields["llama.attention.head_count"].contents() == 4
    assert reader.fields["llama.attention.head_count_kv"].contents() == 2
    assert reader.fields["llama.feed_forward_length"].contents() == 96
    assert reader.fields["llama.rope.dimension_count"].contents() == 16
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "llama.rope.freq_base", "tokenizer.chat_template"):
        assert reader.fields[key].contents() == template.fields[key].contents()
    vocab = len(template.fields["tokenizer.ggml.tokens"].data)
    tensors = {t.name: t for t in reader.tensors}
    assert "output.weight" not in tensors  # tied, as SmolLM2 and Llama 3.2 1B
    assert len(tensors) == 2 + 9 * 2
    # gguf dims are (in, out): the reverse of numpy's
    assert list(tensors["token_embd.weight"].shape) == [64, vocab]
    assert list(tensors["blk.1.attn_k.weight"].shape) == [64, 32]
    assert list(tensors["blk.0.ffn_down.weight"].shape) == [96, 64]
    assert tensors["blk.0.attn_q.weight"].tensor_type == gguf.GGMLQuantizationType.F16
    assert tensors["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    np.testing.assert_array_equal(np.asarray(tensors["output_norm.weight"].data), np.ones(64, np.float32))
    q = np.asarray(tensors["blk.0.attn_q.weight"].data, dtype=np.float32)
    assert 0.015 < q.std() < 0.025 and abs(q.mean()) < 0.005
    assert not np.array_equal(q, np.asarray(tensors["blk.1.attn_q.weight"].data, dtype=np.float32))


def test_random_gguf_is_the_same_for_the_same_seed(tiny_gguf, tmp_path):
    again = write_random_gguf(TINY, tmp_path / "again.gguf", model_files.bundled_gguf())
    other = write_random_gguf(TINY, tmp_path / "other.gguf", model_files.bundled_gguf(), seed=1)
    assert again.read_bytes() == tiny_gguf.read_bytes()
    assert other.read_bytes() != tiny_gguf.read_bytes()


def test_a_decode_step_reads_every_tensor_of_a_tied_file_once(tiny_gguf):
    summary = gguf_weight_summary(tiny_gguf)
    reader = gguf.GGUFReader(tiny_gguf)
    assert summary["tied_embedding"]
    assert summary["bytes_per_step"] == summary["tensor_bytes"] == sum(int(t.n_bytes) for t in reader.tensors)
    assert set(summary["bytes_by_type"]) == {"F16", "F32"}
    assert summary["bytes_by_type"]["F32"] == 4 * 64 * (2 * 2 + 1)


def test_an_untied_embedding_is_read_one_row_a_token_not_whole(tmp_path):
    writer = gguf.GGUFWriter(tmp_path / "untied.gguf", "llama")
    writer.add_tensor("token_embd.weight", np.zeros((100, 32), np.float32))
    writer.add_tensor("output.weight", np.zeros((100, 32), np.float16))
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((32, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    summary = gguf_weight_summary(tmp_path / "untied.gguf")
    assert not summary["tied_embedding"]
    assert summary["bytes_per_step"] == 100 * 32 * 2 + 32 * 32 * 4


@pytest.mark.bench_peers
def test_llama_cpp_quantizes_the_random_file_into_blocks_gguf_py_reads(tiny_gguf, tmp_path):
    q8 = quantize(tiny_gguf, tmp_path / "tiny.Q8_0.gguf", "q8_0")
    reader = gguf.GGUFReader(q8)
    tensors = {t.name: t for t in reader.tensors}
    assert tensors["blk.0.ffn_gate.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0
    assert tensors["blk.0.ffn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    original = {t.name: t for t in gguf.GGUFReader(tiny_gguf).tensors}
    for name in ("blk.0.ffn_gate.weight", "blk.1.attn_v.weight"):
        before = np.asarray(original[name].data, dtype=np.float32)
        after = gguf.quants.dequantize(tensors[name].data, tensors[name].tensor_type)
        assert after.shape == before.shape
        # Q8_0: 32 values share one scale d = max|x|/127, stored in f16 (relative error <= 2^-11): a
        # value is off by at most half a step plus up to 127 steps' share of the scale's rounding
        step = np.abs(before.reshape(-1, 32)).max(axis=1, keepdims=True) / 127
        assert np.all(np.abs(after - before).reshape(-1, 32) <= step * (0.5 + 127 * 2.0**-11) + 1e-7)
    assert reader.fields["tokenizer.ggml.tokens"].contents()[:5] == \
        gguf.GGUFReader(tiny_gguf).fields["tokenizer.ggml.tokens"].contents()[:5]


def test_decode_window_counts_tokens_while_every_stream_runs():
    # Stream 0 starts at 0.0 and ends at 1.0; stream 1 gets its first token at 0.4 and ends at 1.4.
    times = {0: [0.0, 0.2, 0.4, 0.6, 0.8, 1.0], 1: [0.4, 0.6, 0.8, 1.0, 1.2, 1.4], 2: []}
    window = decode_window(times)
    assert window["start_s"] == 0.4 and window["end_s"] == 1.0
    assert window["tokens"] == 6  # 0.6, 0.8, 1.0 of each stream
    assert window["tokens_per_s"] == pytest.approx(10.0)
    assert decode_window({0: [0.0, 0.5], 1: [0.6, 0.9]}) is None  # one ended before the other began


def _round(single, pp, rss, streams=None):
    out = {"engine": "x", "load_s": 1.0, "peak_rss_mb": rss, "single": {"tokens_per_s": single},
           "pp512": {"tokens_per_s": pp}}
    if streams:
        out["streams"] = {"e2e_tokens_per_s": streams[0], "decode": {"tokens_per_s": streams[1]}, "kv": "peak 3/8"}
    return out


def _result():
    ours = [_round(30.0, 400.0, 700.0, (90.0, 120.0)), _round(36.0, 380.0, 710.0), _round(24.0, 420.0, 705.0)]
    peer = [_round(25.0, 500.0, 300.0, (60.0, 100.0)), _round(20.0, 500.0, 310.0), _round(25.0, 600.0, 300.0)]
    peer[0]["buffers"] = ["load_tensors: CPU_REPACK model buffer size = 20.0 MiB"]
    peer[0]["llama_bench"] = {"pp512": 510.0, "tg128": 26.0, "settings": "n_batch=n_ubatch=512, 2 threads"}
    ours[0]["weights"] = {"forms": {"quant Q4_K": 64}, "by_kind": {"quant Q4_K": 100e6}, "bytes": 100e6}
    weights = {"file_bytes": 100e6, "tensor_bytes": 99e6, "bytes_per_step": 100e6, "tied_embedding": True,
               "bytes_by_type": {"Q4_K": 90e6, "F32": 9e6}}
    return {"machine": {"date": "2026-01-01 00:00 UTC", "cpu": "test CPU", "cpu_flags": ["avx2"], "cores": 2,
                        "ram_gb": 24, "load_average": (1.0, 1.0, 1.0), "versions": {"python": "3.11"}},
            "threads": 2, "bandwidth_gbs": {"start": 20.0, "end": 10.0}, "complete": True,
            "settings": {"pin_threads": True, "single_prompt": 32, "tokens": 128, "streams": 32,
                         "stream_prompt": 64, "stream_tokens": 64, "rounds": 3},
            "files": [{"label": "360M Q4_K_M", "weights": weights, "engines": {"tiergate": ours, "llama.cpp": peer}}]}


def test_each_engine_reads_its_median_round_and_the_ratios_judge_the_goals():
    result = _result()
    ours = engine_summary(result["files"][0]["engines"]["tiergate"])
    assert ours["single"] == 30.0 and ours["pp512"] == 400.0 and ours["peak_rss_mb"] == 710.0
    assert ours["streams_e2e"] == 90.0 and ours["streams_decode"] == 120.0
    peer = engine_summary(result["files"][0]["engines"]["llama.cpp"])
    r = ratios({"tiergate": ours, "llama.cpp": peer})
    assert r == pytest.approx({"single": 1.2, "streams_decode": 1.2, "streams_e2e": 1.5, "pp512": 0.8})
    text = render_markdown(result)
    # 100 MB a step at 20 GB/s (the higher of start and end): 200 tok/s at batch 1, 6400 at 32, 102400 at 512
    assert "| 360M Q4_K_M | tiergate | 30.0 (15%) | 120.0 (2%) | 90.0 | 400.0 (0%) | 710 | 1.0 |" in text
    assert "Floor: 200.0 tok/s at batch 1." in text
    assert "| 360M Q4_K_M | 1.20x met | 1.20x **not met** | 1.50x met | 0.80x **not met** |" in text
    assert "CPU_REPACK model buffer size = 20.0 MiB" in text
    assert "pp512 510.0 tok/s, tg128 26.0 tok/s" in text
    assert "quant Q4_K x64" in text
    assert "- tiergate rounds in order: single stream 30.0, 36.0, 24.0 tok/s; pp512 400.0, 380.0, 420.0 tok/s;" in text


def test_a_failed_engine_is_reported_and_gets_no_ratio():
    result = _result()
    result["files"][0]["engines"]["llama.cpp"] = [{"engine": "llama.cpp", "error": "worker exited with 1"}]
    text = render_markdown(result)
    assert "| 360M Q4_K_M | llama.cpp | failed: worker exited with 1 |" in text
    assert "| 360M Q4_K_M | - | - | - | - |" in text


def test_describe_weights_counts_packed_forms_and_shared_storage_once():
    from engine.packed_linear import PackedWeight

    from bench.offline.quantized import describe_weights

    class FakeQuant(PackedWeight):
        form = "quant"
        ggml_type = gguf.GGMLQuantizationType.Q4_K
        nbytes = 1000

    class FakeStack(PackedWeight):
        form = "quant"
        parts = [FakeQuant(), FakeQuant()]
        parts[1].ggml_type = gguf.GGMLQuantizationType.Q6_K
        nbytes = 500

    model = torch.nn.Module()
    model.embed = torch.nn.Parameter(torch.zeros(10, 4), requires_grad=False)
    model.lm_head = model.embed  # tied: one storage
    model.layer = torch.nn.Module()
    model.layer.qkv = FakeQuant()
    model.layer.down = FakeQuant()
    model.layer.gate_up = FakeStack()
    model.embed_q = FakeQuant()
    model.head = model.embed_q  # a quantized tied head: the same weight
    model.layer.norm = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16), requires_grad=False)
    described = describe_weights(model)
    assert described["forms"] == {"quant Q4_K": 3, "quant Q4_K+Q6_K": 1}
    assert described["by_kind"] == {"quant Q4_K": 3000, "quant Q4_K+Q6_K": 500, "float32": 160, "bfloat16": 8}
    assert described["bytes"] == 3668


def test_llama_cpp_log_keeps_its_buffer_lines_and_counts_repacked_tensors_per_layout():
    from bench.peers.llama_bench import LlamaLog

    log = LlamaLog.__new__(LlamaLog)  # without installing the callback: the parsing alone
    log.pieces = ["load_tensors: CPU_REPACK model buffer size = 21.09 MiB\n", "print_info: n_head = 15\n",
                  "......repack: repack tensor blk.4.ffn_down.weight with q4_K_8x8\n", ".",
                  "repack: repack tensor blk.5.ffn_down.weight with q4_K_8x8\n",
                  "repack: repack tensor blk.5.attn_q.weight with q4_0_8x8\n",
                  "~llama_context: CPU compute buffer size is 99.7 MiB\n", "llama_context: flash_attn = auto\n",
                  "llama_context: flash_attn = auto\n"]
    assert log.lines() == ["load_tensors: CPU_REPACK model buffer size = 21.09 MiB", "llama_context: flash_attn = auto",
                           "repack: 2 tensors repacked to q4_K_8x8", "repack: 1 tensors repacked to q4_0_8x8"]
