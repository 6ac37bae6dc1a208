"""Three replicas behind HAProxy: exact shared limits, a SIGKILL routed around, rolling restarts and drains.

Order matters only for cost: every test leaves all replicas serving, except
the last, which ends one with a drain.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.epp_metrics import exported_names
from tests.cluster.cluster import HEALTH_INTERVAL_MS, Cluster, Replica, wait_for
from tests.cluster.conftest import CAPPED_CONCURRENCY, DRAIN_TIMEOUT_S, LEASE_S, RPM_LIMIT, adapter_name

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.slow]

LOOP_LIMIT = 2000  # requests per load loop, whatever happens
LOOP_TIME_S = 600.0
LOOP_PAUSE_S = 0.05  # between one worker's requests


def auth(cluster: Cluster, tenant: str) -> dict[str, str]:
    return {"authorization": f"Bearer {cluster.keys[tenant]}"}


def base_model(cluster: Cluster) -> str:
    models = httpx.get(cluster.url + "/v1/models", headers=auth(cluster, "steady"), timeout=60).json()
    return next(m["id"] for m in models["data"] if "parent" not in m)


def complete(http: httpx.Client, url: str, headers: dict, model: str, max_tokens: int = 2) -> httpx.Response:
    body = {"model": model, "prompt": "Count: one, two,", "max_tokens": max_tokens, "temperature": 0}
    return http.post(url + "/v1/completions", json=body, headers=headers)


class LoadLoop:
    """Requests through the proxy from ``workers`` threads until stopped (or LOOP_LIMIT / LOOP_TIME_S)."""

    def __init__(self, cluster: Cluster, model: str, workers: int = 2, max_tokens: int = 4) -> None:
        self.cluster, self.model, self.max_tokens = cluster, model, max_tokens
        self.results: list[tuple[int, str | None, str]] = []  # status, request id, error body
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(workers)]

    def __enter__(self) -> LoadLoop:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(LOOP_TIME_S)

    def _run(self) -> None:
        deadline = time.monotonic() + LOOP_TIME_S
        headers = auth(self.cluster, "steady")
        with httpx.Client(timeout=120) as http:
            while not self._stop.is_set() and time.monotonic() < deadline:
                with self._lock:
                    if len(self.results) >= LOOP_LIMIT:
                        return
                try:
                    r = complete(http, self.cluster.url, headers, self.model, self.max_tokens)
                    result = (r.status_code, r.headers.get("x-request-id"), "" if r.status_code == 200 else r.text)
                except httpx.HTTPError as e:
                    result = (0, None, repr(e))
                with self._lock:
                    self.results.append(result)
                time.sleep(LOOP_PAUSE_S)

    def wait_for_more(self, n: int, timeout_s: float = 120) -> None:
        start = len(self.results)
        running = lambda: any(t.is_alive() for t in self._threads)  # noqa: E731
        assert wait_for(lambda: len(self.results) >= start + n or not running(), timeout_s), "the load loop stalled"
        assert len(self.results) >= start + n, "the load loop ended (LOOP_LIMIT or LOOP_TIME_S)"

    def failures(self) -> list[tuple[int, str | None, str]]:
        return [r for r in self.results if r[0] != 200]

    def completed_ids(self) -> list[str]:
        return [rid for status, rid, _ in self.results if status == 200]


class Stream:
    """A long streaming completion in a thread; ``events`` collects its SSE data lines."""

    def __init__(self, url: str, headers: dict, model: str, max_tokens: int = 400) -> None:
        self.body = {"model": model, "prompt": "Tell a long story.", "max_tokens": max_tokens, "ignore_eos": True,
                     "stream": True}
        self.url, self.headers = url, headers
        self.events: list[str] = []
        self.request_id: str | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            with httpx.Client(timeout=300) as http:
                with http.stream("POST", self.url + "/v1/completions", json=self.body, headers=self.headers) as r:
                    self.request_id = r.headers.get("x-request-id")
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            self.events.append(line.removeprefix("data: "))
        except httpx.HTTPError as e:
            self.error = e

    def wait_tokens(self, n: int = 2, timeout_s: float = 180) -> None:
        assert wait_for(lambda: len(self.events) > n or not self.thread.is_alive(), timeout_s)
        assert len(self.events) > n, f"stream ended early: {self.events[-3:]} {self.error!r}"


def restart(cluster: Cluster, replica: Replica) -> None:
    replica.start()
    replica.wait_ready()
    # HAProxy's next health check (rise 1) puts it back in rotation.
    time.sleep(3 * HEALTH_INTERVAL_MS / 1000)


def scrape(replica: Replica) -> dict[str, list]:
    body = httpx.get(replica.url + "/metrics", timeout=30).text
    return {f.name: f.samples for f in text_string_to_metric_families(body)}


# -- (1) limits are exact across replicas ------------------------------------------


def test_rpm_admits_exactly_n_of_3n_requests_spread_over_three_replicas(cluster):
    model = base_model(cluster)
    headers = auth(cluster, "limited")
    with httpx.Client(timeout=300) as http, ThreadPoolExecutor(6) as pool:
        statuses = list(pool.map(lambda _: complete(http, cluster.url, headers, model, 1).status_code,
                                 range(3 * RPM_LIMIT)))
    assert statuses.count(200) == RPM_LIMIT and statuses.count(429) == 2 * RPM_LIMIT, statuses
    refused_by = [r.name for r in cluster.replicas
                  if any(s.labels.get("reason") == "rpm" and s.value > 0
                         for s in scrape(r).get("tiergate_rejections", []))]
    assert len(refused_by) >= 2, refused_by  # the budget is shared, not each replica's own


# -- the endpoint picker's contract ---------------------------------------------


def test_metrics_keep_the_epp_protocol_under_load_and_list_running_adapters(cluster):
    replica = cluster.replicas[0]
    headers = auth(cluster, "steady")
    streams = [Stream(replica.url, headers, adapter_name(), 48), Stream(replica.url, headers, base_model(cluster), 48)]
    seen_adapter = seen_busy = False
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and any(s.thread.is_alive() for s in streams):
        families = scrape(replica)
        for name in exported_names(vllm_names=False):
            assert len(families[name]) == 1, (name, families[name])  # the EPP reads one series per name
        usage = families["tiergate_kv_cache_usage_perc"][0].value
        assert 0.0 <= usage <= 1.0
        busy = families["tiergate_num_requests_running"][0].value + families["tiergate_num_requests_waiting"][0].value
        seen_busy |= busy >= 1 and usage > 0
        lora = families["tiergate_lora_requests_info"][0]
        assert lora.labels["max_lora"] == "1" and lora.value > 0
        seen_adapter |= adapter_name() in lora.labels["running_lora_adapters"].split(",")
        assert families["tiergate_draining"][0].value == 0
        if seen_adapter and seen_busy:
            break
        time.sleep(0.2)
    for s in streams:
        s.thread.join(300)
    assert seen_busy and seen_adapter
    assert all(s.events and s.events[-1] == "[DONE]" for s in streams), [s.events[-2:] for s in streams]


# -- (2) SIGKILL under load ------------------------------------------------------


def test_sigkill_is_routed_around_and_frees_the_dead_replicas_slots_within_the_lease(cluster):
    victim = cluster.replicas[0]
    model = base_model(cluster)
    capped = auth(cluster, "capped")
    with LoadLoop(cluster, model) as load:
        load.wait_for_more(4)
        held = [Stream(victim.url, capped, model), Stream(victim.url, capped, model)]
        for s in held:
            s.wait_tokens()
        assert cluster.concurrency_leases("capped") == 2
        victim.kill()
        killed_at = time.monotonic()
        # Nothing released them: the dead process's leases are still there, until they lapse.
        assert cluster.concurrency_leases("capped") == 2
        assert wait_for(lambda: cluster.concurrency_leases("capped") == 0, LEASE_S + 5, 0.1)
        freed_after = time.monotonic() - killed_at
        load.wait_for_more(6)
    for s in held:
        s.thread.join(30)
        assert s.error is not None or "[DONE]" not in s.events  # cut by the kill, as expected
    assert not load.failures(), load.failures()[:3]
    rows = cluster.ledger_rows(load.completed_ids())
    assert all(len(r) == 1 and r[0][0] == "ok" for r in rows.values()), {k: v for k, v in rows.items() if len(v) != 1}
    assert freed_after <= LEASE_S + 5
    # The tenant's full concurrency is usable again through the proxy.
    with httpx.Client(timeout=300) as http, ThreadPoolExecutor(CAPPED_CONCURRENCY) as pool:
        statuses = list(pool.map(lambda _: complete(http, cluster.url, capped, model, 2).status_code,
                                 range(CAPPED_CONCURRENCY)))
    assert statuses == [200] * CAPPED_CONCURRENCY
    restart(cluster, victim)


# -- (3) rolling restart ---------------------------------------------------------


def test_rolling_restart_under_load_loses_no_request_and_no_ledger_row(cluster):
    model = base_model(cluster)
    with LoadLoop(cluster, model) as load:
        for replica in cluster.replicas:
            load.wait_for_more(2)
            assert replica.terminate() == 0, replica.log_tail()
            restart(cluster, replica)
        load.wait_for_more(2)
    assert len(load.results) >= 8
    assert not load.failures(), load.failures()[:3]
    ids = load.completed_ids()
    rows = cluster.ledger_rows(ids)
    assert all(len(r) == 1 and r[0][0] == "ok" for r in rows.values()), {k: v for k, v in rows.items() if len(v) != 1}
    # Replicas started in one directory each spooled to a file of their own.
    assert len(list((cluster.workdir / "var" / "spool").glob("ledger-*.jsonl.lock"))) >= 2


# -- (4) a drain's deadline ------------------------------------------------------


def test_drain_deadline_ends_a_long_stream_with_a_shutdown_event_and_an_interrupted_row(cluster):
    replica = cluster.replicas[-1]
    stream = Stream(replica.url, auth(cluster, "capped"), base_model(cluster), max_tokens=4000)
    stream.wait_tokens()
    started = time.monotonic()
    assert replica.terminate(timeout_s=DRAIN_TIMEOUT_S + 60) == 0, replica.log_tail()
    stream.thread.join(30)
    assert time.monotonic() - started >= DRAIN_TIMEOUT_S - 1  # it was given the drain's time
    last = json.loads(stream.events[-1])
    assert last["error"]["type"] == "server_shutdown" and "[DONE]" not in stream.events, stream.events[-2:]
    sent = int(re.search(r"after (\d+) token", last["error"]["message"]).group(1))
    assert cluster.ledger_rows([stream.request_id])[stream.request_id] == [("interrupted", sent)]
    # Released, not left to lapse: a lapsed lease stays in the set until the tenant's next admission.
    assert cluster.redis.zscore(f"{cluster.key_prefix}:{{capped}}:conc", stream.request_id) is None


@pytest.fixture(autouse=True)
def _all_replicas_serving(cluster) -> Iterator[None]:
    for r in cluster.replicas:
        if r.proc is None or r.proc.poll() is not None:
            restart(cluster, r)
    yield
