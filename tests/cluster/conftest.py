"""One loopback cluster for the whole module: three replicas of the bundled model behind HAProxy.

Starting a replica costs tens of seconds and ~1.3 GB, so the tests share one
cluster and leave it serving (a test that stops a replica starts it again).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
import redis

from billing import adapters as billing_adapters
from billing.db import create_engine_for, upgrade
from billing.keys import create_key
from billing.tenants import create_tenant
from engine.gguf_cache import metadata_dir
from engine.loader import bundled_gguf_path
from gateway.adapter_dirs import read_adapter_dir
from lora_pool.demo_adapters import demo_adapters
from tests.cluster.cluster import (
    REDIS_URL,
    REPO,
    Cluster,
    Replica,
    create_schema,
    drop_schema,
    free_port,
    schema_url,
)

LEASE_S = 3.0  # short, so that a killed replica's slots visibly free within the test
DRAIN_TIMEOUT_S = 8.0  # a short request finishes well within it; a long stream does not
RPM_LIMIT = 5
CAPPED_CONCURRENCY = 3
TENANTS = {
    "limited": {"rpm": RPM_LIMIT},
    "steady": {"rpm": 100_000, "max_concurrent": 64},
    "capped": {"rpm": 100_000, "max_concurrent": CAPPED_CONCURRENCY},
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, engine_cache_dir) -> Iterator[Cluster]:
    workdir = tmp_path_factory.mktemp("cluster")
    # Derived here once (or found, derived by an earlier test of the session), rather than by the three
    # replicas at once on two cores, each parsing the file's metadata.
    metadata_dir(bundled_gguf_path(), engine_cache_dir)
    schema = create_schema()
    database_url = schema_url(schema)
    upgrade(database_url)
    db = create_engine_for(database_url)
    keys = {}
    for name, limits in TENANTS.items():
        create_tenant(db, name, "premium", tpm=10_000_000, **limits)
        keys[name] = create_key(db, name)[1]
    adapter = read_adapter_dir(str(demo_adapters()[adapter_name()]))
    billing_adapters.register_adapter(db, adapter_name(), adapter.path, adapter.base_model, adapter.rank)
    billing_adapters.grant(db, adapter_name(), "steady")
    key_prefix = f"tiergate-cluster-test:{uuid.uuid4().hex}"
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "TIERGATE_DATABASE_URL": database_url,
        "TIERGATE_CACHE_DIR": str(engine_cache_dir),
        "TIERGATE_REDIS_URL": REDIS_URL,
        "TIERGATE_REDIS_KEY_PREFIX": key_prefix,
        "TIERGATE_CONCURRENCY_LEASE_S": str(LEASE_S),
        "TIERGATE_DRAIN_TIMEOUT_S": str(DRAIN_TIMEOUT_S),
        # Admission's SLO shedding is not under test here; two busy cores would trip it.
        "TIERGATE_PREMIUM_TTFT_SLO_S": "300",
        # Room for test_drain_deadline's stream to outlast the drain on a fast CPU (a 480-token stream ended
        # within it once the Q4_1 kernels were repacked).
        "TIERGATE_MAX_MODEL_LEN": "4096",
        "TIERGATE_MAX_LORAS": "1",
        "TIERGATE_CPU_THREADS": "1",
        "TIERGATE_LOG_LEVEL": "warning",
    }
    env.pop("TIERGATE_SPOOL_PATH", None)  # all replicas in one directory: each must spool to its own file
    replicas = [Replica(f"r{i}", free_port(), env, workdir) for i in range(3)]
    cluster = Cluster(workdir, replicas, free_port(), schema, key_prefix, db, redis.Redis.from_url(REDIS_URL), keys)
    try:
        for r in replicas:
            r.start()
        for r in replicas:
            r.wait_ready()
        cluster.start_proxy()
        yield cluster
    finally:
        cluster.stop()
        for key in cluster.redis.scan_iter(f"{key_prefix}:*"):
            cluster.redis.delete(key)
        db.dispose()
        drop_schema(schema)


def adapter_name() -> str:
    return next(iter(demo_adapters()))
