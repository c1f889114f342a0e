#!/usr/bin/env bash
# dsec across machines, on this one: a 3-node Ray cluster (three raylets) with a private
# PostgreSQL and a MooseFS store, `dsec cluster up`, the README demo spread over the edges
# (where each sandbox ran is printed), then everything torn down. Run as root.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python demo/cluster.py "$@"
