"""A GGUF served in its own quantization: the file's tensors become the model's weights without a
float copy, with exactly the values the dequantized path (``--dtype float32``, equal to HF
transformers) computes with, and logits that differ from that path's only by the kernels' rounding
of activations to int8; a type without a kernel is dequantized with one warning; the weights take
the file's size, and a second start derives nothing again."""

from __future__ import annotations

import functools
import re
import warnings
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import gguf
import pytest
import torch

import engine.gguf_cache
import engine.gguf_weights
import engine.quant_linear
from engine.config import EngineConfig
from engine.loader import LoadedModel, bundled_gguf_path, load_model
from engine.model import PROJECTIONS
from engine.packed_linear import PackedWeight
from engine.runner import ModelRunner
from scheduler.plan import StepPlan
from scheduler.sequence import Sequence
from tests.engine.conftest import BlockPool, build_tiny_model, chunk
from tests.engine.test_gguf_families import SERVED as GGUF_FAMILIES
from tests.engine.test_gguf_families import write_gguf
from tests.engine.tiny_gguf import EVERY_SERVED, Q, Q4_K_M, TensorTypes, TinyShape, uniform, write_tiny_gguf

# name -> (tensor types, shape): every served type in mixed fused groups with an untied head in Q5_K;
# llama.cpp's Q4_K_M mix (Q6_K head); a tied Q8_0 file as the bundled one is laid out.
FILES = {
    "every_type": (EVERY_SERVED, TinyShape(tied=False)),
    "q4_k_m": (Q4_K_M, TinyShape(tied=False)),
    "q8_0_tied": (uniform(Q.Q8_0), TinyShape(tied=True)),
}
PROMPT = list(range(5, 45))
# The kernels round each activation row to int8 in blocks of 32: an element's error is at most 1/254
# of its block's largest value, so one projection's output is off by at most ~0.4% of sum |x||w|.
# Nine projections deep (two layers and the head), with attention and norms passing relative errors
# on and random weights amplifying them, the logits stay within a tenth of their range; a wrong
# weight (a row out of place, a scale misread) moves them by their whole range.
KERNEL_RTOL = 0.1


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("tiny-gguf")
    return {name: write_tiny_gguf(folder / f"{name}.gguf", types, shape) for name, (types, shape) in FILES.items()}


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf-cache")


@pytest.fixture(scope="module")
def loaded(files, cache) -> dict[str, tuple[LoadedModel, LoadedModel]]:
    """Each file served natively, and dequantized (the --dtype float32 path, through transformers)."""
    return {name: (load_model(str(path), cache_dir=cache, native_gguf=True), load_model(str(path), cache_dir=cache))
            for name, path in files.items()}


def prompt_logits(loaded: LoadedModel, prompt: list[int] = PROMPT) -> torch.Tensor:
    """Every position's logits of one prefill of ``prompt``."""
    blocks = -(-len(prompt) // 4)
    runner = ModelRunner(loaded, num_blocks=blocks, block_size=4)
    seq = Sequence("p", prompt)
    plan = StepPlan([chunk(seq, 0, len(prompt), BlockPool(blocks), 4)])
    _, hidden = runner.execute_with_hidden(plan, list(range(len(prompt))))
    return runner.head_logits(hidden)


def without_kernels(monkeypatch) -> None:
    """QuantWeights computed by their exact fallback (dequantize, then torch.mm): no activation rounding."""
    monkeypatch.setattr(engine.quant_linear, "quant_kernels_present", lambda: False)


@pytest.mark.parametrize("name", list(FILES))
def test_a_gguf_is_served_in_its_own_types_with_the_dequantized_paths_exact_weights(name, loaded):
    native, exact = loaded[name]
    model, ref = native.model, exact.model
    assert model.weight_forms() == {"quant"}
    for i, (layer, ref_layer) in enumerate(zip(model.layers, ref.layers)):
        for proj in PROJECTIONS:
            weight = getattr(layer, proj)
            assert isinstance(weight, PackedWeight) and weight.form == "quant"
            assert torch.equal(weight.dense(), getattr(ref_layer, proj).detach()), f"layer {i} {proj}"
        for norm in ("input_norm", "post_norm"):
            assert torch.equal(getattr(layer, norm), getattr(ref_layer, norm))
    ids = torch.tensor([0, 7, 319, 7])
    assert torch.equal(model.embed.dequantize_rows(ids), ref.embed[ids])
    head = ref.embed if native.model_config.tie_word_embeddings else ref.lm_head
    assert torch.equal(model.head.dense().t(), head.detach())


@pytest.mark.parametrize("name", list(FILES))
def test_native_logits_equal_the_dequantized_paths_without_activation_rounding(name, loaded, monkeypatch):
    exact = prompt_logits(loaded[name][1])
    without_kernels(monkeypatch)
    native = prompt_logits(loaded[name][0])
    assert exact.abs().max() > 1.0
    assert (native - exact).abs().max().item() < 1e-4 * exact.abs().max().item()


@pytest.mark.parametrize("name", list(FILES))
@pytest.mark.parametrize("tokens", [len(PROMPT), 3], ids=["prefill", "few_rows"])
def test_native_logits_on_the_kernels_stay_within_the_activation_rounding(name, loaded, tokens):
    """A prompt of 3 tokens is a call of 3 rows: the repacked weights' few-row kernels serve it."""
    assert engine.quant_linear.quant_kernels_present()
    exact = prompt_logits(loaded[name][1], PROMPT[:tokens])
    native = prompt_logits(loaded[name][0], PROMPT[:tokens])
    spread = exact.abs().max().item()
    assert (native - exact).abs().max().item() < KERNEL_RTOL * spread
    assert (native.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("name", ["q4_k_m", "q8_0_tied"])
def test_q4_0_q8_0_q4_k_and_q6_k_weights_are_served_repacked(name, loaded):
    model = loaded[name][0].model
    weights = [model.embed, model.head] + [getattr(layer, proj) for layer in model.layers for proj in PROJECTIONS]
    parts = [part for w in weights for part in getattr(w, "parts", [w])]
    assert all(p.packed == (p.ggml_type in engine.quant_linear.REPACKED_TYPES) for p in parts)
    assert any(p.packed for p in parts)


def test_a_runner_reads_the_kernel_switches_once_for_its_quantized_weights(loaded, monkeypatch):
    model = loaded["q4_k_m"][0].model
    quant = [w for w in [model.head] + [getattr(layer, proj) for layer in model.layers for proj in PROJECTIONS]
             if isinstance(w, engine.quant_linear.QuantWeight | engine.quant_linear.StackedQuantWeight)]
    monkeypatch.setenv("TIERGATE_QUANT_ISA", "scalar")
    try:
        ModelRunner(loaded["q4_k_m"][0], num_blocks=4, block_size=4)
        fixed = engine.quant_linear.KernelSwitches(engine.quant_linear.ISAS.index("scalar"),
                                                   engine.quant_linear.panel_min_rows(),
                                                   engine.quant_linear.row_prefetch())
        assert quant and all(w.switches == fixed for w in quant)
        monkeypatch.setenv("TIERGATE_QUANT_ISA", "no-such-path")  # read no more: the weights' calls do not fail
        x = torch.randn(2, quant[0].in_features)
        assert torch.isfinite(quant[0](x)).all()
    finally:
        for w in quant:
            w.switches = None  # the module's other tests call these weights as tests do: per call


def test_decode_steps_add_and_norm_in_the_projections_calls_with_the_separate_calls_bits(loaded, monkeypatch):
    """In a step of decodes only, each layer's output and down projections add into the residual and norm it in
    their own call (quant_linear_add_rms_norm_; the last layer's down with the final norm): logits bit for bit
    those of the separate calls and of the final norm after the last layer."""
    model = loaded["q4_k_m"][0]
    calls = []
    one_call = engine.quant_linear.quant_matmul_add_rms_norm_
    monkeypatch.setattr(engine.quant_linear, "quant_matmul_add_rms_norm_",
                        lambda *args: calls.append(1) or one_call(*args))
    runner = ModelRunner(model, num_blocks=32, block_size=4)
    for layer in model.model.layers:
        layer.decode_call = None  # each layer's calls apart: the next test takes them together
    pool = BlockPool(32)
    try:
        seqs = [Sequence("a", PROMPT[:9]), Sequence("b", PROMPT[9:20])]
        runner.execute(StepPlan([chunk(s, 0, s.num_tokens, pool, 4) for s in seqs]))
        for s in seqs:
            s.num_computed_tokens = s.num_tokens
            s.output_token_ids.append(7)
        assert calls == []  # a prefill step keeps the two calls
        decode = StepPlan([chunk(s, s.num_computed_tokens, 1, pool, 4) for s in seqs])
        joined = runner.execute(decode)
        assert len(calls) == 2 * len(model.model.layers)
        for layer in model.model.layers:
            layer.plain_join = False
        assert torch.equal(runner.execute(decode), joined)
    finally:
        for layer in model.model.layers:
            layer.plain_join = True
        for w in [model.model.head] + [getattr(layer, p) for layer in model.model.layers for p in PROJECTIONS]:
            if isinstance(w, engine.quant_linear.QuantWeight | engine.quant_linear.StackedQuantWeight):
                w.switches = None  # as the switches test leaves them: the module's other tests read them per call


@pytest.mark.parametrize("name", sorted(FILES))
def test_a_decode_step_makes_each_quantized_layer_one_call_with_the_separate_calls_bits(name, loaded, monkeypatch):
    """In a step of decodes only, every layer runs as one call (csrc/quant_decode_layer.cpp): logits
    bit for bit those of its separate calls, and KV written alike; prefill steps, and a layer without the call,
    keep the separate calls. The call skips torch.ops' Python walk of its arguments for torch.compile's fake
    objects."""
    model = loaded[name][0]
    layers = model.model.layers
    used, walks = [], []
    walk = torch._ops._must_dispatch_in_python
    monkeypatch.setattr(torch._ops, "_must_dispatch_in_python", lambda *a: walks.append(1) or walk(*a))
    runners, logits = [], []
    try:
        for together in (True, False):
            used.clear()
            runner = ModelRunner(model, num_blocks=32, block_size=4)  # rebuilds the calls on the switches it fixes
            assert all(layer.decode_call is not None for layer in layers)
            for layer in layers:
                layer.decode_op = functools.partial(lambda op, *args: used.append(1) or op(*args), layer.decode_op)
            if not together:
                for layer in layers:
                    layer.decode_call = None
            pool = BlockPool(32)
            seqs = [Sequence("a", PROMPT[:9]), Sequence("b", PROMPT[9:20])]
            runner.execute(StepPlan([chunk(s, 0, s.num_tokens, pool, 4) for s in seqs]))
            assert used == []  # a prefill step keeps the separate calls
            for s in seqs:
                s.num_computed_tokens = s.num_tokens
                s.output_token_ids.append(7)
            decode = StepPlan([chunk(s, s.num_computed_tokens, 1, pool, 4) for s in seqs])
            walks.clear()
            logits.append(runner.execute(decode))
            assert len(used) == (len(layers) if together else 0)
            assert walks == []
            runners.append(runner)
        assert torch.equal(logits[0], logits[1])
        assert all(torch.equal(a, b) for a, b in zip(runners[0].kv_cache.layers, runners[1].kv_cache.layers))
    finally:
        for w in [model.model.head] + [getattr(layer, p) for layer in layers for p in PROJECTIONS]:
            if isinstance(w, engine.quant_linear.QuantWeight | engine.quant_linear.StackedQuantWeight):
                w.switches = None  # as the switches test leaves them: the module's other tests read them per call


def test_a_type_without_a_kernel_is_dequantized_with_one_warning_naming_tensors_and_type(tmp_path, cache,
                                                                                          monkeypatch):
    types = TensorTypes(projections={"attn_v": Q.Q3_K, "1.ffn_down": Q.Q2_K}, default=Q.Q8_0)
    path = write_tiny_gguf(tmp_path / "k_low.gguf", types, TinyShape(tied=True))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = load_model(str(path), cache_dir=cache, native_gguf=True)
    mine = [w for w in caught if "no kernel" in str(w.message)]
    assert len(mine) == 1
    message = str(mine[0].message)
    assert "Q3_K: blk.0.attn_v.weight, blk.1.attn_v.weight" in message and "Q2_K: blk.1.ffn_down.weight" in message
    layers = loaded.model.layers
    assert not isinstance(layers[0].qkv, PackedWeight) and isinstance(layers[0].down, PackedWeight)
    assert not isinstance(layers[1].down, PackedWeight) and isinstance(layers[1].gate_up, PackedWeight)
    without_kernels(monkeypatch)
    exact = prompt_logits(load_model(str(path), cache_dir=cache))
    assert (prompt_logits(loaded) - exact).abs().max().item() < 1e-4 * exact.abs().max().item()


def test_the_native_weights_take_the_files_size_not_four_times_it(engine_cache_dir):
    path = bundled_gguf_path()
    loaded = load_model("bundled", cache_dir=engine_cache_dir, native_gguf=True)
    ModelRunner(loaded, num_blocks=4, block_size=16)  # prepare_weights: nothing more is packed
    size = path.stat().st_size
    assert loaded.model.weight_forms() == {"quant"}
    assert 0.9 * size < loaded.model.weight_bytes() < 1.05 * size
    cfg = loaded.model_config
    float_bytes = 4 * (cfg.vocab_size * cfg.hidden_size + cfg.num_layers * (
        cfg.hidden_size * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * cfg.hidden_size
        + 3 * cfg.hidden_size * cfg.intermediate_size))
    assert loaded.model.weight_bytes() < float_bytes / 3.5


def test_a_second_native_start_reads_the_file_and_its_cached_config_only(files, tmp_path, monkeypatch):
    first = load_model(str(files["q8_0_tied"]), cache_dir=tmp_path, native_gguf=True)
    assert not list(first.path.glob("*.safetensors")), "a float copy of the weights was cached"
    assert (first.path / "config.json").is_file() and (first.path / "tokenizer.json").is_file()

    def no_conversion(*args, **kwargs):
        raise AssertionError("the file's metadata was derived again")

    monkeypatch.setattr(engine.gguf_cache, "convert_gguf", no_conversion)
    again = load_model(str(files["q8_0_tied"]), cache_dir=tmp_path, native_gguf=True)
    assert again.path == first.path and again.model.weight_forms() == {"quant"}


def test_a_server_derives_a_files_metadata_in_a_spawned_child(files, tmp_path, monkeypatch):
    """The suite derives in its own process (tests/conftest.py); a server spawns a child, whose peak heap ends
    with it."""
    children = []

    class Recorded(ProcessPoolExecutor):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            children.append(kwargs["mp_context"].get_start_method())

    monkeypatch.setattr(engine.gguf_cache, "ProcessPoolExecutor", Recorded)
    monkeypatch.delenv(engine.gguf_cache.DERIVE_IN_PROCESS)
    derived = engine.gguf_cache.metadata_dir(files["q8_0_tied"], tmp_path / "child")
    assert children == ["spawn"]
    assert (derived / "config.json").is_file() and (derived / engine.gguf_cache.COMPLETE_MARKER).is_file()
    monkeypatch.setenv(engine.gguf_cache.DERIVE_IN_PROCESS, "1")
    here = engine.gguf_cache.metadata_dir(files["q8_0_tied"], tmp_path / "here")
    assert children == ["spawn"] and (here / "config.json").read_text() == (derived / "config.json").read_text()


def test_a_gguf_asked_in_a_dtype_or_off_cpu_is_dequantized(files, cache):  # CUDA by logic: no GPU here
    assert EngineConfig().native_gguf
    assert not EngineConfig(dtype="float32").native_gguf and not EngineConfig(dtype="bfloat16").native_gguf
    assert not EngineConfig(device="cuda").native_gguf  # CUDA: dequantized at load, served in bf16
    loaded = load_model(str(files["q8_0_tied"]), cache_dir=cache, native_gguf=True, dtype=torch.bfloat16)
    assert loaded.model.weight_forms() == {"plain"} and loaded.model.dtype == torch.bfloat16


def test_quantize_is_refused_for_a_gguf(files, cache):
    with pytest.raises(ValueError, match="--quantize is for Hugging Face checkpoints; q8_0_tied.gguf is a GGUF"):
        load_model(str(files["q8_0_tied"]), cache_dir=cache, native_gguf=True, quantize="q8_0")


# One file per family whose tensors map differently: Llama's permuted q/k, Qwen2's biases, Qwen3's
# q/k norms, Phi-3's fused qkv and gate|up, Gemma 2's and 3's sandwich norms stored plus one.
FAMILY_CASES = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")
PROJECTION_NAME = re.compile(r"blk\.\d+\.(attn_(q|k|v|qkv|output)|ffn_(gate|up|down))\.weight")


@pytest.mark.parametrize("case", FAMILY_CASES)
def test_every_familys_gguf_is_served_natively_with_the_dequantized_paths_logits(case, tmp_path, monkeypatch):
    tiny, changes = GGUF_FAMILIES[case]
    model_dir = build_tiny_model(tmp_path / case, tiny, **changes)
    add_tensor = gguf.GGUFWriter.add_tensor

    def add_projections_in_q8_0(writer, name, tensor, *args, **kwargs):
        if PROJECTION_NAME.fullmatch(name):
            blocks = gguf.quants.quantize(tensor, Q.Q8_0)
            return add_tensor(writer, name, blocks, raw_shape=blocks.shape, raw_dtype=Q.Q8_0)
        return add_tensor(writer, name, tensor, *args, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(gguf.GGUFWriter, "add_tensor", add_projections_in_q8_0)
        path = write_gguf(model_dir, tmp_path / f"{case}.gguf")
    native = load_model(str(path), cache_dir=tmp_path / "cache", native_gguf=True)
    assert {getattr(layer, p).form for layer in native.model.layers for p in PROJECTIONS} == {"quant"}
    exact = prompt_logits(load_model(str(path), cache_dir=tmp_path / "cache"), PROMPT[:17])
    without_kernels(monkeypatch)
    assert (prompt_logits(native, PROMPT[:17]) - exact).abs().max().item() < 1e-4 * exact.abs().max().item()


def mapped_rss_bytes(path: Path) -> int:
    """This process's resident bytes of its maps of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            inside = fields[-1] == str(path)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


def test_each_repacked_tensors_pages_of_the_map_go_as_it_is_repacked_not_after_the_last(tmp_path, monkeypatch):
    """Weights and map counted together during the load would double its peak RSS (a ~1B Q8_0 file's 1.1 GB)."""
    path = write_tiny_gguf(tmp_path / "q8_0.gguf", uniform(Q.Q8_0), TinyShape(layers=4, tied=True))
    load_model(str(path), cache_dir=tmp_path / "cache", native_gguf=True)  # the cached table: a later start's load
    seen: list[int] = []

    class Measured(engine.gguf_weights.QuantWeight):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            seen.append(mapped_rss_bytes(path))

    monkeypatch.setattr(engine.gguf_weights, "QuantWeight", Measured)
    load_model(str(path), cache_dir=tmp_path / "cache", native_gguf=True)
    assert len(seen) == 4 * 7 + 1 and min(seen) > 0  # the projections and the embedding; the file was mapped
    assert max(seen) < path.stat().st_size / 4
