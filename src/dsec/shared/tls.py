"""Mutual TLS on the apiserver -> edge wire: the cluster CA, the certificate of each
daemon, and the SSL contexts both ends use (docs/cluster.md, "TLS").

- ``make_ca`` / ``issue``: a cluster CA (EC P-256, ten years) and a daemon certificate
  it signs, for a name and the addresses it is reached at (all in the SAN). A daemon's
  key is made where it is used and written 0600; keys are only ever passed as file paths.
- ``TLSFiles``: the three files a daemon runs with (its cert, its key, the CA bundle it
  trusts: one CA, or the new and the old one during a CA rotation).
- ``server_context`` / ``client_context``: an edge requires a client certificate the CA
  signed; an apiserver presents its own and checks the edge's against the CA and the
  address in its URL. A peer without one is refused at the handshake.
- ``Reloader``: watches a daemon's files and loads a rotated cert/key/CA into the same
  SSLContext objects, so new connections use them while open ones (and the sandboxes)
  carry on: ``dsec cluster rotate-certs`` drops nothing.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import logging
import os
import secrets
import ssl
import threading
from typing import TYPE_CHECKING

from pydantic import BaseModel

if TYPE_CHECKING:  # imported where used: the edge's start-up does not load cryptography
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec

log = logging.getLogger("dsec.edge.remote")
CERT_DAYS = 365
CA_DAYS = 3650
RELOAD_POLL_S = 1.0


class TLSFiles(BaseModel):
    cert: str
    key: str
    ca: str

    def check(self) -> None:
        """Each file readable, else ValueError naming the option (``--tls-cert``...)."""
        for opt, path in (("--tls-cert", self.cert), ("--tls-key", self.key), ("--ca", self.ca)):
            try:
                with open(path, "rb"):
                    pass
            except OSError as e:
                raise ValueError(f"{opt} {path}: {e.strerror}") from None


def write_private(path: str, data: bytes, mode: int = 0o600) -> None:
    """``data`` into ``path`` atomically (a reader sees the old file or the new one), made
    with ``mode`` from the start: a key is never readable by others, not even for a moment."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def make_ca(common_name: str | None = None) -> tuple[bytes, bytes]:
    """A new CA: (cert PEM, key PEM). Each its own name by default (``dsec cluster CA
    <random>``): during a rotation two CAs are trusted at once, and a chain is then found by
    name (and key id) without a doubt which one signed it."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    common_name = common_name or f"dsec cluster CA {secrets.token_hex(4)}"
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = _now()
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return _pem(cert, key)


def _pem(cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> tuple[bytes, bytes]:
    """(cert PEM, unencrypted PKCS8 key PEM): the key file is 0600, written by path only."""
    from cryptography.hazmat.primitives import serialization

    return (cert.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()))


def issue(ca_cert_pem: bytes, ca_key_pem: bytes, name: str, hosts: list[str]) -> tuple[bytes, bytes]:
    """A daemon certificate for ``name`` and ``hosts`` (names or IP addresses, all in the
    SAN), good for both ends of a TLS connection: (cert PEM, key PEM)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca_cert = x509.load_pem_x509_certificate(ca_cert_pem)
    ca_key = serialization.load_pem_private_key(ca_key_pem, None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ValueError("the cluster CA's key is not an EC key")
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = []
    for h in dict.fromkeys([name, *hosts]):  # once each, in order
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h.strip("[]"))))
        except ValueError:
            sans.append(x509.DNSName(h))
    now = _now()
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return _pem(cert, key)


def write_daemon_files(directory: str, ca_bundle_pem: bytes, ca_cert_pem: bytes, ca_key_pem: bytes, name: str,
                       hosts: list[str]) -> TLSFiles:
    """A fresh cert and key for a daemon in ``directory`` (``tls.crt``, ``tls.key`` 0600,
    ``ca.crt``: the bundle it trusts). The CA bundle is written first, then the key and
    the cert: a reloading daemon reads a matching pair (it retries on a mismatch)."""
    cert, key = issue(ca_cert_pem, ca_key_pem, name, hosts)
    files = TLSFiles(cert=os.path.join(directory, "tls.crt"), key=os.path.join(directory, "tls.key"),
                     ca=os.path.join(directory, "ca.crt"))
    write_private(files.ca, ca_bundle_pem, 0o644)
    write_private(files.key, key)
    write_private(files.cert, cert, 0o644)
    return files


def server_context(files: TLSFiles) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.verify_mode = ssl.CERT_REQUIRED  # no client certificate the CA signed: no connection
    ctx.load_cert_chain(files.cert, files.key)
    ctx.load_verify_locations(files.ca)
    return ctx


def client_context(files: TLSFiles) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=files.ca)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = True  # the edge's URL host (its address or name) must be in its SAN
    ctx.load_cert_chain(files.cert, files.key)
    return ctx


def _stamp(files: TLSFiles) -> tuple[tuple[int, int, int], ...]:
    out = []
    for p in (files.cert, files.key, files.ca):
        try:
            st = os.stat(p)
            out.append((st.st_mtime_ns, st.st_size, st.st_ino))
        except OSError:
            out.append((0, 0, 0))
    return tuple(out)


class Reloader:
    """Loads ``files`` into ``contexts`` again whenever one of them changes (polled every
    RELOAD_POLL_S in a thread of its own). The same SSLContext objects stay in use, so the
    aiohttp server and clients that hold them need no restart: each new handshake takes
    the new chain, connections already open go on. A CA bundle that gained a CA is added
    to what the context trusts (OpenSSL keeps the ones it had: the old CA stays trusted
    until the daemon restarts, which is what a CA rotation needs in between)."""

    def __init__(self, files: TLSFiles, contexts: list[ssl.SSLContext], poll_s: float = RELOAD_POLL_S) -> None:
        self.files, self.contexts, self.poll_s = files, contexts, poll_s
        self.reloads = 0
        self._seen = _stamp(files)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tls-reload", daemon=True)

    def start(self) -> Reloader:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def check(self) -> bool:
        """Reload now if a file changed; whether it did."""
        now = _stamp(self.files)
        if now == self._seen:
            return False
        try:
            for ctx in self.contexts:
                ctx.load_verify_locations(self.files.ca)
                ctx.load_cert_chain(self.files.cert, self.files.key)
        except (OSError, ssl.SSLError) as e:  # mid-rotation (a cert before its key): the next poll
            log.warning("TLS files not reloaded yet: %s", e)
            return False
        self._seen = now
        self.reloads += 1
        log.info("TLS certificate reloaded from %s", self.files.cert)
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.check()
