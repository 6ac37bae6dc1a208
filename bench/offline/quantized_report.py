"""The quantized-serving bench's arithmetic and report: bytes a decode step reads, bandwidth floors,
the all-streams decode window, tiergate/llama.cpp ratios against the issue's goals, markdown.

Pure functions of the bench's JSON (bench/offline/quantized.py runs the engines), so the report can be
re-rendered and tested without running anything.
"""

from __future__ import annotations

import statistics
from collections import Counter
from pathlib import Path

from bench.common import machine

# (metric, least tiergate/llama.cpp ratio) from issue 30's "Must show".
GOALS = (("single", 1.2), ("streams_decode", 1.5), ("streams_e2e", 1.5), ("pp512", 1.0))
METRIC_NAMES = {"single": "single-stream decode", "streams_decode": "32-stream decode (all streams running)",
                "streams_e2e": "32 streams end to end", "pp512": "prefill pp512"}


def gguf_weight_summary(path: Path) -> dict:
    """A GGUF's tensor bytes by type and the bytes one decode step reads: every tensor once, except an
    untied token embedding, of which a step reads one row per token (a tied one is the LM head too)."""
    import gguf

    reader = gguf.GGUFReader(path)
    by_type: Counter[str] = Counter()
    names = {}
    for tensor in reader.tensors:
        by_type[tensor.tensor_type.name] += int(tensor.n_bytes)
        names[tensor.name] = int(tensor.n_bytes)
    total = sum(by_type.values())
    tied = "output.weight" not in names
    per_step = total if tied else total - names.get("token_embd.weight", 0)
    return {"file_bytes": path.stat().st_size, "tensor_bytes": total, "bytes_per_step": per_step,
            "tied_embedding": tied, "bytes_by_type": dict(by_type.most_common())}


def floor_tokens_per_s(bytes_per_step: int, bandwidth_gbs: float, rows: int = 1) -> float:
    """The most tokens/s a step of ``rows`` tokens allows if it only had to read its weights once."""
    return rows * bandwidth_gbs * 1e9 / bytes_per_step


def decode_window(token_times: dict[int, list[float]]) -> dict | None:
    """Tokens/s while every stream decodes: from the moment the last stream got its first token to
    the moment the first stream got its last; None when that window is empty."""
    runs = [times for times in token_times.values() if times]
    if not runs:
        return None
    start, end = max(t[0] for t in runs), min(t[-1] for t in runs)
    if end <= start:
        return None
    tokens = sum(1 for times in runs for t in times if start < t <= end)
    return {"start_s": start, "end_s": end, "tokens": tokens, "tokens_per_s": tokens / (end - start)}


def engine_summary(rounds: list[dict]) -> dict:
    """One engine on one file over its rounds: the median round of each metric measured in more than
    one round (single stream, pp512), the streams of the round that ran them, the peak RSS of all."""
    ok = [r for r in rounds if "error" not in r]
    if not ok:
        return {"error": rounds[0]["error"] if rounds else "no round ran"}
    out: dict = {"rounds": len(ok)}
    for metric in ("single", "pp512"):
        values = [r[metric]["tokens_per_s"] for r in ok if metric in r]
        if values:
            out[metric] = statistics.median(values)
            out[f"{metric}_rounds"] = values
    streams = next((r["streams"] for r in ok if "streams" in r), None)
    if streams is not None:
        out["streams_e2e"] = streams["e2e_tokens_per_s"]
        if streams.get("decode"):
            out["streams_decode"] = streams["decode"]["tokens_per_s"]
    out["peak_rss_mb"] = max(r["peak_rss_mb"] for r in ok)
    out["load_s"] = statistics.median(r["load_s"] for r in ok)
    return out


def ratios(summaries: dict[str, dict]) -> dict[str, float]:
    """tiergate over llama.cpp for every metric both measured."""
    ours, peer = summaries.get("tiergate", {}), summaries.get("llama.cpp", {})
    return {m: ours[m] / peer[m] for m, _ in GOALS if ours.get(m) and peer.get(m)}


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _fraction(value: float | None, floor: float) -> str:
    return "" if value is None else f" ({value / floor:.0%})"


def _weights_line(file: dict) -> str:
    w = file["weights"]
    types = ", ".join(f"{t} {b / 1e6:.0f} MB" for t, b in w["bytes_by_type"].items())
    return (f"**{file['label']}** ({w['file_bytes'] / 1e6:.0f} MB file; tensors: {types}): "
            f"{w['bytes_per_step'] / 1e6:.0f} MB read per decode step"
            + (" (tied embedding read as the LM head)" if w["tied_embedding"] else "") + ".")


def _engine_details(name: str, rounds: list[dict]) -> list[str]:
    first = next((r for r in rounds if "error" not in r), None)
    if first is None:
        return [f"- {name}: **failed**: {rounds[0].get('error') if rounds else 'no round ran'}"]
    ok = [r for r in rounds if "error" not in r]
    each = {m: ", ".join(f"{r[m]['tokens_per_s']:.1f}" for r in ok if m in r) for m in ("single", "pp512")}
    loads = ", ".join(f"{r['load_s']:.1f}" for r in ok)
    lines = [f"- {name} rounds in order: single stream {each['single']} tok/s; pp512 {each['pp512']} tok/s; "
             f"load {loads} s."]
    if "weights" in first:
        forms = ", ".join(f"{label} x{n}" for label, n in first["weights"]["forms"].items()) or "none packed"
        lines.append(f"- tiergate served: {forms}; weights resident {first['weights']['bytes'] / 1e6:.0f} MB "
                     f"({', '.join(f'{d} {b / 1e6:.0f} MB' for d, b in first['weights']['by_kind'].items())}).")
    kv = first.get("streams", {}).get("kv")
    if kv:
        lines.append(f"- {name} KV pool at the streams' peak: {kv}.")
    if first.get("buffers"):
        lines.append(f"- llama.cpp buffers: {'; '.join(first['buffers'])}.")
    bench = first.get("llama_bench")
    if bench:
        lines.append(f"- llama.cpp check through its own API as llama-bench runs it ({bench['settings']}): "
                     f"pp512 {bench['pp512']:.1f} tok/s, tg128 {bench['tg128']:.1f} tok/s.")
    return lines


def render_markdown(result: dict) -> str:
    bw = result["bandwidth_gbs"]
    s = result["settings"]
    n = s["streams"]
    lines = [
        f"Measured {machine.render_markdown(result['machine'])}; tiergate at commit {result.get('commit')}.", "",
        "" if result.get("complete", True) else "**Partial run: the files missing below did not finish.**\n",
        f"Each engine on each file in its own subprocess, {result['threads']} threads each "
        f"({'pinned' if s['pin_threads'] else 'picked 1..N per step size by timing'}). Single stream: a "
        f"{s['single_prompt']}-token prompt, {s['tokens']} tokens greedy, decode tokens/s after the first token; "
        f"{s['streams']} streams: {s['stream_prompt']}-token prompts of real text, {s['stream_tokens']} tokens "
        "each, all submitted at once, decode tokens/s from the last stream's first token to the first stream's "
        "last (all streams running) and output tokens/s end to end; pp512: one 512-token prompt's time to first "
        f"token. Single stream and pp512: each engine's median of {s['rounds']} round(s), engines alternating "
        "which goes first; "
        "streams: round 1. tiergate: the engine as the loader serves the file (its weight forms below); "
        "llama.cpp: llama-cpp-python's `llama_decode` driven as llama-server's slots (bench/peers/"
        "llama_cpp_runner.py), n_batch = n_ubatch = 512, its default flash attention and F16 KV cache.",
        "",
        f"Bandwidth floor: the bytes a decode step reads / the read bandwidth measured here on "
        f"{result['threads']} threads ({bw['start']:.1f} GB/s at the start, {bw['end'] or 0:.1f} GB/s at the end; "
        "the floor uses the higher); the % after a figure is the fraction of that floor reached (for the "
        f"streams and pp512 the floor counts the weights read once per step of {n} or 512 tokens).",
        "",
        f"| file | engine | single tok/s | {n}-stream decode tok/s | {n} streams e2e tok/s | pp512 tok/s "
        "| peak RSS MB | load s |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    details: list[str] = []
    ratio_rows = []
    bandwidth = max(bw["start"], bw["end"] or 0.0)
    for file in result["files"]:
        per_step = file["weights"]["bytes_per_step"]
        floors = {m: floor_tokens_per_s(per_step, bandwidth, rows)
                  for m, rows in (("single", 1), ("streams_decode", n), ("pp512", 512))}
        summaries = {}
        for engine, rounds in file["engines"].items():
            summary = engine_summary(rounds)
            summaries[engine] = summary
            if "error" in summary:
                lines.append(f"| {file['label']} | {engine} | failed: {summary['error']} | | | | | |")
                continue
            lines.append(
                f"| {file['label']} | {engine} "
                f"| {_fmt(summary.get('single'))}{_fraction(summary.get('single'), floors['single'])} "
                f"| {_fmt(summary.get('streams_decode'))}"
                f"{_fraction(summary.get('streams_decode'), floors['streams_decode'])} "
                f"| {_fmt(summary.get('streams_e2e'))} "
                f"| {_fmt(summary.get('pp512'))}{_fraction(summary.get('pp512'), floors['pp512'])} "
                f"| {summary['peak_rss_mb']:.0f} | {summary['load_s']:.1f} |")
        details += ["", _weights_line(file) + f" Floor: {floors['single']:.1f} tok/s at batch 1."]
        for engine, rounds in file["engines"].items():
            details += _engine_details(engine, rounds)
        ratio_rows.append((file["label"], ratios(summaries)))
    lines += details
    lines += ["", "tiergate / llama.cpp on the same file (goals from issue 30):", "",
              "| file | " + " | ".join(f"{METRIC_NAMES[m]} (goal {g}x)" for m, g in GOALS) + " |",
              "|---|" + "---:|" * len(GOALS)]
    for label, r in ratio_rows:
        cells = []
        for metric, least in GOALS:
            value = r.get(metric)
            cells.append("-" if value is None else f"{value:.2f}x " + ("met" if value >= least else "**not met**"))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
