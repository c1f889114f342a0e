"""E2B's network options as dsec egress rules: ``allow_internet_access`` and
``network.allowOut`` / ``network.denyOut`` at create, and ``PUT /sandboxes/{id}/network``.

dsec allows by list (docs/network.md): a sandbox reaches the services and raw
``ip[/len]:port-range/proto`` keys its rules name, and nothing else. E2B denies by list on
top of "everything". The two meet where E2B names the internet: what "the internet" is on
a dsec node is the operator's choice, ``DSEC_E2B_INTERNET`` (dsec rule keys, comma
separated; empty by default, so a default E2B create wires no network link and costs no
more than before). An IP or CIDR in ``allowOut`` becomes TCP and UDP rules to every port;
``0.0.0.0/0`` means the internet list. What dsec cannot say is refused with a 400 naming the
field rather than half-honoured: a host name (dsec's services are named by the operator,
not resolved per sandbox), and a deny that carves into an allowed internet (dsec has no
deny rules)."""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping

from pydantic import BaseModel, Field

from dsec.shared.errors import InvalidRequest
from dsec.shared.wire.models import check_network_rules

ALL = "0.0.0.0/0"
INTERNET_ENV = "DSEC_E2B_INTERNET"
MAX_ENTRIES = 32  # two rules an entry (tcp, udp), and dsec's cap is 64 rules


class NetworkOpts(BaseModel):
    """The part of E2B's ``network`` (create) and its update body that dsec serves; the rest
    (DNS servers, an egress proxy, header transforms) is accepted and has no effect here."""

    allowOut: list[str] = Field(default_factory=list, max_length=MAX_ENTRIES)
    denyOut: list[str] = Field(default_factory=list, max_length=MAX_ENTRIES)
    model_config = {"extra": "ignore"}


class NetworkUpdate(NetworkOpts):
    allow_internet_access: bool | None = None


def internet(env: Mapping[str, str] | None = None) -> list[str]:
    """The operator's "internet" as dsec rule keys (``DSEC_E2B_INTERNET``, say ``pypi,npm``)."""
    raw = (env if env is not None else os.environ).get(INTERNET_ENV, "")
    keys = [k.strip() for k in raw.split(",") if k.strip()]
    try:
        check_network_rules(dict.fromkeys(keys, True))
    except ValueError as e:
        raise InvalidRequest(f"{INTERNET_ENV} (the operator's setting): {e}", field="allow_internet_access") from None
    return keys


def _network(entry: str, field: str) -> ipaddress.IPv4Network:
    try:
        net = ipaddress.ip_network(entry.strip(), strict=False)
    except ValueError:
        raise InvalidRequest(f"{field}: {entry!r} is not an IPv4 address or CIDR; dsec allows host names only as "
                             f"the operator's services (DSEC_E2B_INTERNET, docs/network.md)", field=field) from None
    if not isinstance(net, ipaddress.IPv4Network):
        raise InvalidRequest(f"{field}: {entry!r}: sandboxes have IPv4 egress only", field=field)
    return net


def rules(allow_internet: bool | None, opts: NetworkOpts | None,
          env: Mapping[str, str] | None = None) -> dict[str, bool] | None:
    """The dsec rules an E2B create asks for; None when it asks for nothing dsec can give
    (no link at all: the sandbox has loopback only, as every E2B create had before)."""
    opts = opts or NetworkOpts()
    allow = [_network(e, "network.allowOut") for e in opts.allowOut]
    deny = [_network(e, "network.denyOut") for e in opts.denyOut]
    everything = ipaddress.IPv4Network(ALL)
    # E2B: allow_internet_access=False is denyOut ["0.0.0.0/0"]; allowOut wins over denyOut
    net_on = (allow_internet is not False and everything not in deny) or everything in allow
    if net_on and deny and everything not in allow:
        raise InvalidRequest("network.denyOut: dsec allows by list and has no deny rules: deny everything "
                             f"({ALL}) and allow what the sandbox needs in allowOut", field="network.denyOut")
    keys: dict[str, bool] = {}
    if net_on:
        keys.update(dict.fromkeys(internet(env), True))
    for net in allow:
        if net != everything:
            for proto in ("tcp", "udp"):
                keys[f"{net.with_prefixlen if net.prefixlen < 32 else net.network_address}:1-65535/{proto}"] = True
    if not keys and not opts.allowOut and not opts.denyOut:
        return None
    return check_network_rules(keys)


def changes(now: Mapping[str, bool], wanted: Mapping[str, bool]) -> dict[str, bool]:
    """What ``POST /v1/sandboxes/{id}/network`` takes to go from ``now`` to ``wanted``:
    E2B's update replaces the whole set."""
    out = {k: False for k, on in now.items() if on and not wanted.get(k)}
    out.update({k: True for k, on in wanted.items() if on and not now.get(k)})
    return out
