#!/usr/bin/env bash
# Creates .venv with lightning_fp8 (editable) and everything the tests, examples and docs need.
# torch is pinned to the CPU build where pip offers it locally; any torch>=2.10 works.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
source .venv/bin/activate
export PIP_NO_CACHE_DIR=1  # no wheel cache: the venv alone needs ~2.5 GB of disk
python -m pip install -q --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install -q "torch==2.13.0" || python -m pip install -q "torch>=2.10"
fi
python -m pip install -q -e ".[test,examples,docs]"
