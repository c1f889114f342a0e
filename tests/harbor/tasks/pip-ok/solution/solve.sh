#!/bin/bash
set -euo pipefail
mkdir -p /app
python3 - <<'PY'
import tomli_w

with open("/app/config.toml", "wb") as f:
    tomli_w.dump({"server": {"host": "127.0.0.1", "port": 8080}}, f)
PY
cat /app/config.toml
