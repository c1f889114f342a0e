"""Ray's token authentication for the Ray clusters dsec starts (dsec.control.cluster.local, the
namespace test bed) and that docs/cluster.md has operators start: every GCS, raylet,
worker and driver runs with ``RAY_AUTH_MODE=token`` and reads the cluster's token from a
file (``RAY_AUTH_TOKEN_PATH``, 0600), so the token itself is never in an environment or
argv that /proc shows other users. A process without the token is refused by every Ray
gRPC server (Ray >= 2.52). The dashboard (and with it the job API) is not started."""

from __future__ import annotations

import os
import secrets

from dsec.shared.tls import write_private

MODE_VAR, PATH_VAR = "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH"
_VARS = (MODE_VAR, PATH_VAR, "RAY_AUTH_TOKEN")


def token_file(path: str) -> str:
    """A token in ``path`` (0600), made once (Ray's own kind: 256 random bits in hex)."""
    if not os.path.exists(path):
        write_private(path, secrets.token_hex(32).encode())
    return path


def env(path: str) -> dict[str, str]:
    """What a Ray process (``ray start``, a driver) needs in its environment: a path, no secret."""
    return {MODE_VAR: "token", PATH_VAR: path}


def _reload() -> None:
    # Ray caches its config and the token per process: read both again from the environment
    from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def enable_here(path: str) -> dict[str, str | None]:
    """Token auth for this process (and the Ray processes it starts); what it replaced,
    for :func:`restore`."""
    before = {k: os.environ.get(k) for k in _VARS}
    os.environ.pop("RAY_AUTH_TOKEN", None)
    os.environ.update(env(path))
    _reload()
    return before


def restore(before: dict[str, str | None]) -> None:
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    _reload()
