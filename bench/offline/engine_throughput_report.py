"""The engine throughput bench's section of bench/RESULTS.md: its tables, the bandwidth floor and the goals.

Pure functions of the bench's JSON (bench/offline/engine_throughput.py runs the engines), so the
section can be rendered again from a saved result (`python -m bench.run_all --render-only`).
"""

from __future__ import annotations

from bench.common import report

__all__ = ["GOALS", "render_markdown"]


def _fmt(value: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def render_markdown(result: dict) -> str:
    """The results as markdown tables: one row per engine and concurrency, then the ratios."""
    w = result.get("workload", {})
    lines = [
        report.measured(result),
        "" if result.get("complete", True) else "\n**Partial run: the engines missing below did not finish.**\n",
        f"Workload: {w.get('requests')} requests (seed {w.get('seed')}), prompts {w.get('prompt_len')} tokens, "
        f"outputs {w.get('output_len')} tokens, greedy, EOS ignored; concurrency 1 runs the first "
        f"{w.get('single_stream_requests')} requests; {result.get('threads')} threads for each peer, and tiergate "
        "picks 1 or more up to that by timing its own steps, as `tiergate serve` does. tiergate: the weights in "
        "float32 (`--dtype float32`; `tiergate serve` keeps a GGUF in its own blocks, compared with llama.cpp "
        "on the same files in the quantized serving section), fcfs policy, "
        "prefix cache off (levels replay the same prompts), KV pool sized like llama.cpp's n_ctx. "
        "HF: float32 `generate`, static left-padded batches of the concurrency level, each request credited only "
        "its own tokens. llama.cpp: F32 GGUF of the same weights (Q4_1 for reference), driven as llama-server's "
        "slots are at every level: `llama_decode` with one sequence and KV stream per slot, lowest free id first, "
        "tokens in ascending id order, continuous joining, and 1 or more threads per step size picked by timing "
        "its steps (bench/peers/llama_cpp_runner.py). tiergate-plain: tiergate with TIERGATE_PACKED_WEIGHTS=0, "
        "TIERGATE_PAGED_ATTENTION=off and TIERGATE_FUSED_NORMS=0 (projections on torch.mm, attention through "
        "SDPA with decodes over a gathered copy, norms, rope and the SiLU gate as torch ops: the engine before "
        "issue 16); "
        "tiergate-onednn: tiergate with its projections packed for oneDNN instead of its own panel kernel.",
        "",
        "| engine | concurrency | requests | output tok/s | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) | peak RSS (MB) | KV peak use | KV waste |",
        "|---|---:|---:|---:|---|---|---:|---:|---:|",
    ]
    for w in result["engines"]:
        if "error" in w:
            lines.append(f"| {w['engine']} | - | - | {w['error']} | | | | | |")
            continue
        for run in w["runs"]:
            s = run["summary"]
            kv_use = f"{s['kv_blocks_peak']}/{s['kv_blocks_total']}" if "kv_blocks_peak" in s else "-"
            kv_waste = f"{s['kv_waste']:.1%}" if s.get("kv_waste") is not None else "-"
            lines.append(
                f"| {w['engine']} | {s['concurrency']} | {s['requests']} | {s['output_tokens_per_s']:.1f} "
                f"| {_fmt(s['ttft_p50_s'], digits=2)} / {_fmt(s['ttft_p99_s'], digits=2)} "
                f"| {_fmt(s['tpot_p50_s'], 1e3)} / {_fmt(s['tpot_p99_s'], 1e3)} "
                f"| {w['peak_rss_mb']:.0f} | {kv_use} | {kv_waste} |"
            )
    concurrencies = result["concurrency"]
    lines += ["", "tiergate output tokens/s over each peer's:", "",
              "| peer | " + " | ".join(f"c={c}" for c in concurrencies) + " |",
              "|---|" + "---:|" * len(concurrencies)]
    for peer, by_c in result["ratios"].items():
        lines.append(f"| {peer} | " + " | ".join(
            f"{by_c[str(c)]:.2f}x" if str(c) in by_c else "-" for c in concurrencies) + " |")
    lines += ["", *_goal_lines(result)]
    cost = result.get("step_cost")
    if cost:
        lines += ["", f"Step-time cost model fitted to {cost['steps']} tiergate steps (R² {cost['r2']:.3f}): "
                      f"{cost['base_s'] * 1e3:.2f} ms + {cost['per_prefill_token_s'] * 1e6:.1f} µs/prefill token "
                      f"+ {cost['per_decode_seq_s'] * 1e3:.2f} ms/decode row "
                      f"+ {cost['per_context_token_s'] * 1e9:.1f} ns/context token."]
    return "\n".join(lines) + "\n"


GOALS = (  # (concurrency, peer, least ratio) from the engine issue (16)
    (1, "llama.cpp-F32", 1.0),
    (32, "llama.cpp-F32", 1.5),
    (32, "tiergate-plain", 2.5),
    (32, "hf-transformers", 2.0),
)


def _floor_lines(result: dict) -> list[str]:
    """The best batch-1 decode step memory allows, and how close each engine's single stream came."""
    if "read_bandwidth_gbs" not in result:  # runs from before the read-bandwidth measure
        floor = result["copy_bandwidth_gbs"] * 1e9 / result["f32_weight_bytes"]
        return [f"Memory-bandwidth floor of single-stream float32 decode: {result['f32_weight_bytes'] / 1e6:.0f} MB "
                f"of weights read per token at {result['copy_bandwidth_gbs']:.1f} GB/s (copy bandwidth) = "
                f"{floor:.1f} tok/s.", ""]
    floor_s = result["decode_weight_bytes"] / (result["read_bandwidth_gbs"] * 1e9)
    lines = [f"Memory-bandwidth floor of a batch-1 float32 decode step: {result['decode_weight_bytes'] / 1e6:.0f} MB of "
             f"weights read per step at {result['read_bandwidth_gbs']:.1f} GB/s (read bandwidth measured in this run, "
             f"{result['threads']} threads; copy bandwidth {result['copy_bandwidth_gbs']:.1f} GB/s) = "
             f"{floor_s * 1e3:.1f} ms per step, {1 / floor_s:.1f} tok/s at best."]
    for w in result["engines"]:
        single = next((r["summary"] for r in w.get("runs", []) if r["summary"]["concurrency"] == 1), None)
        if single and single.get("tpot_p50_s"):
            lines.append(f"- {w['engine']} at batch 1: TPOT p50 {single['tpot_p50_s'] * 1e3:.1f} ms, "
                         f"{floor_s / single['tpot_p50_s']:.0%} of the floor.")
    return lines + [""]


def _goal_lines(result: dict) -> list[str]:
    lines = _floor_lines(result)
    rounds = result.get("single_stream_rounds")
    if rounds and rounds["ratios"]:
        lines.append(f"- single-stream rounds, tiergate over llama.cpp-F32, alternating which runs first: "
                     f"{', '.join(f'{r:.2f}x' for r in rounds['ratios'])}; median {rounds['median']:.2f}x "
                     "(the c=1 goal below reads the median).")
    for c, peer, least in GOALS:
        ratio = result["ratios"].get(peer, {}).get(str(c))
        if c == 1 and peer == "llama.cpp-F32" and rounds and rounds["median"] is not None:
            ratio = rounds["median"]
        if ratio is None:
            lines.append(f"- goal at c={c}: at least {least}x {peer}: not measured in this run.")
        else:
            verdict = "met" if ratio >= least else "**not met**"
            lines.append(f"- goal at c={c}: at least {least}x {peer}: {ratio:.2f}x, {verdict}.")
    return lines
