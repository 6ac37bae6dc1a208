"""The prompt-scoring bench compares like work: tiergate's and HF's summed prompt logprobs agree, and its
report names each engine's rounds and ratio."""

from __future__ import annotations

import random

import pytest

from bench.offline import prompt_scoring


def test_tiergate_and_hf_give_each_prompt_the_same_summed_logprob(tiny_llama_dir):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 128) for _ in range(n)] for n in (5, 40, 17)]
    _, ours = prompt_scoring.run_tiergate(prompts, model=str(tiny_llama_dir))
    _, hf = prompt_scoring.run_hf(prompts, threads=1, model_dir=tiny_llama_dir)
    assert ours == pytest.approx(hf, abs=1e-4)
    assert all(s < 0 for s in ours)


def test_tiergate_scores_with_the_float32_weights_its_peers_read(monkeypatch):
    """HF and llama.cpp-F32 score with the bundled file's weights in float32; tiergate keeps a GGUF in
    its own blocks when no dtype is asked, which would compare (and check) other numbers."""
    import engine.engine

    class Built(Exception):
        pass

    def engine_of(config):
        assert config.dtype == "float32"
        raise Built

    monkeypatch.setattr(engine.engine, "Engine", engine_of)
    with pytest.raises(Built):
        prompt_scoring.run_tiergate([[5, 6, 7]])


def test_the_report_gives_each_engine_its_median_round_and_the_ratio_to_it(monkeypatch):
    speeds = {"tiergate": iter([300.0, 100.0, 200.0]), "hf-transformers": iter([100.0, 150.0, 50.0])}

    def fake_worker(engine: str, args) -> dict:
        return {"engine": engine, "tokens_per_s": next(speeds[engine]), "prompt_sums": [-1.0, -2.0],
                "peak_rss_mb": 10.0}

    monkeypatch.setattr(prompt_scoring, "_worker", fake_worker)
    monkeypatch.setattr(prompt_scoring.machine, "describe", lambda: {})
    monkeypatch.setattr(prompt_scoring.machine, "render_markdown", lambda _: "a machine")
    args = prompt_scoring.argparse.Namespace(engines="tiergate,hf-transformers", rounds=3, prompts=2,
                                             prompt_len="8,16", threads=1)
    result = prompt_scoring.run(args)
    assert result["engines"]["tiergate"]["tokens_per_s"] == 200.0
    assert result["engines"]["hf-transformers"]["tokens_per_s"] == 100.0
    assert result["engines"]["hf-transformers"]["ratio"] == 2.0
    table = prompt_scoring.render_markdown(result)
    assert "| hf-transformers | 100 | 100, 150, 50 | 2.00x |" in table
