#!/usr/bin/env bash
# Creates .venv (if needed) and installs shardmem with its test and docs tools and libtpu (deviceless TPU
# plans). Safe to run again.
#
#   bash scripts/setup.sh            # .venv on python3 (3.11+), the versions pip resolves
#   bash scripts/setup.sh --newest   # .venv-newest on the newest Python >= 3.12 on this machine,
#                                    # with the newest JAX, Flax, Optax and Orbax (CI tests both)
set -euo pipefail
cd "$(dirname "$0")/.."

newest_python() {
  # The newest interpreter >= 3.12 already on the machine (PATH or pyenv); never downloads one.
  local candidates=() best="" best_version=0 exe version
  for exe in python3.14 python3.13 python3.12; do
    command -v "$exe" >/dev/null && candidates+=("$(command -v "$exe")")
  done
  for exe in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.*/bin/python3; do
    [ -x "$exe" ] && candidates+=("$exe")
  done
  for exe in "${candidates[@]}"; do
    version=$("$exe" -c 'import sys; print(sys.version_info[0] * 100 + sys.version_info[1])' 2>/dev/null) || continue
    if ((version >= 312 && version > best_version)); then best=$exe best_version=$version; fi
  done
  [ -n "$best" ] || { echo "setup.sh --newest: no Python >= 3.12 found on PATH or in pyenv" >&2; return 1; }
  echo "$best"
}

if [ "${1:-}" = "--newest" ]; then
  venv=.venv-newest
  [ -x "$venv/bin/python" ] || "$(newest_python)" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --upgrade pip
  # Compat mode puts the checkout on sys.path: a folder named shardmem next to a script cannot shadow it.
  "$venv/bin/python" -m pip install --quiet --upgrade -e ".[dev,tpu]" jax jaxlib flax optax orbax-checkpoint \
    --config-settings editable_mode=compat
  exit 0
fi
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
# Compat mode puts the checkout on sys.path, so a folder named shardmem next to a script (a clone) cannot
# shadow the package as an empty namespace package.
.venv/bin/python -m pip install --quiet -e ".[dev,docs,tpu]" --config-settings editable_mode=compat
