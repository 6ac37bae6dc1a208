"""The throughput runners on a tiny random Llama: exact token counts, per-request timings, step records."""

from __future__ import annotations

import json

import pytest

from bench.common.workload import BenchRequest
from bench.offline.engine_throughput import decode_weight_bytes, ratios, render_markdown

REQUESTS = [BenchRequest(0, [5, 6, 7, 8, 9, 10, 11], 5), BenchRequest(1, [12, 13, 14], 9),
            BenchRequest(2, list(range(20, 60)), 3), BenchRequest(3, [7, 8], 1)]


def _check_timings(result):
    assert sorted(t.index for t in result.timings) == [0, 1, 2, 3]
    assert result.output_tokens == sum(r.output_len for r in REQUESTS)
    for t in result.timings:
        assert 0 <= t.issued_s <= t.first_token_s <= t.finished_s <= result.wall_s


@pytest.mark.parametrize("engine", ["tiergate", "tiergate-plain", "tiergate-onednn"])
def test_the_engine_bench_serves_tiergate_the_float32_weights_its_peers_read(engine, monkeypatch):
    """llama.cpp-F32 and HF read the bundled file's weights in float32; tiergate, which keeps a GGUF
    in its own blocks when no dtype is asked, must read them so too for the ratios to mean anything."""
    import bench.peers.tiergate_runner as tiergate_runner
    from bench.offline.engine_throughput import _make_runner

    for name in ("TIERGATE_PACKED_WEIGHTS", "TIERGATE_PAGED_ATTENTION", "TIERGATE_FUSED_NORMS", "TIERGATE_CPU_THREADS"):
        monkeypatch.setenv(name, "")  # restored after the test: _make_runner sets them for its worker process
    built = {}

    class Runner:
        def __init__(self, *args, **kwargs) -> None:
            built.update(kwargs)

    monkeypatch.setattr(tiergate_runner, "TiergateRunner", Runner)
    _make_runner(engine, REQUESTS, 2, 2)
    assert built["dtype"] == "float32"


def test_tiergate_runner_counts_exact_tokens_and_classifies_every_step(tiny_llama_dir):
    from bench.peers.tiergate_runner import TiergateRunner

    runner = TiergateRunner(max_concurrency=2, context_per_seq=64, model=str(tiny_llama_dir))
    try:
        runner.warm_up()
        runner.run(REQUESTS[:2], concurrency=1)
        result = runner.run(REQUESTS, concurrency=2)  # the same prompts again: no prefix-cache help
    finally:
        runner.close()
    _check_timings(result)
    steps = runner.recorder.steps
    assert sum(s.prefill_tokens for s in steps) == sum(r.prompt_len for r in REQUESTS)
    assert sum(s.decode_rows for s in steps) == sum(r.output_len - 1 for r in REQUESTS)
    assert all(s.prefill_tokens + s.decode_rows <= s.context_tokens for s in steps)
    assert 0 < result.extra["kv_blocks_peak"] <= result.extra["kv_blocks_total"]
    assert 0 <= result.extra["kv_waste"] < 1


def test_hf_runner_credits_each_request_only_its_own_tokens(tiny_llama_dir):
    from bench.peers.hf_transformers import HFTransformersRunner

    runner = HFTransformersRunner(tiny_llama_dir, threads=1)
    result = runner.run(REQUESTS, concurrency=2)
    _check_timings(result)
    by_index = {t.index: t for t in result.timings}
    # Requests 0 and 1 share a batch that runs 9 steps; request 0 is done after its 5th.
    assert by_index[0].finished_s < by_index[1].finished_s
    assert by_index[2].issued_s >= by_index[1].finished_s


def _summary(engine, c, tok_s):
    return {"engine": engine, "concurrency": c, "requests": 4, "output_tokens": 10, "wall_s": 1.0,
            "output_tokens_per_s": tok_s, "ttft_p50_s": 0.1, "ttft_p99_s": 0.2, "tpot_p50_s": 0.01,
            "tpot_p99_s": 0.02}


def test_ratios_and_report_compare_tiergate_with_each_peer():
    summaries = {"tiergate": {1: _summary("tiergate", 1, 40.0), 32: _summary("tiergate", 32, 300.0)},
                 "llama.cpp-F32": {1: _summary("llama.cpp-F32", 1, 50.0), 32: _summary("llama.cpp-F32", 32, 250.0)},
                 "hf-transformers": {32: _summary("hf-transformers", 32, 100.0)}}
    r = ratios(summaries)
    assert r["llama.cpp-F32"] == {1: pytest.approx(0.8), 32: pytest.approx(1.2)}
    assert r["hf-transformers"] == {32: pytest.approx(3.0)}
    result = {
        "concurrency": [1, 32], "copy_bandwidth_gbs": 20.0, "f32_weight_bytes": 540e6, "threads": 2,
        "read_bandwidth_gbs": 27.0, "decode_weight_bytes": 540e6,
        "ratios": {p: {str(c): v for c, v in by.items()} for p, by in r.items()},
        "engines": [{"engine": e, "peak_rss_mb": 900.0, "runs": [{"summary": s} for s in by.values()]}
                    for e, by in summaries.items()] + [{"engine": "llama.cpp-Q4_1", "error": "worker exited with 1"}],
    }
    text = render_markdown(result)
    assert "| tiergate | 32 | 4 | 300.0 |" in text
    assert "| llama.cpp-F32 | 0.80x | 1.20x |" in text
    assert "0.80x, **not met**" in text and "3.00x, met" in text
    assert "worker exited with 1" in text
    # 540 MB at 27 GB/s: a 20 ms step at best; tiergate's 10 ms TPOT would be twice the floor's speed.
    assert "= 20.0 ms per step, 50.0 tok/s at best" in text
    assert "- tiergate at batch 1: TPOT p50 10.0 ms, 200% of the floor." in text


def test_decode_weight_bytes_count_projections_norms_and_head(tmp_path):
    config = {"hidden_size": 8, "intermediate_size": 16, "vocab_size": 50, "num_attention_heads": 2,
              "num_key_value_heads": 1, "num_hidden_layers": 3}
    (tmp_path / "config.json").write_text(json.dumps(config))
    per_layer = 8 * (8 + 2 * 4) + 8 * 8 + 3 * 8 * 16 + 2 * 8
    assert decode_weight_bytes(tmp_path / "config.json") == 4 * (3 * per_layer + 8 + 50 * 8)


@pytest.mark.bench_peers
def test_llama_cpp_runner_feeds_ascending_sequence_ids_and_counts_exact_tokens(monkeypatch):
    """llama.cpp cuts a batch into one micro-batch per run of consecutive sequence ids: the runner
    must hand out the lowest free id and send tokens in id order, or llama.cpp runs below itself."""
    import llama_cpp

    from bench.common import model_files
    from bench.peers.llama_cpp_runner import LlamaCppRunner

    calls: list[list[int]] = []
    real_decode = llama_cpp.llama_decode

    def recording_decode(ctx, batch):
        calls.append([batch.seq_id[i][0] for i in range(batch.n_tokens)])
        return real_decode(ctx, batch)

    monkeypatch.setattr(llama_cpp, "llama_decode", recording_decode)
    runner = LlamaCppRunner(model_files.bundled_gguf(), "Q4_1", n_threads=1)
    result = runner.run(REQUESTS, concurrency=3)
    _check_timings(result)
    assert all(ids == sorted(ids) for ids in calls)
    # Requests 0-2 take ids 0-2; request 3 joins when request 2 (3 tokens out) frees id 2.
    assert calls[0] == [0] * 7 + [1] * 3 + [2] * 40
    assert any(ids.count(2) == 2 and ids[-2:] == [2, 2] for ids in calls[1:])  # request 3's prompt, on id 2
    assert result.extra["threads_chosen"]


@pytest.mark.bench_peers
def test_llama_cpp_thread_picker_keeps_the_faster_count_per_step_size(monkeypatch):
    import llama_cpp

    from bench.peers.llama_cpp_runner import ThreadPicker

    set_to: list[int] = []
    monkeypatch.setattr(llama_cpp, "llama_set_n_threads", lambda ctx, n, n_batch: set_to.append(n))
    picker = ThreadPicker(ctx=None, max_threads=2, trial_steps=2, period=50)
    seconds = {1: {1: 0.01, 2: 0.05}, 32: {1: 0.30, 2: 0.10}}  # tokens -> threads -> step time
    for _ in range(8):
        for tokens in (1, 32):
            picker.before_step(tokens)
            picker.after_step(seconds[tokens][picker.current])
    assert picker.choices() == {"1": 1, "32": 2}
    assert set(set_to) == {1, 2}
