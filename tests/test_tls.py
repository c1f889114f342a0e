"""Mutual TLS on the apiserver -> edge wire (dsec.shared.tls, issue 33 part 1): a
real ``dsec edge serve`` and ``dsec apiserver`` run with ``--tls-cert --tls-key --ca``;
sandboxes are made and used through them; peers without a certificate the cluster CA
signed are refused at the handshake; certificates rotate (same CA, then a new one) while
a sandbox runs and a command is in flight, and nothing is dropped."""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import stat
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

import dsec
from dsec.shared import tls
from tests.conftest import SECRET, TOKEN, Cluster, own_cluster


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from own_cluster(tmp_path_factory, "tls-edge", tls=True)


def _edge(c: Cluster) -> str:
    return c.edges["n1"].url


def _peer_issuer(c: Cluster, client: ssl.SSLContext) -> str:
    """The issuer of the certificate the edge presents now (a new handshake)."""
    port = c.edges["n1"].port
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
            client.wrap_socket(raw, server_hostname="127.0.0.1") as s:
        cert = s.getpeercert()
    return str(dict(x[0] for x in cert["issuer"])["commonName"])


def test_keys_are_private_and_the_edge_is_https(secure: Cluster) -> None:
    assert _edge(secure).startswith("https://")
    for name in ("n1", "apiserver"):
        mode = stat.S_IMODE(os.stat(os.path.join(secure.tls_dir, name, "tls.key")).st_mode)
        assert mode == 0o600, oct(mode)
    # nothing of the key in any daemon's argv: only the paths
    for svc in (*secure.edges.values(), secure.api):
        assert svc.proc is not None
        with open(f"/proc/{svc.proc.pid}/cmdline", "rb") as f:
            assert b"PRIVATE KEY" not in f.read()


def test_sandboxes_work_through_the_tls_edge(secure: Cluster) -> None:
    with dsec.Client(url=secure.url, token=TOKEN) as c:
        sb = c.run_container(dsec.ContainerArgs(image="base/busybox"))
        try:
            r = sb.exec("echo over-tls")
            assert r.exit_code == 0 and r.stdout == "over-tls\n"
            sb.write_file("/tmp/x", b"abc")
            assert sb.read_file("/tmp/x") == b"abc"
        finally:
            sb.stop()


def test_a_peer_without_a_valid_certificate_is_refused_at_the_handshake(secure: Cluster,
                                                                        tmp_path: os.PathLike[str]) -> None:
    url, ok = _edge(secure), {"Authorization": f"Bearer {SECRET}"}
    ca = os.path.join(secure.tls_dir, "n1", "ca.crt")
    # a client that checks the edge but has no certificate of its own
    with pytest.raises(httpx.TransportError):
        httpx.post(f"{url}/v1/call/stats", json={}, headers=ok, verify=ssl.create_default_context(cafile=ca))
    # plain HTTP to the TLS port
    with pytest.raises(httpx.TransportError):
        httpx.post(url.replace("https://", "http://") + "/v1/call/stats", json={}, headers=ok)
    # a certificate another CA signed (with the right secret even)
    other_cert, other_key = tls.make_ca("another CA")
    stranger = tls.write_daemon_files(str(tmp_path), other_cert, other_cert, other_key, "stranger", ["127.0.0.1"])
    ctx = ssl.create_default_context(cafile=ca)
    ctx.load_cert_chain(stranger.cert, stranger.key)
    with pytest.raises(httpx.TransportError):
        httpx.post(f"{url}/v1/call/stats", json={}, headers=ok, verify=ctx)
    # the edge's certificate is checked by its clients too: an edge certified by another CA is not trusted
    with pytest.raises(ssl.SSLCertVerificationError):
        _peer_issuer(secure, ssl.create_default_context(cafile=stranger.ca))
    # a valid certificate is not enough: the cluster secret stays the second factor
    assert secure.probe is not None
    r = httpx.post(f"{url}/v1/call/stats", json={}, headers={"Authorization": "Bearer wrong"}, verify=secure.probe)
    assert r.status_code == 401
    assert httpx.post(f"{url}/v1/call/stats", json={}, headers=ok, verify=secure.probe).status_code == 200


async def test_rotation_drops_no_sandbox_or_request(secure: Cluster) -> None:
    assert secure.probe is not None
    async with dsec.AsyncClient(url=secure.url, token=TOKEN) as c:
        sb = await c.run_container(dsec.ContainerArgs(image="base/busybox"))
        try:
            in_flight = asyncio.create_task(sb.exec("sleep 4; echo survived", timeout=60))
            await asyncio.sleep(0.5)
            # the same CA, new certificates for both daemons
            for name in ("n1", "apiserver"):
                await asyncio.to_thread(secure.tls_files, name)
            await asyncio.sleep(2.5 * tls.RELOAD_POLL_S)
            assert (await sb.exec("echo same-ca")).stdout == "same-ca\n"
            # a new CA: first both trust the new and the old, then both get certificates it signed
            new_cert, new_key = tls.make_ca("dsec cluster CA 2")
            bundle = new_cert + secure.ca_cert
            for name in ("n1", "apiserver"):
                tls.write_private(os.path.join(secure.tls_dir, name, "ca.crt"), bundle, 0o644)
            await asyncio.sleep(2.5 * tls.RELOAD_POLL_S)
            for name in ("n1", "apiserver"):
                await asyncio.to_thread(tls.write_daemon_files, os.path.join(secure.tls_dir, name), bundle,
                                        new_cert, new_key, name, ["127.0.0.1"])
            secure.probe.load_verify_locations(cadata=new_cert.decode())  # this test's client trusts both too
            deadline = time.monotonic() + 10
            issuer = ""
            while time.monotonic() < deadline and issuer != "dsec cluster CA 2":
                await asyncio.sleep(0.3)
                issuer = await asyncio.to_thread(_peer_issuer, secure, secure.probe)
            assert issuer == "dsec cluster CA 2"  # new handshakes get the new certificate
            r = await in_flight  # the request that spanned both rotations
            assert r.exit_code == 0 and r.stdout == "survived\n"
            # new connections from the apiserver (its own new certificate) reach the edge
            assert (await sb.exec("echo new-ca")).stdout == "new-ca\n"
            assert (await sb.refresh()).state == "running"
        finally:
            await sb.stop()


def test_daemon_tls_options_are_all_or_none(tmp_path: os.PathLike[str]) -> None:
    key = os.path.join(str(tmp_path), "cluster.key")
    with open(key, "w") as f:
        f.write(SECRET)
    cli = [sys.executable, "-m", "dsec.client.cli.main"]
    r = subprocess.run([*cli, "apiserver", "--edges", "n1=https://127.0.0.1:1", "--secret-file", key,
                        "--tls-cert", key], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--tls-key" in r.stderr, r.stderr
    r = subprocess.run([*cli, "apiserver", "--edges", "n1=https://127.0.0.1:1", "--secret-file", key],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--edges" in r.stderr and "--tls-cert" in r.stderr, r.stderr
    r = subprocess.run([*cli, "edge", "serve", "--name", "n1", "--secret-file", key, "--tls-cert", key,
                        "--tls-key", key, "--ca", "/no/such/ca.crt"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--ca" in r.stderr, r.stderr


def test_an_https_edge_needs_a_client_certificate() -> None:
    from dsec.node.edge.remote.client import remote_edge

    with pytest.raises(ValueError, match="tls-cert"):
        remote_edge("n1", "https://127.0.0.1:1", SECRET)


def test_the_cluster_ca_lives_in_the_registry_and_a_new_one_is_trusted_beside_the_old(
        tmp_path: os.PathLike[str]) -> None:
    from cryptography import x509

    from dsec.control.cluster import certs
    from dsec.shared.meta import open_db
    from dsec.shared.meta.db import sqlite_url
    from dsec.shared.meta.registry import Registry

    root = str(tmp_path)
    registry = Registry(open_db(sqlite_url(root)))
    ca_dir = certs.cluster_ca(registry, root)
    assert stat.S_IMODE(os.stat(os.path.join(ca_dir, "ca.key")).st_mode) == 0o600
    assert certs.cluster_ca(registry, root) == ca_dir  # made once: the same CA again
    first = open(os.path.join(ca_dir, "ca.crt"), "rb").read()
    edge = certs.daemon_files(registry, os.path.join(root, "e1"), "e1", ["10.0.0.7"])
    cert = x509.load_pem_x509_certificate(open(edge.cert, "rb").read())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "e1" in san.get_values_for_type(x509.DNSName)
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["10.0.0.7"]
    assert stat.S_IMODE(os.stat(edge.key).st_mode) == 0o600
    certs.new_ca(registry)
    certs.trust_now(registry, os.path.join(root, "e1"))
    bundle = open(edge.ca, "rb").read()
    assert bundle.endswith(first) and len(x509.load_pem_x509_certificates(bundle)) == 2
    # a certificate of the new CA and one of the old both verify against the bundle
    old_ctx = tls.client_context(edge)  # still holds the old CA's certificate
    renewed = certs.daemon_files(registry, os.path.join(root, "e2"), "e2", ["127.0.0.1"])
    new_issuer = x509.load_pem_x509_certificate(open(renewed.cert, "rb").read()).issuer
    assert new_issuer != cert.issuer
    server = tls.server_context(renewed)
    assert old_ctx is not None and server.verify_mode == ssl.CERT_REQUIRED
