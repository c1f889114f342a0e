#!/bin/bash
# Harbor runs this as /tests/test.sh, with stdout and stderr going to
# /logs/verifier/test-stdout.txt; the reward is the number in /logs/verifier/reward.txt.
mkdir -p /logs/verifier
if python3 - <<'PY'
import importlib.metadata
import tomllib

# the Dockerfile's COPY and RUN ran at template build time
version = importlib.metadata.version("tomli-w")
assert version == "1.0.0", f"tomli-w {version} installed, expected 1.0.0"
with open("/app/config.toml", "rb") as f:
    config = tomllib.load(f)
assert config == {"server": {"host": "127.0.0.1", "port": 8080}}, f"wrong config: {config}"
print("config.toml is right")
PY
then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
