"""gateway/memory.py: transient buffers from many threads go back to the system instead of piling up in
glibc's arenas (issue #31, defect 11: a server's RSS grew by gigabytes under an hour of hostile traffic)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# Six threads free 60 buffers each of 1 to 30 MB between small allocations that live on, as request
# threads do with activations, prompt scores and parsed bodies. Untuned, glibc keeps 250-550 MB of it
# (about 180 MB even once trimmed); tuned and trimmed, at most about one 64 MB heap of an arena.
CHURN = textwrap.dedent("""
    import json, random, threading
    from gateway import memory

    def rss_mb():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS"):
                return int(line.split()[1]) // 1024

    assert memory.tune()
    import torch

    kept = []

    def work(seed):
        rng = random.Random(seed)
        for i in range(60):
            buffer = torch.empty(rng.choice([1, 2, 3, 5, 8, 13, 20, 30]) * (1 << 18)).fill_(1.0)
            body = json.dumps([{"a": k} for k in range(2000)])
            kept.append(bytearray(2048))
            del buffer, body

    before = rss_mb()
    threads = [threading.Thread(target=work, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    memory.trim()
    print(rss_mb() - before)
""")


def test_buffers_freed_by_many_threads_leave_the_resident_set():
    grown = int(subprocess.run([sys.executable, "-c", CHURN], capture_output=True, text=True, check=True).stdout)
    assert grown < 128, f"the resident set grew {grown} MB"
