"""The F32 GGUF the llama.cpp peer runs holds exactly the dequantized weights, metadata kept."""

from __future__ import annotations

import gguf
import numpy as np

from bench.common.model_files import write_f32_gguf


def _tiny_quantized_gguf(path):
    rng = np.random.default_rng(0)
    weights = {"blk.0.attn_q.weight": rng.standard_normal((8, 64)).astype(np.float32),
               "output_norm.weight": rng.standard_normal(64).astype(np.float32)}
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_token_list(["<unk>", "a", "b"])
    writer.add_float32("llama.rope.freq_base", 10000.0)
    q = gguf.quants.quantize(weights["blk.0.attn_q.weight"], gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_q.weight", q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("output_norm.weight", weights["output_norm.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_f32_gguf_has_the_dequantized_tensors_and_the_same_metadata(tmp_path):
    src, dst = tmp_path / "q8.gguf", tmp_path / "f32.gguf"
    _tiny_quantized_gguf(src)
    write_f32_gguf(src, dst)
    original, converted = gguf.GGUFReader(src), gguf.GGUFReader(dst)
    for before, after in zip(original.tensors, converted.tensors):
        assert after.name == before.name
        assert after.tensor_type == gguf.GGMLQuantizationType.F32
        expected = gguf.quants.dequantize(before.data, before.tensor_type)
        np.testing.assert_array_equal(np.asarray(after.data).reshape(expected.shape), expected)
    assert converted.fields["general.file_type"].contents() == gguf.LlamaFileType.ALL_F32
    assert converted.fields["tokenizer.ggml.tokens"].contents() == ["<unk>", "a", "b"]
    assert converted.fields["llama.rope.freq_base"].contents() == 10000.0
    assert converted.fields["llama.block_count"].contents() == 1
