"""deploy/k8s: renders, validates strictly, and agrees with the app it deploys (paths, timings, names)."""

from __future__ import annotations

import copy
import json
from dataclasses import fields
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import create_engine
from starlette.testclient import TestClient

from gateway.app import create_app
from gateway.metrics import GatewayMetrics, render
from gateway.settings import Settings
from scheduler.config import default_tiers
from scheduler.load import TierLoad
from tests.deploy.conftest import one, server_container, server_deployment
from tiergate_common.env import PREFIX as ENV_PREFIX

KUBERNETES_VERSION = "1.32.0"
SCHEMAS = Path(__file__).parent / "schemas"
CRD_SCHEMAS = {
    "InferencePool": SCHEMAS / "inferencepool-v1.json",
    "InferenceObjective": SCHEMAS / "inferenceobjective.json",
}
DRAIN_MARGIN_S = 5


def is_inference_object(obj: dict) -> bool:
    return obj["apiVersion"].startswith(("inference.networking.k8s.io/", "inference.networking.x-k8s.io/"))


def crd_validator(kind: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(json.loads(CRD_SCHEMAS[kind].read_text()))


def pod_labels(objects: list[dict]) -> dict[str, str]:
    return server_deployment(objects)["spec"]["template"]["metadata"]["labels"]


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


# -- rendering and schemas -----------------------------------------------------


@pytest.mark.parametrize("overlay", ["base", "inference"])
def test_every_core_object_validates_strictly_against_kubernetes_1_32(rendered, overlay):
    core = [o for o in rendered[overlay] if not is_inference_object(o)]
    assert {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler"} <= {o["kind"] for o in core}
    for obj in core:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_strict_validation_refuses_a_misspelled_field(rendered):
    broken = copy.deepcopy(server_deployment(rendered["base"]))
    broken["spec"]["template"]["spec"]["terminationGracePeriod"] = 50
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_inference_overlay_has_a_pool_and_an_objective_per_tier_valid_against_their_schemas(inference):
    pool = one(inference, "InferencePool")
    objectives = [o for o in inference if o["kind"] == "InferenceObjective"]
    # The batch tier's lines never pass the inference gateway: each replica's batch driver runs them itself.
    assert {o["metadata"]["name"] for o in objectives} == {t.name for t in default_tiers() if not t.spare_only}
    for obj in [pool, *objectives]:
        crd_validator(obj["kind"]).validate(obj)
    by_tier = {o["metadata"]["name"]: o["spec"]["priority"] for o in objectives}
    assert by_tier["premium"] > by_tier["standard"]
    assert all(o["spec"]["poolRef"]["name"] == pool["metadata"]["name"] for o in objectives)


def test_the_pool_schema_refuses_the_old_alpha_fields(inference):
    pool = copy.deepcopy(one(inference, "InferencePool"))
    pool["spec"]["targetPortNumber"] = pool["spec"].pop("targetPorts")[0]["number"]
    assert not crd_validator("InferencePool").is_valid(pool)


# -- cross-checks with the app ---------------------------------------------------


class _IdleEngine:
    """Just enough of the engine front for the probe routes: running, idle, two tiers."""

    model_name = "m"
    max_model_len = 64
    is_running = True

    def __init__(self) -> None:
        from engine.config import EngineConfig

        self.config = EngineConfig(model="dummy:none", max_loras=4)

    def add_listener(self, listener) -> None: ...

    def load(self) -> dict[str, TierLoad]:
        return {t.name: TierLoad(0, 0, 0.0) for t in self.config.tiers}

    def kv_usage(self) -> tuple[dict[str, int], int]:
        return {}, 100

    def list_adapters(self) -> list[str]:
        return []


def test_probe_paths_answer_200_on_a_ready_app_and_use_the_served_port(rendered, tmp_path):
    container = server_container(rendered["base"])
    probes = {name: container[name]["httpGet"] for name in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert probes["readinessProbe"]["path"] == "/readyz" and probes["livenessProbe"]["path"] == "/healthz"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    db = create_engine(f"sqlite:///{tmp_path / 'db.sqlite'}")
    app = create_app(Settings(spool_path=str(tmp_path / "spool.jsonl")), _IdleEngine(), db, ledger=None)
    client = TestClient(app)  # no lifespan: the routes only read state
    for probe in probes.values():
        assert probe["port"] in ports
        assert client.get(probe["path"]).status_code == 200, probe["path"]
    assert str(ports["http"]) in container["command"]


def test_grace_period_covers_prestop_drain_and_margin(rendered):
    pod = server_deployment(rendered["base"])["spec"]["template"]["spec"]
    container = server_container(rendered["base"])
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    drain_env = env_of(container).get(f"{ENV_PREFIX}DRAIN_TIMEOUT_S")
    drain = float(drain_env["value"]) if drain_env else Settings().drain_timeout_s
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + drain + DRAIN_MARGIN_S


def test_every_tiergate_variable_in_the_deployment_is_a_setting(rendered):
    names = {f"{ENV_PREFIX}{f.name.upper()}" for f in fields(Settings)}
    used = [n for n in env_of(server_container(rendered["base"])) if n.startswith(ENV_PREFIX)]
    assert used and set(used) <= names, set(used) - names


def test_database_redis_and_admin_token_come_from_a_secret(rendered):
    env = env_of(server_container(rendered["base"]))
    for setting in ("database_url", "redis_url", "admin_token"):
        ref = env[f"{ENV_PREFIX}{setting.upper()}"]
        assert "value" not in ref and ref["valueFrom"]["secretKeyRef"]["name"], setting


def test_selectors_of_service_pdb_hpa_and_pool_match_the_pods(inference):
    labels = pod_labels(inference)
    deployment = server_deployment(inference)
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert one(inference, "Service", "tiergate")["spec"]["selector"].items() <= labels.items()
    assert one(inference, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"].items() <= labels.items()
    hpa_target = one(inference, "HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]
    assert (hpa_target["kind"], hpa_target["name"]) == ("Deployment", deployment["metadata"]["name"])
    pool = one(inference, "InferencePool")["spec"]
    assert pool["selector"]["matchLabels"].items() <= labels.items()
    served = {p["containerPort"] for p in server_container(inference)["ports"]}
    assert {p["number"] for p in pool["targetPorts"]} <= served
    # The picker's Service exists, on the port the pool names, and selects the picker's pods.
    picker = one(inference, "Service", pool["endpointPickerRef"]["name"])
    assert pool["endpointPickerRef"]["port"]["number"] in {p["port"] for p in picker["spec"]["ports"]}
    epp_pods = one(inference, "Deployment", "tiergate-epp")["spec"]["template"]["metadata"]["labels"]
    assert picker["spec"]["selector"].items() <= epp_pods.items()
    # The EPP's other pods must not be taken for model servers.
    assert not pool["selector"]["matchLabels"].items() <= epp_pods.items()


def epp_config(inference: list[dict]) -> dict:
    maps = [o for o in inference if o["kind"] == "ConfigMap" and "epp-config.yaml" in o.get("data", {})]
    assert len(maps) == 1
    config = yaml.safe_load(maps[0]["data"]["epp-config.yaml"])
    mounted = one(inference, "Deployment", "tiergate-epp")["spec"]["template"]["spec"]["volumes"]
    assert maps[0]["metadata"]["name"] in {v.get("configMap", {}).get("name") for v in mounted}
    return config


def named_metrics(config: dict) -> set[str]:
    """Every metric name the EPP configuration names (the *Spec fields of its engine configs)."""
    names = set()
    for plugin in config["plugins"]:
        for engine in plugin.get("parameters", {}).get("engineConfigs", []):
            names |= {v for k, v in engine.items() if k.endswith("Spec") and v}
    return names


def exported_metric_names(vllm_names: bool) -> set[str]:
    metrics = GatewayMetrics(default_tiers(), vllm_names=vllm_names)
    metrics.attach_engine(_IdleEngine())
    body, _ = render(metrics)
    return {family.name for family in text_string_to_metric_families(body.decode())}


def test_every_metric_the_epp_config_and_hpa_name_is_exported_by_metrics(inference):
    wanted = named_metrics(epp_config(inference))
    assert {"tiergate_num_requests_waiting", "tiergate_kv_cache_usage_perc", "tiergate_lora_requests_info"} <= wanted
    hpa = one(inference, "HorizontalPodAutoscaler")
    wanted |= {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"}
    exported = exported_metric_names(vllm_names=False)
    assert wanted <= exported, wanted - exported


def test_vllm_names_setting_exports_what_a_default_epp_reads():
    default_epp = {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                   "vllm:lora_requests_info", "vllm:cache_config_info"}
    assert default_epp <= exported_metric_names(vllm_names=True)
    assert not default_epp & exported_metric_names(vllm_names=False)
