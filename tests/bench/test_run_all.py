"""run_all renders each bench's section from its JSON, or from its printed output when it has no renderer."""

from __future__ import annotations

import importlib.util

from bench import run_all


def test_a_bench_with_a_renderer_gets_its_tables_and_plots():
    bench = run_all.Bench("slo_sweep", "live.slo", "SLO sweep")
    result = {"settings": {"requests": 2, "premium_share": 0.5, "max_prompt": 20, "max_output": 16,
                           "premium_ttft_slo": 0.5, "standard_ttft_slo": 5.0},
              "policies": {"tiered": [{"offered": 1.0, "preemptions": {}, "tiers": {"premium": {
                  "ok": 1, "requests": 1, "rejected_429": {}, "ttft_s": {"p50": 0.2, "p99": 0.3},
                  "tpot_s": {"p50": 0.05}, "inter_token_s": {"p99": 0.08}, "e2e_s": {"p99": 1.0},
                  "goodput_fraction": 1.0}}}]},
              "plots": ["bench/out/slo_sweep/slo_sweep_latency.png"]}
    text = run_all.render_section(bench, {"command": "python -m bench.live.slo", "status": 0, "wall_s": 12.0,
                                          "stdout": "", "result": result})
    assert text.startswith("## SLO sweep")
    assert "| tiered | 1 | premium | 1 / 1 | - | 0.20 / 0.30 | 50.00 | 80.00 | 1.00 | 100% | 0 |" in text
    assert "![slo_sweep_latency](out/slo_sweep/slo_sweep_latency.png)" in text


def test_a_failed_bench_without_a_renderer_shows_its_output_and_status():
    bench = run_all.Bench("report_speed", "offline.report_speed", "Report speed", json_flag="")
    text = run_all.render_section(bench, {"command": "x", "status": "timeout", "wall_s": 900.0,
                                          "stdout": "line one\nline two\n", "result": None})
    assert "**status timeout**" in text
    assert "line two" in text


def test_a_run_replaces_its_own_sections_and_keeps_the_sections_written_by_hand():
    old = ("# Benchmark results\n\nMachine: old.\n## Gateway overhead\n\nold numbers\n"
           "## Quantized GGUF serving (by hand, 2026-11-25)\n\nkept numbers\n## SLO sweep\n\nold sweep\n")
    merged = run_all.merge_results(old, "# Benchmark results\n\nMachine: new.\n",
                                   ["## SLO sweep\n\nnew sweep\n", "## Batch tier\n\nnew bench\n"])
    assert merged.startswith("# Benchmark results\n\nMachine: new.\n")
    assert "old sweep" not in merged and "Machine: old." not in merged
    assert merged.index("## Gateway overhead\n\nold numbers") < merged.index("kept numbers") \
        < merged.index("new sweep") < merged.index("new bench")


def test_every_bench_run_all_runs_names_a_module_of_this_checkout():
    missing = [b.module_name for b in run_all.benches() if importlib.util.find_spec(b.module_name) is None]
    assert missing == []
