"""The cluster's certificates (mutual TLS between replicas and edges, dsec.shared.tls):
where the cluster CA lives, how a daemon gets its certificate, and how they rotate.

The CA is made once by ``dsec cluster up`` and kept in the cluster's registry (next to
the cluster secret and the admin token, which hold the same trust: whoever reads the
cluster's database can already command every edge), with a copy under
DATA_ROOT/tls on the node ``up`` ran on (the key 0600) for daemons run by hand. Each
daemon makes its own key on its own node and signs its certificate with that CA, for its
name and the addresses it is reached at; keys go to files 0600, never argv or env.

Rotation (``dsec cluster rotate-certs``): every daemon first trusts the new bundle (the
new CA and the old), then gets a new certificate; each reloads its files while it runs.
"""

from __future__ import annotations

import json
import os

from dsec.shared import tls
from dsec.shared.meta.registry import Registry

CA_SETTING = "tls_ca"  # {"cert": PEM, "key": PEM}: the CA that signs certificates now
TRUST_SETTING = "tls_ca_trust"  # PEM bundle every daemon trusts: the CA, and the one before during a rotation


def _ca(registry: Registry) -> tuple[bytes, bytes, bytes]:
    """(CA cert, CA key, trust bundle); the CA made if the cluster has none."""
    raw = registry.setting(CA_SETTING)
    if raw is None:  # (two makers at once: the first written wins, both use it)
        cert, key = tls.make_ca()
        raw = registry.setting_once(CA_SETTING, json.dumps({"cert": cert.decode(), "key": key.decode()}))
    ca = json.loads(raw)
    trust = registry.setting(TRUST_SETTING) or ca["cert"]
    return ca["cert"].encode(), ca["key"].encode(), trust.encode()


def cluster_ca(registry: Registry, data_root: str) -> str:
    """The cluster's CA (made on first use), with its files under DATA_ROOT/tls on this node:
    ``ca.crt`` (the trust bundle) and ``ca.key`` (0600). Returns that directory."""
    cert, key, trust = _ca(registry)
    directory = os.path.join(data_root, "tls")
    tls.write_private(os.path.join(directory, "ca.key"), key)
    tls.write_private(os.path.join(directory, "ca.crt"), trust, 0o644)
    return directory


def daemon_files(registry: Registry, directory: str, name: str, hosts: list[str]) -> tls.TLSFiles:
    """A new certificate for the daemon ``name`` reached at ``hosts``, in ``directory``."""
    cert, key, trust = _ca(registry)
    return tls.write_daemon_files(directory, trust, cert, key, name, hosts)


def trust_now(registry: Registry, directory: str) -> None:
    """The current trust bundle into a daemon's ``ca.crt`` (phase one of a rotation)."""
    _, _, trust = _ca(registry)
    tls.write_private(os.path.join(directory, "ca.crt"), trust, 0o644)


def new_ca(registry: Registry) -> None:
    """A new CA signs from now on; the trust bundle holds it and the one before (the CA
    before that is dropped: one rotation at a time)."""
    old_cert, _, _ = _ca(registry)
    cert, key = tls.make_ca()
    registry.put_setting(TRUST_SETTING, cert.decode() + old_cert.decode())
    registry.put_setting(CA_SETTING, json.dumps({"cert": cert.decode(), "key": key.decode()}))
