"""The Helm chart on its own: lint, render with each optional part, values schema, least privilege."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvstrata_dev.localcluster import versions

CHART = Path(__file__).resolve().parents[2] / "charts" / "kvstrata"


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(versions.bin_dir() / "helm"), *args], capture_output=True, text=True, check=check, timeout=120
    )


def render(*sets: str) -> list[dict[str, Any]]:
    args = ["template", "kvstrata", str(CHART), "--namespace", "kvstrata-system"]
    for s in sets:
        args += ["--set", s]
    return [d for d in yaml.safe_load_all(helm(*args).stdout) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def test_helm_lint_is_clean() -> None:
    out = helm("lint", "--strict", str(CHART))
    assert "0 chart(s) failed" in out.stdout


def test_default_render_has_every_part() -> None:
    docs = render()
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(
        [
            "CustomResourceDefinition",
            "ServiceAccount",
            "ClusterRole",
            "ClusterRoleBinding",
            "Deployment",
            "Secret",
            "Service",
            "Service",
            "ValidatingWebhookConfiguration",
        ]
    )
    crd = by_kind(docs, "CustomResourceDefinition")[0]
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"


def test_operator_pod_is_locked_down() -> None:
    dep = by_kind(render(), "Deployment")[0]
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert c["command"] == ["kvstrata"] and c["args"][0] == "operator"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["resources"]["limits"]["memory"]
    assert dep["spec"]["strategy"]["type"] == "Recreate" and dep["spec"]["replicas"] == 1


def test_webhook_certificate_matches_its_ca_bundle_and_service() -> None:
    from cryptography import x509

    docs = render()
    secret = by_kind(docs, "Secret")[0]
    vwc = by_kind(docs, "ValidatingWebhookConfiguration")[0]
    hook = vwc["webhooks"][0]
    assert hook["clientConfig"]["caBundle"] == secret["data"]["ca.crt"]
    assert hook["failurePolicy"] == "Fail" and hook["timeoutSeconds"] == 5
    assert hook["rules"][0]["operations"] == ["CREATE", "UPDATE"]
    import base64

    cert = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["tls.crt"]))
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName
    )
    assert "kvstrata-webhook.kvstrata-system.svc" in sans
    ca = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["ca.crt"]))
    assert cert.issuer == ca.subject


def test_rbac_is_least_privilege() -> None:
    role = by_kind(render(), "ClusterRole")[0]
    resources = {r for rule in role["rules"] for r in rule["resources"]}
    assert "secrets" not in resources
    assert "validatingwebhookconfigurations" not in resources
    assert "customresourcedefinitions" not in resources
    assert not any("*" in rule["verbs"] or "*" in rule["resources"] for rule in role["rules"])
    deletes = {r for rule in role["rules"] if "delete" in rule["verbs"] for r in rule["resources"]}
    assert deletes == {"statefulsets"}


def test_optional_parts() -> None:
    docs = render(
        "metrics.serviceMonitor.enabled=true",
        "networkPolicy.enabled=true",
        "watchNamespaces={team-a,team-b}",
    )
    assert by_kind(docs, "ServiceMonitor") and by_kind(docs, "NetworkPolicy")
    args = by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args
    no_hook = render("webhook.enabled=false")
    assert not by_kind(no_hook, "ValidatingWebhookConfiguration") and not by_kind(no_hook, "Secret")
    assert (
        "--no-webhook"
        in by_kind(no_hook, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    )


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ("webhook.failurePolicy=Sometimes", "failurePolicy"),
        ("webhook.timeoutSeconds=90", "timeoutSeconds"),
        ("logFormat=xml", "logFormat"),
        ("workers=0", "workers"),
        ("typo=1", "typo"),
    ],
)
def test_values_schema_rejects_bad_values(value: str, field: str) -> None:
    out = helm("template", "kvstrata", str(CHART), "--set", value, check=False)
    assert out.returncode != 0
    assert field in out.stderr
