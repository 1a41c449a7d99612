#!/usr/bin/env bash
# Formatting and lint checks (CI runs this; a few seconds). Fix with:
#   ruff format . && ruff check --fix . && clang-format -i $(git ls-files 'cuda/*')
set -euo pipefail
cd "$(dirname "$0")/.."
ruff format --check .
ruff check .
mapfile -t native < <(git ls-files 'cuda/*.h' 'cuda/*.cc' 'cuda/*.cu' 'cuda/*.cuh' 'cuda/*.inc')
clang-format --dry-run --Werror "${native[@]}"
echo "lint: clean"
