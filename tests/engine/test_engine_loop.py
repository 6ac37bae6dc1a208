"""The engine front and step loop: continuous batching, preemption, prefix cache, aborts, failures.

Every generation is checked against HF transformers' own greedy `generate` on
the same weights, one request at a time.
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.events import FinishEvent, StepEvent
from engine.request import EngineRequest, SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 300) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def _wait_idle(engine: Engine, timeout: float = 5.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not engine.scheduler.has_unfinished() and engine.scheduler.num_used_blocks == 0:
            return
        time.sleep(0.01)
    raise AssertionError("engine still holds sequences or blocks")


def test_requests_joining_and_leaving_each_get_their_own_greedy_tokens(make_engine, hf_greedy):
    engine, events = make_engine()
    prompts = _prompts(8)
    max_tokens = [30 - 3 * i for i in range(8)]

    async def main():
        # Request i arrives once request i - 1 has its first token, so it joins a running batch
        # however fast the steps are; the earlier requests run longer, so they are still there.
        started = [asyncio.Event() for _ in range(8)]

        async def run_one(i: int) -> list[int]:
            if i:
                await started[i - 1].wait()
            ids: list[int] = []
            request = EngineRequest(f"r{i}", prompts[i], SamplingParams(max_tokens=max_tokens[i], **GREEDY))
            async for delta in engine.generate(request):
                ids.extend(delta.token_ids)
                started[i].set()
            return ids

        return await asyncio.gather(*(run_one(i) for i in range(8)))

    outputs = asyncio.run(main())
    for i, ids in enumerate(outputs):
        assert ids == hf_greedy(prompts[i], max_tokens[i]), f"request {i}"
    steps = [e for e in events if isinstance(e, StepEvent)]
    assert any(len({it.request_id for it in s.items}) > 1 for s in steps), "never batched"
    assert any(it.tokens > 1 for s in steps for it in s.items), "never prefilled in chunks"
    _wait_idle(engine)


def test_preempted_requests_resume_with_identical_output(make_engine, hf_greedy):
    # 24 blocks of 4 tokens cannot hold eight 40-token sequences: preemption must happen.
    engine, events = make_engine(num_kv_blocks=24, policy="fcfs")
    prompts = _prompts(8, seed=1, lo=20, hi=30)
    requests = [EngineRequest(f"p{i}", p, SamplingParams(max_tokens=16, **GREEDY)) for i, p in enumerate(prompts)]
    outputs = engine.generate_batch_sync(requests)
    for prompt, (_, ids) in zip(prompts, outputs):
        assert ids == hf_greedy(prompt, 16)
    assert any(e.preempted for e in events if isinstance(e, StepEvent))
    assert any(it.is_recompute for e in events if isinstance(e, StepEvent) for it in e.items)
    _wait_idle(engine)


def test_a_shared_prefix_is_served_from_the_cache(make_engine, hf_greedy):
    engine, _ = make_engine()
    prefix = _prompts(1, seed=2, lo=33, hi=34)[0]
    first = prefix + [7, 8, 9]
    second = prefix + [10, 11]
    engine.generate_batch_sync([EngineRequest("a", first, SamplingParams(max_tokens=4, **GREEDY))])

    async def run():
        deltas = [d async for d in engine.generate(EngineRequest("b", second, SamplingParams(max_tokens=6, **GREEDY)))]
        return deltas

    deltas = asyncio.run(run())
    assert deltas[-1].usage.cached_tokens >= 32  # eight full blocks of the shared prefix
    assert [t for d in deltas for t in d.token_ids] == hf_greedy(second, 6)


def test_abort_frees_the_requests_blocks_within_a_step(make_engine):
    engine, events = make_engine()

    async def run():
        request = EngineRequest("long", _prompts(1, seed=3)[0], SamplingParams(max_tokens=200, **GREEDY))
        stream = engine.submit(request)
        async for delta in stream:
            if delta.token_ids:
                break
        await stream.aclose()

    asyncio.run(run())
    _wait_idle(engine, timeout=2.0)
    finish = [e for e in events if isinstance(e, FinishEvent)][-1]
    assert finish.status == "cancelled" and finish.completion_tokens >= 1


def test_a_failing_step_fails_its_requests_and_the_loop_keeps_serving(make_engine, hf_greedy, monkeypatch):
    engine, events = make_engine()
    real_execute = engine.runner.execute_with_hidden
    calls = {"n": 0}

    def flaky_execute(plan, *args):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected kernel failure")
        return real_execute(plan, *args)

    monkeypatch.setattr(engine.runner, "execute_with_hidden", flaky_execute)
    collector_prompt = _prompts(1, seed=4)[0]
    with pytest.raises(Exception, match="injected kernel failure"):
        engine.generate_batch_sync([EngineRequest("doomed", collector_prompt, SamplingParams(max_tokens=4, **GREEDY))])
    assert [e.status for e in events if isinstance(e, FinishEvent)] == ["error"]
    _wait_idle(engine)
    (_, ids), = engine.generate_batch_sync([EngineRequest("fine", collector_prompt, SamplingParams(max_tokens=4, **GREEDY))])
    assert ids == hf_greedy(collector_prompt, 4)


def test_a_seed_gives_the_same_tokens_alone_and_in_a_busy_batch(make_engine):
    engine, _ = make_engine()
    prompt = _prompts(1, seed=5)[0]
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=42, ignore_eos=True)
    (_, alone), = engine.generate_batch_sync([EngineRequest("alone", prompt, seeded)])
    others = [
        EngineRequest(f"o{i}", p, SamplingParams(max_tokens=12, temperature=0.9, ignore_eos=True))
        for i, p in enumerate(_prompts(5, seed=6))
    ]
    outputs = engine.generate_batch_sync(others[:2] + [EngineRequest("busy", prompt, seeded)] + others[2:])
    assert outputs[2][1] == alone


def test_stop_tokens_stop_strings_and_max_tokens_set_the_finish_reason(make_engine, hf_greedy):
    engine, _ = make_engine()
    prompt = _prompts(1, seed=7)[0]
    reference = hf_greedy(prompt, 10)

    async def final(params: SamplingParams):
        deltas = [d async for d in engine.generate(EngineRequest(f"s{random.random()}", prompt, params))]
        return "".join(d.text for d in deltas), deltas[-1]

    text, last = asyncio.run(final(SamplingParams(max_tokens=10, **GREEDY)))
    assert last.finish_reason == "length" and last.usage.completion_tokens == 10

    _, last = asyncio.run(final(SamplingParams(max_tokens=10, stop_token_ids=(reference[3],), **GREEDY)))
    assert last.finish_reason == "stop" and last.usage.completion_tokens == reference.index(reference[3]) + 1

    stop_word = engine.tokenizer.decode([reference[4]])
    cut, last = asyncio.run(final(SamplingParams(max_tokens=10, stop=(stop_word,), **GREEDY)))
    assert last.finish_reason == "stop" and stop_word not in cut and text.startswith(cut)


def test_step_events_account_for_every_computed_token_and_all_busy_time(make_engine):
    engine, events = make_engine()
    prompts = _prompts(5, seed=8)
    engine.generate_batch_sync(
        [EngineRequest(f"m{i}", p, SamplingParams(max_tokens=6, **GREEDY)) for i, p in enumerate(prompts)]
    )
    steps = [e for e in events if isinstance(e, StepEvent)]
    computed = sum(it.tokens for s in steps for it in s.items)
    # Each request computes its prompt and all but its last sampled token.
    assert computed == sum(len(p) + 6 - 1 for p in prompts)
    assert sum(s.duration_s for s in steps) == pytest.approx(engine.busy_seconds)


@pytest.mark.parametrize(
    "request_kwargs, message",
    [
        (dict(prompt_token_ids=[]), "empty"),
        (dict(prompt_token_ids=[5] * 500, params=SamplingParams(max_tokens=100)), "context length"),
        (dict(prompt_token_ids=[5, 10_000]), "token ids"),
        (dict(prompt_token_ids=[5], tier="gold"), "unknown tier"),
        (dict(prompt_token_ids=[5], params=SamplingParams(max_tokens=0)), "max_tokens"),
        (dict(prompt_token_ids=[5], params=SamplingParams(top_p=0)), "top_p"),
    ],
)
def test_bad_requests_are_refused_before_they_reach_the_scheduler(make_engine, request_kwargs, message):
    engine, _ = make_engine()
    with pytest.raises(ValueError, match=message):
        engine.generate_batch_sync([EngineRequest("bad", **request_kwargs)])
    assert not engine.scheduler.has_unfinished() and engine.scheduler.num_used_blocks == 0


def test_the_bundled_model_answers_a_chat_question(bundled_model, engine_cache_dir):
    # The file's exact weights (float32). Served in its own Q4_1 with int8 activations, this question's
    # greedy answer goes astray ("L'Etoile, la ...") in tiergate and in llama.cpp on the same file alike;
    # the native path's quality is pinned by tests/engine/test_gguf_native_quality.py.
    engine = Engine(EngineConfig(model="bundled", dtype="float32", max_loras=0,
                                 cache_dir=str(engine_cache_dir))).start()
    try:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
        (text, _), = engine.generate_batch_sync([EngineRequest("q", prompt, SamplingParams(max_tokens=24, temperature=0))])
    finally:
        engine.shutdown()
    assert "Paris" in text


def test_a_request_larger_than_its_tiers_share_of_the_pool_is_refused_at_admission(make_engine):
    # 64 blocks of 4 tokens: standard may hold 70% of them, about 180 tokens.
    engine, _ = make_engine(num_kv_blocks=64)
    with pytest.raises(ValueError, match="KV cache"):
        engine.generate_batch_sync([EngineRequest("huge", [5] * 100, SamplingParams(max_tokens=150), tier="standard")])
    (_, ids), = engine.generate_batch_sync(
        [EngineRequest("fits", [5] * 100, SamplingParams(max_tokens=150, ignore_eos=True), tier="premium")]
    )
    assert len(ids) == 150 and engine.is_running


def test_a_request_id_already_in_flight_is_refused_and_the_first_keeps_running(make_engine):
    engine, _ = make_engine()
    params = SamplingParams(max_tokens=30, **GREEDY)

    async def run():
        first = engine.submit(EngineRequest("same", [5, 6, 7], params))
        second = engine.submit(EngineRequest("same", [8, 9], params))
        second_deltas = [d async for d in second]
        first_deltas = [d async for d in first]
        return first_deltas, second_deltas

    first, second = asyncio.run(run())
    assert "already in flight" in second[-1].error
    assert sum(len(d.token_ids) for d in first) == 30 and first[-1].finish_reason == "length"


def test_tenants_reach_the_scheduler_and_finish_events_report_queue_time(make_engine):
    engine, events = make_engine(max_num_seqs=1)
    requests = [EngineRequest(f"t{i}", _prompts(1, seed=i)[0], SamplingParams(max_tokens=6, **GREEDY),
                              tenant=tenant, tenant_weight=2.0) for i, tenant in enumerate(["a", "b"])]
    engine.generate_batch_sync(requests)
    finished = {e.request_id: e for e in events if isinstance(e, FinishEvent)}
    # One slot: the second request waited for the whole of the first.
    assert finished["t1"].queue_s > finished["t0"].queue_s >= 0
    assert engine.scheduler.policy.fair.counter(_seq_of("b", 2.0)) > 0


def test_a_bad_tenant_weight_is_refused_before_the_scheduler(make_engine):
    engine, _ = make_engine()
    with pytest.raises(ValueError, match="weight"):
        engine.generate_batch_sync([EngineRequest("w", [5, 6, 7], SamplingParams(max_tokens=2), tenant="a",
                                                  tenant_weight=0.0)])


def _seq_of(tenant: str, weight: float):
    from scheduler.sequence import Sequence

    return Sequence("probe", [1], tenant=tenant, weight=weight)


def _run_together(engine: Engine, requests: list[EngineRequest]) -> dict[str, list]:
    """Submit all requests at once (so they share steps) and collect each one's deltas."""

    async def run():
        streams = [engine.submit(r) for r in requests]

        async def collect(stream):
            return [d async for d in stream]

        return await asyncio.gather(*(collect(s) for s in streams))

    return {r.request_id: deltas for r, deltas in zip(requests, asyncio.run(run()))}


def test_temperature_and_top_p_that_underflow_float32_sample_without_failing_the_batch(make_engine, hf_greedy):
    engine, events = make_engine()
    prompts = _prompts(4, seed=9)
    hostile = [SamplingParams(max_tokens=6, temperature=1e-300, ignore_eos=True),
               SamplingParams(max_tokens=6, temperature=1e-46, ignore_eos=True),
               SamplingParams(max_tokens=6, temperature=1.0, top_p=1e-46, seed=1, ignore_eos=True)]
    requests = [EngineRequest(f"h{i}", prompts[i], p) for i, p in enumerate(hostile)]
    requests.append(EngineRequest("bystander", prompts[3], SamplingParams(max_tokens=6, **GREEDY)))
    out = _run_together(engine, requests)
    for request_id, deltas in out.items():
        assert deltas[-1].error is None and deltas[-1].finish_reason == "length", request_id
    # A vanishing temperature is greedy, a vanishing top_p keeps only the most likely token: greedy too.
    for i in range(3):
        assert [t for d in out[f"h{i}"] for t in d.token_ids] == hf_greedy(prompts[i], 6)
    assert {e.status for e in events if isinstance(e, FinishEvent)} == {"ok"}
    _wait_idle(engine)


@pytest.mark.parametrize("where", ["sampling", "detokenizing"])
def test_a_failure_in_one_requests_sampling_or_detokenizing_ends_that_request_alone(
        make_engine, hf_greedy, monkeypatch, where):
    import engine.request_state as request_state_module
    import engine.sampler as sampler_module

    engine, events = make_engine()
    prompts = _prompts(4, seed=10, hi=12)  # short: all four prefill in the same step
    victim_prompt = prompts[0]
    if where == "sampling":
        real_filter = sampler_module.filtered_probs

        def filtered_probs(row_logits, params):
            if params.seed == 666:
                raise RuntimeError("injected sampling failure")
            return real_filter(row_logits, params)

        monkeypatch.setattr(sampler_module, "filtered_probs", filtered_probs)
    else:
        class ExplodingDetokenizer(request_state_module.IncrementalDetokenizer):
            def __init__(self, tokenizer, prompt_token_ids, stop=()):
                super().__init__(tokenizer, prompt_token_ids, stop)
                self.poisoned = list(prompt_token_ids) == victim_prompt

            def add_token(self, token_id, may_stop=True):
                if self.poisoned:
                    raise RuntimeError("injected detokenizer failure")
                return super().add_token(token_id, may_stop)

        monkeypatch.setattr(request_state_module, "IncrementalDetokenizer", ExplodingDetokenizer)

    requests = [EngineRequest("victim", victim_prompt,
                              SamplingParams(max_tokens=6, temperature=0.8, seed=666, ignore_eos=True))]
    requests += [EngineRequest(f"n{i}", prompts[i], SamplingParams(max_tokens=6, **GREEDY)) for i in (1, 2)]
    requests.append(EngineRequest("n3", prompts[3], SamplingParams(max_tokens=6, temperature=0.8, seed=3,
                                                                   ignore_eos=True)))
    out = _run_together(engine, requests)

    assert out["victim"][-1].finish_reason == "error" and "injected" in out["victim"][-1].error
    for i in (1, 2):
        assert [t for d in out[f"n{i}"] for t in d.token_ids] == hf_greedy(prompts[i], 6)
    assert out["n3"][-1].finish_reason == "length" and out["n3"][-1].error is None
    statuses = {e.request_id: e.status for e in events if isinstance(e, FinishEvent)}
    assert statuses == {"victim": "error", "n1": "ok", "n2": "ok", "n3": "ok"}
    steps = [e for e in events if isinstance(e, StepEvent)]
    assert any({"victim", "n1", "n2", "n3"} <= {it.request_id for it in s.items} for s in steps), "never batched"
    _wait_idle(engine)
    assert engine.is_running
