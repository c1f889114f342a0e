"""Credentials derived from a token die with it (dsec.control.iam.bound): a sandbox's E2B envd
access token (through the unmodified E2B SDK and raw envd calls), the file URLs signed with
it, port traffic through its traffic token, its SWE-ReX token, and a template upload URL
are all refused right after the call that revokes the token that made them, and after it
expires; a client cannot choose the token its sandbox is bound to; a batch's items are
bound to its submitter's token. And cluster-wide reads are redacted to the caller's
projects (/v1/batches/admission, /v1/storage, /v1/nodes, /metrics). All on the session's
real ``dsec serve``; across two replicas: test_bound_creds_cluster.py."""

from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.request

import httpx
import pytest
from conftest import TOKEN, Platform
from e2b import Sandbox
from sqlalchemy import delete

import dsec
from dsec.control.iam.bound import TOKEN_LABEL
from dsec.control.iam.tokens import TokenStore
from dsec.shared.meta import open_db
from dsec.shared.meta.schema import tokens
from dsec.shared.wire.iam import TokenSpec
from dsec.shared.wire.jobs import JobQuota

STAT = "/filesystem.Filesystem/Stat"
ROOT = {"Authorization": "Basic cm9vdDo="}  # envd's user: root (base64 of "root:")
SMALL = dict(image="base/busybox", memory_limit_mb=64, cpu_cores_limit=0.25)


def _envd(url: str, sid: str, token: str) -> httpx.Response:
    return httpx.post(url + STAT, json={"path": "/"},
                      headers={"E2b-Sandbox-Id": sid, "X-Access-Token": token, **ROOT})


def _port(url: str, sid: str, port: int, traffic: str) -> httpx.Response:
    return httpx.get(url + "/", headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": str(port),
                                         "E2B-Traffic-Access-Token": traffic}, timeout=10)


def _until(check: object, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():  # type: ignore[operator]
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def test_revocation_ends_every_credential_derived_from_the_token(platform: Platform) -> None:
    url = platform.url
    with dsec.Client(url=url, token=TOKEN) as admin:
        made = admin.create_token("creds", "builder", "soon-revoked")
        assert made.token is not None
        tok, tok_id = made.token, made.id
        key = {"X-API-Key": tok}
        sbx = Sandbox.create("base/debian:12", timeout=120, api_key=tok, api_url=url, sandbox_url=url)
        sid = sbx.sandbox_id
        try:
            got = httpx.get(f"{url}/sandboxes/{sid}", headers=key).json()
            envd, traffic = got["envdAccessToken"], got["trafficAccessToken"]
            # each is TOKEN_ID.MAC, bound to the token that made the sandbox
            assert envd.startswith(tok_id + ".") and traffic.startswith(tok_id + ".") and envd != traffic
            assert admin.connect(sid).info.labels[TOKEN_LABEL] == tok_id

            assert sbx.commands.run("echo hi").stdout == "hi\n"  # the SDK, with the envd token
            sbx.files.write("/tmp/s.txt", "signed", user="root")
            signed = sbx.download_url("/tmp/s.txt", "root")
            with urllib.request.urlopen(signed) as resp:
                assert resp.read() == b"signed"
            sbx.commands.run("cd /tmp && python3 -m http.server 8321 >/dev/null 2>&1", background=True, user="root")
            _until(lambda: _port(url, sid, 8321, traffic).status_code == 200)
            assert _port(url, sid, 8321, envd).status_code == 401  # a traffic token is not an envd token
            # Daytona's preview link to the same port, with its own token (the bound traffic credential)
            link = httpx.get(f"{url}/daytona/sandbox/{sid}/ports/8321/preview-url",
                             headers={"Authorization": f"Bearer {tok}"}).json()
            preview = {"x-daytona-preview-token": link["token"]}
            assert link["token"].startswith(tok_id + ".")
            assert httpx.get(link["url"] + "/", headers=preview, timeout=10).status_code == 200
            own = httpx.get(f"{url}/swerex/{sid}/token", headers=key).json()["auth_token"]
            assert own.startswith(tok_id + ".")
            assert httpx.get(f"{url}/swerex/{sid}/is_alive", headers={"X-API-Key": own}).status_code == 200
            tid = httpx.post(f"{url}/v3/templates", headers=key, json={"name": "tpl-creds"}).json()["templateID"]
            up = [httpx.get(f"{url}/templates/{tid}/files/{c * 64}", headers=key).json()["url"] for c in "23"]
            assert all(u and f"signature={tok_id}." in u for u in up)
            assert httpx.put(up[0], content=b"x").status_code == 200

            ticking = sbx.commands.run("for i in $(seq 200); do echo $i; sleep 0.1; done", background=True)
            admin.revoke_token(tok_id)  # and at once, on this replica:
            t0 = time.monotonic()
            r = _envd(url, sid, envd)
            assert r.status_code == 401 and "revoked" in r.json()["message"]
            with pytest.raises(Exception, match="(?i)401|unauthori|revoked"):
                sbx.commands.run("echo hi")
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(signed)
            assert err.value.code == 401
            assert _port(url, sid, 8321, traffic).status_code == 401
            assert httpx.get(link["url"] + "/", headers=preview, timeout=10).status_code == 401
            r = httpx.get(f"{url}/swerex/{sid}/is_alive", headers={"X-API-Key": own})
            assert r.status_code == 401 and r.json()["field"] == "x-api-key"
            assert httpx.put(up[1], content=b"x").status_code == 401
            assert httpx.put(up[0], content=b"x").status_code == 401
            # a stream opened with the envd token (20 s of output) ends at the next re-check
            with pytest.raises(Exception):  # noqa: B017  (the SDK's error for a cut stream varies)
                ticking.wait()
            assert time.monotonic() - t0 < 6.0
            # the sandbox lives on for the admin's own API, but its credentials stay bound to the
            # token that made it, whoever asks for them again
            again = httpx.get(f"{url}/sandboxes/{sid}", headers={"X-API-Key": TOKEN}).json()
            assert again["envdAccessToken"] == envd and _envd(url, sid, again["envdAccessToken"]).status_code == 401
            assert admin.connect(sid).exec(["true"]).exit_code == 0
        finally:
            admin.connect(sid).stop()


def test_expiry_ends_them_too_and_the_label_is_not_the_clients(platform: Platform) -> None:
    url = platform.url
    with dsec.Client(url=url, token=TOKEN) as admin:
        short = admin.create_token("creds", "runner", "short", ttl_s=3)
        assert short.token is not None
        with dsec.Client(url=url, token=short.token) as c:
            # a label naming another token (the admin's, which never expires) is overridden
            sb = c.run_container(dsec.ContainerArgs(**SMALL, labels={TOKEN_LABEL: "admin"}))  # type: ignore[arg-type]
        try:
            assert sb.info.labels[TOKEN_LABEL] == short.id
            envd = httpx.get(f"{url}/sandboxes/{sb.sandbox_id}", headers={"X-API-Key": TOKEN}).json()["envdAccessToken"]
            own = httpx.get(f"{url}/swerex/{sb.sandbox_id}/token", headers={"X-API-Key": TOKEN}).json()["auth_token"]
            assert envd.startswith(short.id + ".") and own.startswith(short.id + ".")
            assert _envd(url, sb.sandbox_id, envd).status_code == 200
            # a forged one: the right token id, the MAC of another sandbox's
            assert _envd(url, sb.sandbox_id, short.id + "." + "0" * 40).status_code == 401
            assert _envd(url, sb.sandbox_id, "admin." + envd.split(".", 1)[1]).status_code == 401
            left = (short.expires_at or 0) - time.time()
            assert left > 0.5, "the token expired before its credentials were tried"
            time.sleep(left + 0.3)
            assert _envd(url, sb.sandbox_id, envd).status_code == 401
            r = httpx.get(f"{url}/swerex/{sb.sandbox_id}/is_alive", headers={"X-API-Key": own})
            assert r.status_code == 401
        finally:
            admin.connect(sb.sandbox_id).stop()


async def test_batches_are_bound_to_their_submitter_and_admission_counts_own_projects(platform: Platform) -> None:
    async with dsec.AsyncClient(url=platform.url, token=TOKEN) as admin:
        a_tok = await admin.create_token("creds-qa", "runner", "batcher")
        b_tok = await admin.create_token("creds-qb", "runner", "other")
        assert a_tok.token is not None and b_tok.token is not None
        async with dsec.AsyncClient(url=platform.url, token=a_tok.token) as a, \
                dsec.AsyncClient(url=platform.url, token=b_tok.token) as b:
            await a.create_job("slow", quota=JobQuota(creates_per_s=0.01))  # one now, the rest wait
            batch = await a.create_many(dsec.ContainerArgs(**SMALL), n=4, job="slow")  # type: ignore[arg-type]
            try:
                deadline = time.monotonic() + 30
                while (await batch.get()).counts.running < 1:
                    assert time.monotonic() < deadline, "the batch's first item never ran"
                    await asyncio.sleep(0.2)
                mine = await a._json("GET", "/v1/batches/admission")
                theirs = await b._json("GET", "/v1/batches/admission")
                everyone = await admin._json("GET", "/v1/batches/admission")
                assert mine["queued"] == 3 and everyone["queued"] >= 3, (mine, everyone)
                assert theirs["queued"] == 0, theirs
                (sb,) = [s for s in await a.list(job="slow") if s.state.value == "running"]
                assert sb.labels[TOKEN_LABEL] == a_tok.id  # the submitter's, not the runner's (admin)
            finally:
                await batch.cancel(stop=True)
                await batch.wait()
                await a.stop_many(job="slow")


def test_cluster_reads_are_redacted_for_a_project_token(platform: Platform) -> None:
    url = platform.url
    with dsec.Client(url=url, token=TOKEN) as admin:
        made = admin.create_token("creds-read", "runner", "reader")
        assert made.token is not None
        sb = admin.run_container(dsec.ContainerArgs(**SMALL, job="creds-secret-job"))  # type: ignore[arg-type]
        try:
            h = {"Authorization": f"Bearer {made.token}"}
            full = httpx.get(f"{url}/v1/storage", headers={"Authorization": f"Bearer {TOKEN}"}).json()
            mine = httpx.get(f"{url}/v1/storage", headers=h).json()
            assert [s["edge"] for s in mine] == [s["edge"] for s in full]
            assert all(s["blobs"] == [] for s in mine)  # blobs read from a shared store: test_ondemand
            assert [{k: v for k, v in s.items() if k.startswith("cache_max")} for s in mine] == \
                [{k: v for k, v in s.items() if k.startswith("cache_max")} for s in full]
            nodes = httpx.get(f"{url}/v1/nodes", headers=h)
            assert nodes.status_code == 200 and "creds-secret-job" not in nodes.text
            assert "creds-secret-job" in httpx.get(f"{url}/v1/nodes", headers={"Authorization": f"Bearer {TOKEN}"}).text
            assert httpx.get(f"{url}/metrics", headers=h).status_code == 403
        finally:
            sb.stop()


async def test_the_token_table_by_id_and_a_reload_that_raced_a_revocation(tmp_path: str) -> None:
    """Two replicas' token stores on one (SQLite) database: a token made on one is found by
    id on the other; a reload whose read predates this replica's revocation (the row still
    there) does not bring the token back; the other replica drops it at its next reload."""
    engine = open_db(f"sqlite:///{tmp_path}/meta.db")
    try:
        one, two = TokenStore(engine, TOKEN), TokenStore(engine, TOKEN)
        made = one.create(TokenSpec(project="creds-unit", role="runner"))
        assert made.token is not None
        cred = one.bound.mint("envd", "edge0-aaaaaaaaaaaa", made.id)
        assert await two.bound.check("envd", "edge0-aaaaaaaaaaaa", cred) == made.id  # looked up by id once
        assert await two.bound.check("envd", "edge0-bbbbbbbbbbbb", cred) is None  # another sandbox's
        assert await two.bound.check("swerex", "edge0-aaaaaaaaaaaa", cred) is None  # another purpose
        one.forget([made.id])  # revoked here; the row is still in the database a reload reads
        one._load()
        assert await one.verify(made.token.encode()) is None
        assert await one.bound.check("envd", "edge0-aaaaaaaaaaaa", cred) is None
        assert await two.live(made.id)  # not told yet
        with engine.begin() as c:  # the revocation's own delete, as one.revoke makes it
            c.execute(delete(tokens).where(tokens.c.id == made.id))
        two._load()
        assert not await two.live(made.id) and await two.verify(made.token.encode()) is None
    finally:
        engine.dispose()
