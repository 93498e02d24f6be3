#!/usr/bin/env bash
# Creates .venv (if needed) and installs shardmem with its test tools. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
# Compat mode puts the checkout on sys.path, so a folder named shardmem next to a script (a clone) cannot
# shadow the package as an empty namespace package.
.venv/bin/python -m pip install --quiet -e ".[dev]" --config-settings editable_mode=compat
