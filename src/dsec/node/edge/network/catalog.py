"""The service catalog: which host names a named service (``pypi``, ``npm``, ``debian``)
stands for on this node.

The built-in services take their hosts from the node's own package-manager configuration
(pip's index URLs and its default index, npm's registry, apt's sources), so no registry
host name is written into dsec; operators add services of their own (``--egress-service
name=host,*.suffix``). A pattern is an exact host or ``*.suffix`` (any subdomain).
"""

from __future__ import annotations

import glob
import logging
import os
import re
import shutil
import subprocess
import sys
from urllib.parse import urlsplit

log = logging.getLogger("dsec.network")

_SERVICE_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")
_HOST_PATTERN = re.compile(r"^(\*\.)?[a-z0-9]([a-z0-9-]{0,62}\.)*[a-z0-9-]{1,63}$")


def _hosts_of(urls: list[str]) -> list[str]:
    out = []
    for u in urls:
        parts = urlsplit(u.strip())
        if parts.scheme in ("http", "https") and parts.hostname:
            out.append(parts.hostname.lower())
    return out


def _run(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=20, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def pip_config() -> dict[str, str]:
    """pip's effective settings on this node (files and PIP_* variables), by option name."""
    python = shutil.which("python3") or sys.executable
    out: dict[str, str] = {}
    for line in _run([python, "-m", "pip", "config", "list"]).splitlines():
        key, _, value = line.partition("=")
        out[key.rsplit(".", 1)[-1]] = value.strip().strip("'\"")
    return out


def pip_hosts(conf: dict[str, str]) -> list[str]:
    """Index hosts from pip's configuration; pip's own default index and file host when
    no index-url replaces it (asked of pip itself)."""
    index = conf.get("index-url", "").split()
    hosts = _hosts_of(index + conf.get("extra-index-url", "").split())
    if not index:
        python = shutil.which("python3") or sys.executable
        default = _run([python, "-c", "from pip._internal.models.index import PyPI;"
                        "print(PyPI.simple_url); print('https://' + PyPI.file_storage_domain)"])
        hosts += _hosts_of(default.split())
    return sorted(set(hosts))


def ca_bundle(conf: dict[str, str]) -> str | None:
    """The CA bundle this node's package managers trust (pip's ``cert``, else the usual
    variables): sandboxes with network get it, so an egress proxy's CA works there too."""
    for cand in (conf.get("cert"), os.environ.get("SSL_CERT_FILE"), os.environ.get("REQUESTS_CA_BUNDLE")):
        if cand and os.path.isfile(cand):
            return cand
    return None


def npm_hosts() -> list[str]:
    npm = shutil.which("npm")
    return _hosts_of([_run([npm, "config", "get", "registry"])]) if npm else []


def apt_hosts() -> list[str]:
    urls: list[str] = []
    for path in ["/etc/apt/sources.list", *sorted(glob.glob("/etc/apt/sources.list.d/*"))]:
        if not os.path.isfile(path) or not path.endswith((".list", ".sources")):
            continue
        with open(path, errors="replace") as f:
            for line in f:
                line = line.split("#", 1)[0].strip()
                if line.startswith("URIs:"):
                    urls += line[5:].split()
                elif line.startswith(("deb ", "deb-src ")):
                    urls += [w for w in line.split()[1:] if "://" in w][:1]
    return sorted(set(_hosts_of(urls)))


def parse_service(spec: str) -> tuple[str, list[str]]:
    """``name=host,*.suffix`` from the command line."""
    name, _, hosts = spec.partition("=")
    name = name.strip().lower()
    patterns = [h.strip().lower() for h in hosts.split(",") if h.strip()]
    if not _SERVICE_NAME.match(name):
        raise ValueError(f"service name {name!r}: lowercase letters, digits, - and _")
    bad = [p for p in patterns if not _HOST_PATTERN.match(p)]
    if not patterns or bad:
        raise ValueError(f"service {name!r}: give host names or *.suffix patterns, not {bad or hosts!r}")
    return name, patterns


class ServiceCatalog:
    def __init__(self, services: dict[str, list[str]]) -> None:
        self.services = {k: sorted(set(v)) for k, v in services.items() if v}
        self.ca_bundle: bytes | None = None  # contents, read once per edge start

    @classmethod
    def from_node(cls, extra: list[str] | None = None) -> ServiceCatalog:
        conf = pip_config()
        services = {"pypi": pip_hosts(conf), "npm": npm_hosts(), "debian": apt_hosts()}
        for spec in extra or []:
            name, patterns = parse_service(spec)
            services[name] = patterns
        cat = cls(services)
        if path := ca_bundle(conf):
            with open(path, "rb") as f:
                cat.ca_bundle = f.read()
        log.info("egress services: %s", cat.services)
        return cat

    def __contains__(self, name: str) -> bool:
        return name in self.services

    def patterns(self, names: list[str]) -> list[str]:
        return sorted({p for n in names for p in self.services.get(n, [])})


def host_allowed(host: str, patterns: list[str]) -> bool:
    host = host.lower().rstrip(".")
    for p in patterns:
        if p.startswith("*."):
            if host.endswith(p[1:]):
                return True
        elif host == p:
            return True
    return False
