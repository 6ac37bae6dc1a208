"""The hostile bench's neighbour (bench/live/hostile.py): a tenant streaming short completions from a process of
its own, and the figures of its requests (TTFT percentiles, largest inter-token gap)."""

from __future__ import annotations

import asyncio
import gc
import json
import multiprocessing
import time
from collections import Counter
from dataclasses import dataclass

import httpx

from bench.common.stats import percentile
from bench.live.hostile_attacks import MODEL


@dataclass
class Sample:
    """One neighbour request as its client saw it."""

    status: int | str
    ttft_s: float | None = None
    max_gap_s: float | None = None


async def neighbour_request(client: httpx.AsyncClient, url: str, key: str, n: int) -> Sample:
    body = {"model": MODEL, "prompt": f"Neighbour {n}: say hello.", "max_tokens": 16, "temperature": 0,
            "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    first = last = None
    gap = 0.0
    try:
        async with client.stream("POST", url + "/v1/completions", json=body,
                                 headers={"authorization": f"Bearer {key}"}) as response:
            if response.status_code != 200:
                await response.aread()
                return Sample(response.status_code)
            async for line in response.aiter_lines():
                if not line.startswith("data:") or (data := line[5:].strip()) == "[DONE]":
                    continue
                if any(c.get("text") for c in json.loads(data).get("choices") or ()):
                    now = time.perf_counter()
                    if first is None:
                        first = now - start
                    else:
                        gap = max(gap, now - last)
                    last = now
    except httpx.HTTPError as exc:
        return Sample(type(exc).__name__)
    return Sample(200, first, gap)


class NeighbourProcess:
    """The neighbour's loop in a process of its own: a request every ``every_s`` until ``stop()``.

    A real neighbour is another client. Sharing the attack's client and event loop, the neighbour's first
    tokens waited for the bench's own work on the attack (45 uploads and answers at once), which the server
    never caused: measured that way, a burst of 45 small requests showed a 0.3-0.5 s neighbour TTFT that a
    neighbour in its own process does not see (bench/RESULTS.md, 2026-11-27)."""

    def __init__(self, url: str, key: str, every_s: float, first_n: int) -> None:
        context = multiprocessing.get_context("spawn")
        self._stop = context.Event()
        self._conn, theirs = context.Pipe(duplex=False)
        self._process = context.Process(target=_neighbour_main, args=(url, key, every_s, first_n, self._stop, theirs),
                                        daemon=True)
        self._process.start()
        theirs.close()
        if self._conn.recv() != "ready":
            raise RuntimeError("the neighbour process did not start")

    def stop(self) -> list[Sample]:
        self._stop.set()
        samples = [Sample(*fields) for fields in self._conn.recv()]
        self._process.join()
        return samples


def _neighbour_main(url: str, key: str, every_s: float, first_n: int, stop, conn) -> None:
    # A full collection in this client, over all that its imports left, would be read as one of the server's gaps:
    # frozen out of the collector, as the server freezes what its startup built (bench/RESULTS.md).
    gc.collect()
    gc.freeze()

    async def loop() -> list[Sample]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(120, connect=10)) as client:
            conn.send("ready")
            tasks, n = [], first_n
            while not stop.is_set():
                tasks.append(asyncio.create_task(neighbour_request(client, url, key, n)))
                n += 1
                await asyncio.sleep(every_s)
            return list(await asyncio.gather(*tasks))

    conn.send([(s.status, s.ttft_s, s.max_gap_s) for s in asyncio.run(loop())])


def neighbour_stats(samples: list[Sample]) -> dict:
    served = [s for s in samples if s.status == 200 and s.ttft_s is not None]
    ttfts, gaps = [s.ttft_s for s in served], [s.max_gap_s for s in served if s.max_gap_s is not None]
    return {"sent": len(samples), "served": len(served), "ttft_p50_s": percentile(ttfts, 50),
            "ttft_p99_s": percentile(ttfts, 99), "ttft_max_s": max(ttfts, default=None),
            "max_gap_s": max(gaps, default=None),
            "errors": Counter(str(s.status) for s in samples if s.status != 200)}


def baseline_stats(before: list[Sample], after: list[Sample]) -> dict:
    """The neighbour alone before the attacks and after them, pooled, with each window's own figures."""
    return {**neighbour_stats(before + after), "before": neighbour_stats(before), "after": neighbour_stats(after)}
