"""`kvstrata operator` refuses a bad configuration with one line and exit code 2, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstrata.controller.main import main
from kvstrata.controller.settings import parse


def test_missing_webhook_certificate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--webhook-cert-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "tls.crt" in err and "--no-webhook" in err and "Traceback" not in err


def test_missing_kubeconfig(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--no-webhook", "--kubeconfig", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTRATA_NAMESPACES", "a,b")
    monkeypatch.setenv("KVSTRATA_WEBHOOK_PORT", "10443")
    cfg = parse(["--resync-interval", "0", "--health-port", "0"])
    assert cfg.namespaces == ("a", "b") and cfg.webhook_port == 10443
    assert cfg.resync_interval == 0 and cfg.liveness_endpoint is None
    assert parse(["-n", "x"]).namespaces == ("x",)


def test_cache_status_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("INTERVAL", "WINDOW", "TIMEOUT", "HEARTBEAT"):
        monkeypatch.delenv(f"KVSTRATA_CACHE_STATUS_{name}", raising=False)
    defaults = parse([]).cache_status
    assert (defaults.interval, defaults.window, defaults.timeout, defaults.heartbeat) == (15, 300, 3, 300)
    monkeypatch.setenv("KVSTRATA_CACHE_STATUS_INTERVAL", "5")
    monkeypatch.setenv("KVSTRATA_CACHE_STATUS_HEARTBEAT", "")
    cfg = parse([]).cache_status
    assert (cfg.interval, cfg.heartbeat) == (5, 300)
    monkeypatch.setenv("KVSTRATA_CACHE_STATUS_WINDOW", "0")
    with pytest.raises(ValueError, match="KVSTRATA_CACHE_STATUS_WINDOW must be > 0"):
        parse([])
