#!/usr/bin/env bash
# The README's first command: set everything up, start the embedded platform, run the
# demo workload against it, and stop the platform again (sandboxes are released).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

PORT="${DSEC_PORT:-7777}"
export DSEC_URL="http://127.0.0.1:$PORT"
started=""
if ! curl -sf "$DSEC_URL/healthz" >/dev/null 2>&1; then
  echo "== starting dsec serve on port $PORT (log: /tmp/dsec-serve.log)"
  .venv/bin/dsec serve --port "$PORT" >/tmp/dsec-serve.log 2>&1 &
  started=$!
  trap '[ -n "$started" ] && kill -TERM $started 2>/dev/null; wait $started 2>/dev/null || true' EXIT
  for _ in $(seq 1 300); do
    curl -sf "$DSEC_URL/healthz" >/dev/null 2>&1 && break
    kill -0 "$started" 2>/dev/null || { cat /tmp/dsec-serve.log; exit 1; }
    sleep 0.2
  done
fi
.venv/bin/python demo/run.py "$@"
