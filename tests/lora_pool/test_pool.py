"""The pool: registry, host cache LRU, device slot LRU with pinning, prefetch, counters."""

from __future__ import annotations

import threading

import pytest
import torch

from lora_pool import AdapterError, LoraPool, TooManyAdaptersError
from lora_pool.adapter import inspect_adapter, load_adapter


@pytest.fixture
def make_pool(adapter_dir, shapes):
    """make_pool(names, max_loras, max_cpu_loras) -> a pool with adapters a0..aN registered."""
    def make(count: int, max_loras: int = 2, max_cpu_loras: int = 3) -> LoraPool:
        pool = LoraPool(shapes, max_loras=max_loras, max_cpu_loras=max_cpu_loras, max_lora_rank=8)
        for i in range(count):
            pool.register(f"a{i}", adapter_dir(f"a{i}", seed=i, r=2 + i % 3))
        return pool
    return make


def test_base_only_step_has_no_lora_batch(make_pool):
    pool = make_pool(1)
    assert pool.batch_for([(None, 5), (None, 1)]) is None
    assert pool.resident() == {}


def test_slot_holds_the_adapter_zero_padded_with_its_scale(make_pool, shapes):
    pool = make_pool(1)
    pool.batch_for([("a0", 3)])
    slot = pool.resident()["a0"]
    spec = pool.spec("a0")
    weights = load_adapter(inspect_adapter("a0", spec.path, shapes, 8), shapes, torch.float32)
    assert torch.equal(pool.stacks.a["q"][:, slot, : spec.rank], weights.a["q"])
    assert torch.equal(pool.stacks.a["q"][:, slot, spec.rank:], torch.zeros_like(pool.stacks.a["q"][:, slot, spec.rank:]))
    assert torch.equal(pool.stacks.b["v"][:, slot, :, : spec.rank], weights.b["v"])
    assert torch.equal(pool.stacks.a["gate"][:, slot], torch.zeros_like(pool.stacks.a["gate"][:, slot]))  # not a target
    assert pool.stacks.scales[slot].item() == pytest.approx(spec.scale)


def test_least_recently_used_slot_is_evicted(make_pool):
    pool = make_pool(3, max_loras=2)
    pool.batch_for([("a0", 1)])
    pool.batch_for([("a1", 1)])
    pool.batch_for([("a0", 1)])  # a1 is now the least recently used
    pool.batch_for([("a2", 1)])
    assert set(pool.resident()) == {"a0", "a2"}
    assert pool.evictions == 1


def test_adapters_of_the_same_step_never_evict_each_other(make_pool):
    pool = make_pool(3, max_loras=2)
    pool.batch_for([("a0", 1)])
    pool.batch_for([("a1", 1)])
    # a0 is least recent, but the step needs it alongside a2: a1 must be the one to go.
    batch = pool.batch_for([("a2", 2), ("a0", 1)])
    assert set(pool.resident()) == {"a0", "a2"}
    assert set(batch.specs) == {pool.resident()["a2"], pool.resident()["a0"]}


def test_more_distinct_adapters_than_slots_is_refused_without_touching_slots(make_pool):
    pool = make_pool(3, max_loras=2)
    pool.batch_for([("a0", 1)])
    with pytest.raises(TooManyAdaptersError, match="3 distinct adapters but there are 2 slots"):
        pool.batch_for([("a0", 1), ("a1", 1), ("a2", 1)])
    assert pool.resident() == {"a0": 0}


def test_unknown_adapter_in_a_step_is_refused_before_any_slot_changes(make_pool):
    pool = make_pool(1)
    with pytest.raises(AdapterError, match="'ghost' is not registered"):
        pool.batch_for([("a0", 1), ("ghost", 1)])
    assert pool.resident() == {}


def test_host_cache_keeps_the_most_recent_adapters(make_pool, adapter_ready):
    pool = make_pool(4, max_loras=1, max_cpu_loras=2)
    for name in ("a0", "a1", "a2"):
        pool.prefetch(name)
    assert [adapter_ready(pool, n) for n in ("a0", "a1", "a2")] == [False, True, True]
    assert pool.loads == 3


def test_counters_tell_disk_loads_from_cache_hits(make_pool):
    pool = make_pool(2, max_loras=1, max_cpu_loras=2)
    pool.prefetch("a0")                 # disk
    pool.batch_for([("a0", 1)])         # host cache hit -> slot
    pool.batch_for([("a0", 1)])         # slot hit
    pool.batch_for([("a1", 1)])         # cold: disk, evicts a0 from the only slot
    assert (pool.loads, pool.cache_hits, pool.slot_loads, pool.evictions) == (2, 2, 2, 1)


def test_concurrent_prefetches_of_a_cold_adapter_read_it_once(make_pool, adapter_ready):
    pool = make_pool(1)
    threads = [threading.Thread(target=pool.prefetch, args=("a0",)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert pool.loads == 1 and adapter_ready(pool, "a0")


def test_unregister_drops_cached_copies_and_frees_the_slot(make_pool, adapter_ready):
    pool = make_pool(2)
    pool.batch_for([("a0", 1), ("a1", 1)])
    pool.unregister("a0")
    assert pool.list() == ["a1"] and set(pool.resident()) == {"a1"} and not adapter_ready(pool, "a0")
    with pytest.raises(AdapterError, match="not registered"):
        pool.unregister("a0")


def test_registering_a_name_again_serves_the_new_weights(make_pool, adapter_dir):
    pool = make_pool(1)
    pool.batch_for([("a0", 1)])
    old = pool.stacks.a["q"][:, pool.resident()["a0"]].clone()
    pool.register("a0", adapter_dir("replacement", seed=42, r=2))
    pool.batch_for([("a0", 1)])
    assert not torch.equal(pool.stacks.a["q"][:, pool.resident()["a0"]], old)


def test_pool_refuses_a_host_cache_smaller_than_the_slots(shapes):
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LoraPool(shapes, max_loras=4, max_cpu_loras=2, max_lora_rank=8)


def test_step_needing_an_adapter_a_prefetch_is_reading_waits_for_that_read(make_pool, monkeypatch):
    import lora_pool.pool as pool_module

    pool = make_pool(1)
    reading, release = threading.Event(), threading.Event()
    real_load = pool_module.load_adapter

    def slow_load(*args):
        reading.set()
        assert release.wait(10)
        return real_load(*args)

    monkeypatch.setattr(pool_module, "load_adapter", slow_load)
    prefetch = threading.Thread(target=pool.prefetch, args=("a0",))
    prefetch.start()
    assert reading.wait(10)
    step = threading.Thread(target=pool.batch_for, args=([("a0", 1)],))
    step.start()  # holds the pool's lock while it waits for the same read
    release.set()
    prefetch.join(10)
    step.join(10)
    assert not prefetch.is_alive() and not step.is_alive()
    assert pool.loads == 1 and "a0" in pool.resident()


CHUNKS = [("a0", 1), ("a1", 1), (None, 1), ("a2", 9), ("a0", 1)]  # decodes and a prefill chunk


@pytest.fixture
def cpu_kernels():
    from engine.cpu_build import cpu_kernels_loaded

    assert cpu_kernels_loaded(), "the CPU kernels did not build on this machine (see the log)"


def lora_update(pool: LoraPool, x: torch.Tensor) -> torch.Tensor:
    """What the pool's batch of CHUNKS adds to zeros on layer 1's q projection."""
    y = torch.zeros(x.shape[0], pool.shapes.projections["q"][1])
    pool.batch_for(CHUNKS).apply(1, "q", x, y)
    return y


def reference_update(pool: LoraPool, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The same update in float64 from the adapters' weights rounded to ``dtype``."""
    y = torch.zeros(x.shape[0], pool.shapes.projections["q"][1], dtype=torch.float64)
    row = 0
    for name, rows in CHUNKS:
        if name is not None:
            weights = load_adapter(pool.spec(name), pool.shapes, dtype)
            a, b = weights.a["q"][1].double(), weights.b["q"][1].double()
            y[row: row + rows] = x[row: row + rows].double() @ a.T @ b.T * weights.spec.scale
        row += rows
    return y


def test_a_cpu_steps_rows_all_go_to_the_kernel_with_the_torch_paths_result(make_pool, shapes, cpu_kernels,
                                                                            monkeypatch):
    """Once the engine's C++ kernels are loaded, a float32 CPU batch sends every row with an adapter, decodes
    and prefill chunks alike, to lora_rows_; the update equals the torch path's to float32 rounding."""
    from lora_pool import ops

    pool = make_pool(3, max_loras=3)
    batch = pool.batch_for(CHUNKS)
    assert pool.cpu_kernel and batch._cpu_plan.kernel_rows.slots.numel() == 3 and batch._cpu_plan.groups == {}
    x = torch.randn(13, shapes.projections["q"][0])
    y = lora_update(pool, x)
    monkeypatch.setattr(ops, "rows_kernel", lambda: None)
    torch_pool = make_pool(3, max_loras=3)
    assert not torch_pool.cpu_kernel and torch_pool.batch_for(CHUNKS)._cpu_plan.kernel_rows is None
    expected = lora_update(torch_pool, x)
    assert expected[[0, 1, *range(3, 13)]].abs().min() > 0 and torch.equal(y[2], torch.zeros_like(y[2]))
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-6)


def test_bfloat16_stacks_on_the_kernel_add_no_rounding_past_their_weights(adapter_dir, shapes, cpu_kernels):
    """Adapters kept in bfloat16 under float32 activations: the update is the float64 one of the weights
    rounded to bfloat16, which differs from the float32 weights' (so the comparison can fail)."""
    pool = LoraPool(shapes, max_loras=3, max_cpu_loras=3, max_lora_rank=8, stack_dtype=torch.bfloat16)
    for i in range(3):
        pool.register(f"a{i}", adapter_dir(f"a{i}", seed=i, r=2 + i % 3))
    assert pool.stacks.dtype == torch.bfloat16 and pool.cpu_kernel
    x = torch.randn(13, shapes.projections["q"][0])
    y = lora_update(pool, x).double()
    torch.testing.assert_close(y, reference_update(pool, x, torch.bfloat16), rtol=1e-5, atol=1e-5)
    assert (y - reference_update(pool, x, torch.float32)).abs().max() > 1e-4


def test_bfloat16_stacks_are_refused_where_the_kernel_cannot_run_them(shapes, monkeypatch):
    from lora_pool import ops

    with pytest.raises(ValueError, match="CPU LoRA kernel"):  # the kernel takes float32 activations only
        LoraPool(shapes, max_loras=1, max_cpu_loras=1, max_lora_rank=8, dtype=torch.bfloat16,
                 stack_dtype=torch.float32)
    monkeypatch.setattr(ops, "rows_kernel", lambda: None)
    with pytest.raises(ValueError, match="CPU LoRA kernel"):
        LoraPool(shapes, max_loras=1, max_cpu_loras=1, max_lora_rank=8, stack_dtype=torch.bfloat16)


def test_the_pool_reads_the_kernels_read_ahead_level_once_and_a_bad_one_stops_it(make_pool, shapes, cpu_kernels,
                                                                                monkeypatch):
    """TIERGATE_LORA_PREFETCH is read when the pool is made (an engine's start): its steps' plans carry the
    level, and a value that is not a level is refused there, not in a step."""
    from tiergate_common.env import EnvError

    monkeypatch.setenv("TIERGATE_LORA_PREFETCH", "l2")
    pool = make_pool(3, max_loras=3)
    monkeypatch.setenv("TIERGATE_LORA_PREFETCH", "l1")  # read once: the pool made above keeps l2
    assert pool.cpu_prefetch_to == 2 and pool.batch_for(CHUNKS)._cpu_plan.kernel_rows.prefetch_to == 2
    monkeypatch.setenv("TIERGATE_LORA_PREFETCH", "nearby")
    with pytest.raises(EnvError, match="TIERGATE_LORA_PREFETCH"):
        LoraPool(shapes, max_loras=1, max_cpu_loras=1, max_lora_rank=8)
