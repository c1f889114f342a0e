"""A private PostgreSQL (Debian's postgresql-15) for a cluster that brings no database of
its own, and for the tests: a fresh data dir owned by the ``postgres`` user (the server
refuses to run as root), listening on the address given, admitting (pg_hba.conf, with a
password: scram-sha-256) dsec's user from the networks of that address and those named,
over TLS only (``hostssl``: a server certificate made at init; the URL asks for
``sslmode=require&channel_binding=require``, and SCRAM's channel binding proves the server
holds the password's verifier, so clients need no CA). Loopback and the unix socket are
initdb's, as before. A data dir made before TLS gets its certificate at its next start.
``dsec cluster up`` without ``--db`` runs it under a Ray actor on the node it runs on."""

from __future__ import annotations

import contextlib
import glob
import ipaddress
import json
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Iterable, Sequence

USER = "postgres"
DB_USER = "dsec"
# how long a start may take: a server killed uncleanly replays its WAL first (crash
# recovery), which on a large database takes minutes; it is never cut short before this
START_TIMEOUT_S = 3600.0


def bin_dir() -> str:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"))
    if not found:
        raise RuntimeError("PostgreSQL is not installed (Debian: apt-get install postgresql-15)")
    return os.path.dirname(found[-1])


def _as_postgres(argv: list[str]) -> subprocess.CompletedProcess[str]:
    pw = pwd.getpwnam(USER)
    out = subprocess.run(argv, user=pw.pw_uid, group=pw.pw_gid, capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        why = (out.stderr or out.stdout).strip()[-800:]
        hint = (f" (the {USER} user must be able to reach every directory above the data dir)"
                if "ermission denied" in why or "could not change directory" in why else "")
        raise RuntimeError(f"{os.path.basename(argv[0])} failed: {why}{hint}")
    return out


def init(data_dir: str) -> str:
    """A database cluster in ``data_dir`` (kept if it exists); returns dsec's password."""
    pw = pwd.getpwnam(USER)
    pass_file = os.path.join(os.path.dirname(data_dir.rstrip("/")), os.path.basename(data_dir) + ".password")
    if os.path.exists(os.path.join(data_dir, "PG_VERSION")):
        server_cert(data_dir)  # (a data dir from before TLS: its certificate now)
        with open(pass_file) as f:
            return f.read().strip()
    password = secrets.token_urlsafe(24)
    os.makedirs(data_dir, exist_ok=True)
    os.chown(data_dir, pw.pw_uid, pw.pw_gid)
    os.chmod(data_dir, 0o700)
    tmp = data_dir.rstrip("/") + ".pwtmp"  # initdb wants the data dir empty
    with open(tmp, "w") as f:
        f.write(password + "\n")
    os.chown(tmp, pw.pw_uid, pw.pw_gid)
    try:
        _as_postgres([os.path.join(bin_dir(), "initdb"), "-D", data_dir, "-U", DB_USER, "--pwfile", tmp,
                      "--auth-local=trust", "--auth-host=scram-sha-256", "-E", "UTF8", "--no-instructions"])
    finally:
        os.unlink(tmp)
    fd = os.open(pass_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(password + "\n")
    server_cert(data_dir)
    return password


CERT, KEY = "server.crt", "server.key"


def server_cert(data_dir: str) -> None:
    """The server's TLS certificate (self-signed: clients check the server through SCRAM's
    channel binding, not a CA) in the data dir, its key 0600 and the server's own, made
    once."""
    from dsec.shared import tls

    if os.path.exists(os.path.join(data_dir, CERT)) and os.path.exists(os.path.join(data_dir, KEY)):
        return
    ca_cert, ca_key = tls.make_ca("dsec private PostgreSQL")
    cert, key = tls.issue(ca_cert, ca_key, "postgres", [socket.gethostname()])
    pw = pwd.getpwnam(USER)
    for name, data, mode in ((KEY, key, 0o600), (CERT, cert + ca_cert, 0o644)):
        tls.write_private(os.path.join(data_dir, name), data, mode)
        os.chown(os.path.join(data_dir, name), pw.pw_uid, pw.pw_gid)


HBA_BEGIN = "# dsec: the cluster's networks (rewritten at every start of the cluster)"
HBA_END = "# dsec: end"
ANY_HOST = ("0.0.0.0", "::", "*", "")


def _local_networks() -> list[ipaddress.IPv4Interface | ipaddress.IPv6Interface]:
    """This host's addresses with their prefixes, loopback and link-local left out. (``ip``,
    not pyroute2: this runs in Ray's actors, whose event loop cannot open a netlink socket.)"""
    links = json.loads(subprocess.run(["ip", "-j", "addr"], capture_output=True, text=True, check=True,
                                      timeout=30).stdout or "[]")
    out = []
    for link in links:
        for a in link.get("addr_info", []):
            iface = ipaddress.ip_interface(f"{a['local']}/{a['prefixlen']}")
            if not (iface.ip.is_loopback or iface.ip.is_link_local):
                out.append(iface)
    return out


def networks(host: str, extra: Iterable[str] = ()) -> list[str]:
    """The networks whose nodes may connect: the subnet of the interface that carries
    ``host`` (every non-loopback subnet of this node when it listens on all addresses),
    and ``extra`` (CIDRs: nodes routed from elsewhere). ValueError naming a bad CIDR."""
    nets: list[str] = []
    if host in ANY_HOST:
        ips = None
    else:
        try:
            ips = {ipaddress.ip_address(info[4][0]) for info in socket.getaddrinfo(host, None)}
        except (socket.gaierror, ValueError) as e:
            raise ValueError(f"listen address {host!r} does not resolve: {e}") from None
    for iface in _local_networks():
        if ips is None or iface.ip in ips:
            nets.append(str(iface.network))
    if ips is not None:  # an address no interface here carries (behind NAT, say): itself at least
        nets += [f"{ip}/{ip.max_prefixlen}" for ip in ips if not ip.is_loopback
                 and not any(ip in ipaddress.ip_network(n) for n in nets)]
    for cidr in extra:
        try:
            nets.append(str(ipaddress.ip_network(cidr.strip(), strict=False)))
        except ValueError:
            raise ValueError(f"--db-allow {cidr!r} is not a network (10.0.0.0/16, fd00::/64)") from None
    return list(dict.fromkeys(nets))


def admit(data_dir: str, nets: Sequence[str]) -> bool:
    """Write dsec's block of pg_hba.conf to admit dsec's user to its database from ``nets``
    with a password (scram-sha-256), replacing the block written before; the rest of the
    file (initdb's local and loopback lines) is kept. Returns whether the file changed (a
    running server then needs a reload: SIGHUP)."""
    path = os.path.join(data_dir, "pg_hba.conf")
    with open(path) as f:
        before = f.read()
    lines = before.splitlines()
    if HBA_BEGIN in lines and HBA_END in lines[lines.index(HBA_BEGIN):]:
        start = lines.index(HBA_BEGIN)
        end = lines.index(HBA_END, start)
        kept = lines[:start] + lines[end + 1:]
    else:
        kept = lines
    # hostssl: from the network, TLS or nothing (a plain connection matches no line: refused)
    block = [HBA_BEGIN, *(f"hostssl    dsec    {DB_USER}    {n}    scram-sha-256" for n in nets), HBA_END]
    text = "\n".join(kept + block) + "\n"
    if before == text:
        return False
    pw = pwd.getpwnam(USER)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.chown(tmp, pw.pw_uid, pw.pw_gid)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
    return True


def argv(data_dir: str, host: str, port: int) -> list[str]:
    """The server's command line (run it as the ``postgres`` user)."""
    return [os.path.join(bin_dir(), "postgres"), "-D", data_dir, "-h", host, "-p", str(port),
            "-k", data_dir, "-c", "max_connections=400", "-c", "fsync=on", "-c", "listen_addresses=" + host,
            "-c", "ssl=on", "-c", f"ssl_cert_file={os.path.join(data_dir, CERT)}",
            "-c", f"ssl_key_file={os.path.join(data_dir, KEY)}", "-c", "password_encryption=scram-sha-256"]


def create_database(data_dir: str, port: int) -> None:
    out = _as_postgres([os.path.join(bin_dir(), "psql"), "-h", data_dir, "-p", str(port), "-U", DB_USER, "-d",
                        "postgres", "-tAc", "SELECT 1 FROM pg_database WHERE datname='dsec'"])
    if out.stdout.strip() != "1":
        _as_postgres([os.path.join(bin_dir(), "createdb"), "-h", data_dir, "-p", str(port), "-U", DB_USER, "dsec"])


def ready(data_dir: str, port: int) -> bool:
    """Whether the server accepts queries: pg_isready on its socket says so only once it
    is up and out of crash recovery (a TCP accept, or "the database system is starting up",
    is not ready)."""
    try:
        out = subprocess.run([os.path.join(bin_dir(), "pg_isready"), "-q", "-h", data_dir, "-p", str(port),
                              "-t", "2"], capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    return out.returncode == 0


def state(log_path: str) -> str:
    """What the server said last (its log's last line): recovery's progress while it starts."""
    with contextlib.suppress(OSError), open(log_path, "rb") as f:
        f.seek(max(0, os.path.getsize(log_path) - 2000))
        lines = [ln for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
        return lines[-1].strip() if lines else "starting"
    return "starting"


def advertised(host: str) -> str:
    """The address others reach a server bound to ``host`` at: ``host`` itself, or, bound
    to every address, the one this node reaches the outside by."""
    if host not in ANY_HOST:
        return host
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: the kernel picks the route's source
            return str(s.getsockname()[0])
        except OSError:
            return socket.gethostname()


def url(host: str, port: int, password: str) -> str:
    # TLS, and SCRAM bound to that TLS channel: a server that is not ours cannot answer it
    return f"postgresql://{DB_USER}:{password}@{host}:{port}/dsec?sslmode=require&channel_binding=require"


class Postgres:
    """One private server: ``start()`` returns its URL, ``stop()`` ends it (fast shutdown)."""

    def __init__(self, data_dir: str, host: str = "127.0.0.1", port: int = 5433, allow: Sequence[str] = ()) -> None:
        self.data_dir, self.host, self.port, self.allow = data_dir, host, port, allow
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> str:
        password = init(self.data_dir)
        admit(self.data_dir, networks(self.host, self.allow))
        pw = pwd.getpwnam(USER)
        log_path = self.data_dir.rstrip("/") + ".log"
        with open(log_path, "ab") as logf:
            os.chown(log_path, pw.pw_uid, pw.pw_gid)
            self.proc = subprocess.Popen(argv(self.data_dir, self.host, self.port), user=pw.pw_uid, group=pw.pw_gid,
                                         stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready(self.data_dir, self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"PostgreSQL did not start; see {log_path}")
            time.sleep(0.1)
        create_database(self.data_dir, self.port)
        return url(advertised(self.host), self.port, password)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(2)  # SIGINT: fast shutdown
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)
