#!/usr/bin/env bash
# The README's second command: set up (idempotent), lint, type-check, run the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "== ruff"; .venv/bin/ruff check src tests bench demo
echo "== mypy"; .venv/bin/mypy src
echo "== pytest"; .venv/bin/python -m pytest -q "$@"
