#!/bin/bash
# A wrong solution (port 80, not 8080): it runs fine, and the verifier gives reward 0.
set -euo pipefail
mkdir -p /app
python3 - <<'PY'
import tomli_w

with open("/app/config.toml", "wb") as f:
    tomli_w.dump({"server": {"host": "127.0.0.1", "port": 80}}, f)
PY
cat /app/config.toml
