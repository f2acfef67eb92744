"""The launcher's pod → local command mapping, on the objects the operator really renders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import example

from kvstrata.api.manifest import validate
from kvstrata.planner import plan
from kvstrata.render import render
from kvstrata_dev.e2e.launcher import PODNET_DIR, engine_pythonpath, readiness_patch
from kvstrata_dev.e2e.podspec import PodSpecError, launch_spec, native_sidecars, set_flag, static_discovery
from kvstrata_dev.repo import REPO

VLLM_PY = "/opt/vllm/bin/python"
KVSTRATA = "/opt/kvstrata/bin/kvstrata"


def rendered(kind: str, name: str, manifest: str = "tiny-cpu.yaml") -> dict:
    ic = validate(example(manifest))
    for obj in render(ic.metadata.name, "demo", ic.spec, plan(ic.spec), "uid-ic"):
        if obj["kind"] == kind and obj["metadata"]["name"] == name:
            return obj
    raise AssertionError(f"{kind}/{name} not rendered")


def as_pod(workload: dict, name: str, ip: str | None = "127.10.1.7") -> dict:
    tmpl = workload["spec"]["template"]
    return {
        "metadata": {**tmpl["metadata"], "name": name, "namespace": "demo", "uid": "pod-uid-1"},
        "spec": {**tmpl["spec"], "nodeName": "kwok-cpu-0"},
        "status": {"phase": "Running", "podIP": ip} if ip else {"phase": "Pending"},
    }


def engine_spec(tmp_path: Path, **kw):
    pod = as_pod(rendered("StatefulSet", "tiny-engine"), "tiny-engine-0", **kw)
    dirs = {"model": tmp_path / "pv-models", "tmp": tmp_path / "tmp", "dshm": tmp_path / "shm"}
    return pod, launch_spec(pod, programs={"python3": VLLM_PY}, volume_dirs=dirs)


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_engine_runs_the_rendered_flags_with_only_the_documented_substitutions(tmp_path: Path) -> None:
    pod, spec = engine_spec(tmp_path)
    container = pod["spec"]["containers"][0]
    rendered_argv = [*container["command"], *container["args"]]
    assert spec.argv[0] == VLLM_PY
    assert flag(spec.argv, "--model") == str(tmp_path / "pv-models" / "tiny-llama")
    assert flag(spec.argv, "--host") == "127.10.1.7"
    # Everything else is exactly what the operator rendered, in order.
    changed = {"--model", "--host"}

    def strip(argv: list[str]) -> list[str]:
        out, skip = [], False
        for a in argv[1:]:
            if skip:
                skip = False
                continue
            if a in changed:
                skip = True
                continue
            out.append(a)
        return out

    assert strip(spec.argv) == strip(rendered_argv)
    # ZMQ endpoints stay wildcard (vLLM binds only those); the podnet shim moves them to the pod IP.
    events = json.loads(flag(spec.argv, "--kv-events-config"))
    assert events["endpoint"].startswith("tcp://*:")
    assert len(spec.substitutions) == 3


def test_engine_env_resolves_field_refs(tmp_path: Path) -> None:
    _, spec = engine_spec(tmp_path)
    assert spec.env["POD_IP"] == "127.10.1.7"
    assert spec.env["VLLM_TARGET_DEVICE"] == "cpu"
    assert spec.readiness is not None
    assert (spec.readiness.path, spec.readiness.port) == ("/health", 8000)
    assert spec.ports["kv-events"] == 5557


def test_pod_without_ip_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PodSpecError, match="no IP"):
        engine_spec(tmp_path, ip=None)


def test_unknown_program_is_refused(tmp_path: Path) -> None:
    pod = as_pod(rendered("StatefulSet", "tiny-engine"), "tiny-engine-0")
    with pytest.raises(PodSpecError, match="no local stand-in"):
        launch_spec(pod, programs={"kvstrata": KVSTRATA}, volume_dirs={})


def test_router_gets_its_config_volume_and_a_pod_ip_bind(tmp_path: Path) -> None:
    pod = as_pod(rendered("Deployment", "tiny-router"), "tiny-router-abc", ip="127.10.2.9")
    dirs = {"config": tmp_path / "cfg", "model": tmp_path / "pv-models"}
    spec = launch_spec(pod, programs={"kvstrata": KVSTRATA}, volume_dirs=dirs)
    assert spec.argv[:2] == [KVSTRATA, "router"]
    assert flag(spec.argv, "--config") == str(tmp_path / "cfg" / "router.json")
    assert flag(spec.argv, "--host") == "127.10.2.9"  # added: the router's default is the wildcard
    assert flag(spec.argv, "--port") == "8080"
    assert spec.env["POD_NAMESPACE"] == "demo"


def test_paths_inside_json_flags_are_mapped() -> None:
    from kvstrata_dev.e2e.podspec import rewrite_token

    token = '{"kv_connector":"OffloadingConnector","kv_connector_extra_config":{"root_dir":"/kv-cache/x"}}'
    out = json.loads(rewrite_token(token, {"/kv-cache": Path("/local/pv")}))
    assert out["kv_connector_extra_config"]["root_dir"] == "/local/pv/x"
    assert rewrite_token("/modelsX/a", {"/models": Path("/m")}) == "/modelsX/a"


def test_set_flag_replaces_both_spellings() -> None:
    assert set_flag(["a", "--host=0.0.0.0", "b"], "--host", "1.2.3.4") == (
        ["a", "b", "--host", "1.2.3.4"],
        "0.0.0.0",
    )
    assert set_flag(["--host", "x"], "--host", "y") == (["--host", "y"], "x")


def test_static_discovery_replaces_the_service() -> None:
    cm = rendered("ConfigMap", "tiny-router")
    cfg = static_discovery(json.loads(cm["data"]["router.json"]), ["127.10.1.3", "127.10.1.2"])
    disc = cfg["discovery"]
    assert "service" not in disc
    assert [e["url"] for e in disc["static"]] == ["http://127.10.1.2:8000", "http://127.10.1.3:8000"]
    assert disc["static"][0]["kvEvents"] == "tcp://127.10.1.2:5557"
    assert disc["static"][0]["kvReplay"] == "tcp://127.10.1.2:5558"
    from kvstrata.api.router_config import RouterSettings

    RouterSettings.model_validate(cfg)  # still a valid router.json
    assert disc["static"][0]["fsJanitor"] is None  # no NVMe tier
    tiered = rendered("ConfigMap", "tiny-tiered-router", "tiny-cpu-tiered.yaml")
    (engine,) = static_discovery(json.loads(tiered["data"]["router.json"]), ["127.10.1.2"])["discovery"][
        "static"
    ]
    assert engine["fsJanitor"] == "http://127.10.1.2:9402"


def test_readiness_patch_shapes() -> None:
    up = readiness_patch("vllm", ready=True, started=True, restarts=2)["status"]
    assert {c["type"]: c["status"] for c in up["conditions"]} == {"Ready": "True", "ContainersReady": "True"}
    assert up["containerStatuses"][0]["restartCount"] == 2
    assert up["containerStatuses"][0]["state"]["waiting"] is None
    down = readiness_patch("vllm", ready=False, started=False, restarts=3, reason="CrashLoopBackOff")[
        "status"
    ]
    assert {c["status"] for c in down["conditions"]} == {"False"}
    assert down["containerStatuses"][0]["state"]["waiting"]["reason"] == "CrashLoopBackOff"


def test_router_config_paths_follow_the_mounts(tmp_path: Path) -> None:
    from kvstrata_dev.e2e.podspec import rewrite_paths

    pod = as_pod(rendered("Deployment", "tiny-router"), "tiny-router-abc", ip="127.10.2.9")
    spec = launch_spec(
        pod,
        programs={"kvstrata": KVSTRATA},
        volume_dirs={"config": tmp_path / "cfg", "model": tmp_path / "pv"},
    )
    cfg = json.loads(rendered("ConfigMap", "tiny-router")["data"]["router.json"])
    assert cfg["tokenizer"] == "/models/tiny-llama"
    assert rewrite_paths(cfg, spec.mounts)["tokenizer"] == str(tmp_path / "pv" / "tiny-llama")


def tiered_pod() -> dict:
    return as_pod(
        rendered("StatefulSet", "tiny-tiered-engine", "tiny-cpu-tiered.yaml"), "tiny-tiered-engine-0"
    )


def test_tiered_engine_pod_runs_its_janitor_sidecar_on_the_pods_own_kv_dir(tmp_path: Path) -> None:
    pod = tiered_pod()
    dirs = {
        "model": tmp_path / "pv-models",
        "tmp": tmp_path / "tmp",
        "kv-cache": tmp_path / "pv-kv-cache-0",  # the pod's own PVC (volumeClaimTemplates)
    }
    assert native_sidecars(pod) == ["fs-janitor"]
    engine = launch_spec(pod, programs={"python3": VLLM_PY}, volume_dirs=dirs)
    janitor = launch_spec(
        pod,
        container_name="fs-janitor",
        programs={"python3": VLLM_PY},
        volume_dirs=dirs,
        bind_flag="--metrics-host",
    )
    # The engine's fs tier and the janitor's root are the same local directory: the pod's PVC.
    transfer = json.loads(flag(engine.argv, "--kv-transfer-config"))
    (fs,) = transfer["kv_connector_extra_config"]["secondary_tiers"]
    assert fs["root_dir"] == str(tmp_path / "pv-kv-cache-0") == flag(janitor.argv, "--root")
    assert janitor.argv[:3] == [VLLM_PY, "-m", "kvstrata.engine.fsjanitor"]
    assert flag(janitor.argv, "--metrics-host") == "127.10.1.7"
    assert int(flag(janitor.argv, "--budget-bytes")) > 0
    # /opt/kvstrata (the image's engine package) is this checkout's operator/, after podnet.
    path = engine_pythonpath(engine.env).split(":")
    assert path[:2] == [str(PODNET_DIR), str(REPO / "operator")]
    assert "/opt/kvstrata" not in path


def test_run_to_completion_init_containers_are_refused() -> None:
    pod = tiered_pod()
    pod["spec"]["initContainers"][0]["restartPolicy"] = "OnFailure"
    with pytest.raises(PodSpecError, match="runs to completion"):
        native_sidecars(pod)
