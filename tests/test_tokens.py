"""API tokens against the real platform: an expiry that takes effect, the IAM events that
record who created and revoked what, and the admin-only routes (docs/api.md, "Tokens")."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest

import dsec
from tests.conftest import TOKEN, Platform


def test_expiry_revocation_and_events(platform: Platform) -> None:
    with dsec.Client(url=platform.url, token=TOKEN) as admin:
        seen = admin.iam_events(limit=10_000)
        after = seen[-1].id if seen else 0
        short = admin.create_token("tok-exp", "runner", "short", ttl_s=2)
        assert short.expires_at is not None and short.created_at + 1.9 < short.expires_at < short.created_at + 2.1
        assert short.created_by == "admin"
        assert short.token is not None
        h = {"Authorization": f"Bearer {short.token}"}
        assert httpx.get(f"{platform.url}/v1/sandboxes", headers=h).status_code == 200
        assert httpx.get(f"{platform.url}/v1/iam/events", headers=h).status_code == 403  # admin only
        time.sleep(2.2)
        r = httpx.get(f"{platform.url}/v1/sandboxes", headers=h)
        assert r.status_code == 401 and r.json()["field"] == "authorization"  # expired, on every path
        assert httpx.get(f"{platform.url}/sandboxes", headers={"X-API-Key": short.token}).status_code == 401
        lasting = admin.create_token("tok-exp", "builder")
        assert lasting.expires_at is None
        admin.revoke_token(lasting.id)
        events = admin.iam_events(after=after)
        assert [(e.action, e.target, e.actor) for e in events] == [
            ("token.create", short.id, "admin"), ("token.create", lasting.id, "admin"),
            ("token.revoke", lasting.id, "admin")]
        assert events[0].project == "tok-exp" and events[0].detail == {"role": "runner", "name": "short",
                                                                       "expires_at": short.expires_at}
        assert {t.id: t.expires_at for t in admin.tokens()}[short.id] == short.expires_at
        with pytest.raises(dsec.InvalidRequest) as e:
            admin.create_token("tok-exp", "runner", ttl_s=-5)
        assert e.value.field == "ttl_s"


def test_cli_ttl(platform: Platform) -> None:
    base = [sys.executable, "-m", "dsec.client.cli.main", "token"]
    auth = ["--url", platform.url, "--token", TOKEN]
    r = subprocess.run([*base, "create", "tok-cli", "--ttl", "30d", *auth], capture_output=True, text=True, check=True)
    info = json.loads(r.stdout)
    assert abs(info["expires_at"] - info["created_at"] - 30 * 86400) < 1
    bad = subprocess.run([*base, "create", "tok-cli", "--ttl", "soon", *auth], capture_output=True, text=True)
    assert bad.returncode == 2 and "--ttl" in bad.stderr
    r = subprocess.run([*base, "events", *auth], capture_output=True, text=True, check=True)
    assert any(json.loads(x)["target"] == info["id"] for x in r.stdout.splitlines())
