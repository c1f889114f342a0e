"""The edge's nftables table: the kernel half of sandbox egress policy.

One ``inet`` table per edge, written whole at start and changed by element updates:

- ``vifs``/``veths``: each sandbox's host-side veth and the one source address allowed on
  it (anything else arriving there, and all IPv6, is dropped: no spoofing another sandbox).
- DNS (udp/tcp 53 to anywhere) is redirected to the edge's resolver, and TCP 80/443 not
  named by a raw rule to the edge's egress gate; both learn the sandbox from the source
  address. Nothing else of the host is reachable from a sandbox (input chain).
- ``never``: destinations dropped ahead of any allow (dsec.node.edge.network.rules.NEVER: every
  sandbox on the host, loopback, link-local, multicast, reserved), whatever a rule says.
- ``cluster``/``cluster6``: the cluster's own services on every node (Ray, the database,
  edges, replicas, storage: dsec.node.edge.network.wall), refreshed every few seconds and shared
  by every sandbox of the edge; dropped in the forward chain ahead of ``never`` and every
  allow, so no rule opens them, and connections already open to an address die once it
  is added. (This host's own addresses are reached through the input chain, where
  nothing but DNS, the gate and the admin's ``host:`` rules is admitted.)
- ``raw_allow`` (sandbox . destination . proto . port, intervals): the raw ``ip:port/proto``
  rules, for destinations past the host (forward chain only). ``host_allow`` (sandbox .
  proto . port): the cluster admin's ``host:port/proto`` rules, the only way a sandbox
  reaches this host's own addresses (input chain). Everything else a sandbox sends is
  rejected and remembered in ``denied`` (dynamic, with a counter per flow) for the audit log.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import ipaddress
import json
import logging
import threading

from dsec.node.edge.network.rules import NEVER, RawRule
from dsec.shared.errors import SandboxError

log = logging.getLogger("dsec.network")


NFT_CTX_OUTPUT_JSON = 1 << 4


class LibNft:
    """libnftables, the library under the ``nft`` command: a batch costs ~0.1 ms in process
    instead of ~8 ms for a child process."""

    def __init__(self) -> None:
        name = ctypes.util.find_library("nftables")
        if name is None:
            raise OSError("libnftables is not installed (the nftables package)")
        lib = self.lib = ctypes.CDLL(name)
        lib.nft_ctx_new.restype = ctypes.c_void_p
        lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
        for fn in ("nft_ctx_buffer_output", "nft_ctx_buffer_error"):
            getattr(lib, fn).argtypes = [ctypes.c_void_p]
        for fn in ("nft_ctx_get_output_buffer", "nft_ctx_get_error_buffer"):
            getattr(lib, fn).argtypes = [ctypes.c_void_p]
            getattr(lib, fn).restype = ctypes.c_char_p
        lib.nft_ctx_output_set_flags.argtypes = [ctypes.c_void_p, ctypes.c_uint]
        lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        self.ctx = lib.nft_ctx_new(0)
        lib.nft_ctx_buffer_output(self.ctx)
        lib.nft_ctx_buffer_error(self.ctx)
        self._lock = threading.Lock()

    def run(self, script: str, as_json: bool = False) -> str:
        with self._lock:
            self.lib.nft_ctx_output_set_flags(self.ctx, NFT_CTX_OUTPUT_JSON if as_json else 0)
            rc = self.lib.nft_run_cmd_from_buffer(self.ctx, script.encode())
            out = (self.lib.nft_ctx_get_output_buffer(self.ctx) or b"").decode(errors="replace")
            err = (self.lib.nft_ctx_get_error_buffer(self.ctx) or b"").decode(errors="replace")
        if rc != 0:  # the detail names the table and its elements: for the node's log, not the caller
            log.error("nft refused a change: %s", err.strip() or "failed")
            raise SandboxError("the node's packet filter refused the change (the edge's log has the detail)")
        return out


class NftTable:
    def __init__(self, name: str, subnet: ipaddress.IPv4Network, dns_port: int, gate_port: int) -> None:
        self.name, self.subnet, self.dns_port, self.gate_port = name, subnet, dns_port, gate_port
        self.nft = LibNft()

    def ruleset(self) -> str:
        s, t = self.subnet.with_prefixlen, self.name
        never = ", ".join(n.with_prefixlen for n in NEVER)
        flow = "ipv4_addr . ipv4_addr . inet_proto . inet_service"
        deny = ("update @denied { ip saddr . ip daddr . meta l4proto . th dport counter }"
                " reject with icmpx admin-prohibited")
        return f"""
table inet {t}
delete table inet {t}
table inet {t} {{
  set vifs {{ type ifname; }}
  set veths {{ type ifname . ipv4_addr; }}
  set raw_allow {{ type {flow}; flags interval; }}
  set host_allow {{ type ipv4_addr . inet_proto . inet_service; flags interval; }}
  set cluster {{ type ipv4_addr; flags interval; }}
  set cluster6 {{ type ipv6_addr; flags interval; }}
  set never {{ type ipv4_addr; flags interval; elements = {{ {never} }} }}
  set denied {{ type {flow}; size 65535; flags dynamic,timeout; timeout 1h; }}
  chain guard {{ type filter hook prerouting priority raw; policy accept;
    iifname @vifs meta nfproto ipv6 drop
    iifname @vifs iifname . ip saddr != @veths drop
  }}
  chain steer {{ type nat hook prerouting priority dstnat; policy accept;
    ip saddr {s} meta l4proto {{ tcp, udp }} th dport 53 redirect to :{self.dns_port}
    ip saddr {s} fib daddr type local ip saddr . meta l4proto . th dport @host_allow accept
    ip saddr {s} ip saddr . ip daddr . meta l4proto . th dport @raw_allow accept
    ip saddr {s} tcp dport {{ 80, 443 }} redirect to :{self.gate_port}
  }}
  chain input {{ type filter hook input priority filter; policy accept;
    ip saddr {s} ct status dnat meta l4proto {{ tcp, udp }} th dport {{ {self.dns_port}, {self.gate_port} }} accept
    ip saddr {s} ip saddr . meta l4proto . th dport @host_allow accept
    ip saddr {s} ct state established,related accept
    ip saddr {s} {deny}
    ip saddr != {s} meta l4proto {{ tcp, udp }} th dport {{ {self.dns_port}, {self.gate_port} }} drop
  }}
  chain forward {{ type filter hook forward priority filter; policy accept;
    ip daddr {s} ct state established,related accept
    ip saddr {s} ip daddr @cluster {deny}
    iifname @vifs ip6 daddr @cluster6 drop
    ip saddr {s} ip daddr @never {deny}
    ip saddr {s} ip saddr . ip daddr . meta l4proto . th dport @raw_allow accept
    ip saddr {s} {deny}
    ip daddr {s} drop
  }}
  chain out {{ type nat hook postrouting priority srcnat; policy accept;
    ip saddr {s} ip daddr != {s} masquerade
  }}
}}
"""

    async def apply(self, script: str) -> None:
        self.nft.run(script)

    async def install(self) -> None:
        await self.apply(self.ruleset())

    def remove_stale(self) -> list[str]:
        """Delete other dsec tables that steer this table's subnet: left by an edge that
        died without cleaning up (its subnet lock is free again, which is how this edge got
        the subnet), they would redirect this edge's sandboxes' DNS and web traffic to
        ports nothing serves any more. Returns the tables removed."""
        listed = json.loads(self.nft.run("list tables", as_json=True) or "{}")
        names = [t["table"]["name"] for t in listed.get("nftables", [])
                 if "table" in t and t["table"].get("family") == "inet"]
        gone = []
        for name in names:
            if name == self.name or not name.startswith("dsec_"):
                continue
            with contextlib.suppress(SandboxError):  # raced with its own removal
                if f"ip saddr {self.subnet.with_prefixlen} " in self.nft.run(f"list table inet {name}"):
                    self.nft.run(f"delete table inet {name}")
                    gone.append(name)
        return gone

    async def remove(self) -> None:
        await self.apply(f"table inet {self.name}\ndelete table inet {self.name}\n")

    def set_cluster(self, nets: list[ipaddress.IPv4Network | ipaddress.IPv6Network]) -> str:
        """The nft script that makes the ``cluster`` sets hold ``nets`` (collapsed: an
        interval set refuses overlapping elements), in one transaction: no moment without."""
        t = self.name
        lines = [f"flush set inet {t} cluster", f"flush set inet {t} cluster6"]
        for name, version in (("cluster", 4), ("cluster6", 6)):
            part = [n.with_prefixlen for n in nets if n.version == version]
            if part:
                lines.append(f"add element inet {t} {name} {{ {', '.join(part)} }}")
        return "\n".join(lines) + "\n"

    def set_sandbox(self, ifname: str, ip: str, old: list[RawRule], new: list[RawRule], add_if: bool) -> str:
        """The nft script that moves sandbox ``ip`` from rules ``old`` to ``new``."""
        t = self.name
        lines = []
        if add_if:
            lines += [f"add element inet {t} vifs {{ {json.dumps(ifname)} }}",
                      f"add element inet {t} veths {{ {json.dumps(ifname)} . {ip} }}"]
        lines += self._elements("delete", ip, [r for r in old if r not in new])
        lines += self._elements("add", ip, [r for r in new if r not in old])
        return "\n".join(lines) + "\n"

    def _elements(self, verb: str, ip: str, rules: list[RawRule]) -> list[str]:
        """``verb`` (add/delete) the elements of ``rules`` for sandbox ``ip`` in their sets."""
        out = []
        for name, part in (("raw_allow", [r for r in rules if r.net is not None]),
                           ("host_allow", [r for r in rules if r.net is None])):
            if part:
                out.append(f"{verb} element inet {self.name} {name} {{ {', '.join(r.element(ip) for r in part)} }}")
        return out

    def drop_sandbox(self, ifname: str, ip: str, rules: list[RawRule]) -> str:
        t = self.name
        lines = [f"delete element inet {t} vifs {{ {json.dumps(ifname)} }}",
                 f"delete element inet {t} veths {{ {json.dumps(ifname)} . {ip} }}"]
        lines += self._elements("delete", ip, rules)
        return "\n".join(lines) + "\n"

    async def denied(self) -> list[tuple[str, str, str, int, int]]:
        """Flows rejected so far: (sandbox ip, destination, proto, port, packets)."""
        try:
            out = self.nft.run(f"list set inet {self.name} denied", as_json=True)
        except SandboxError:
            return []
        flows = []
        for item in json.loads(out or "{}").get("nftables", []):
            for el in (item.get("set") or {}).get("elem", []):
                e = el.get("elem", el)
                val = e.get("val", e)
                parts = val.get("concat") if isinstance(val, dict) else None
                if not parts or len(parts) != 4:
                    continue
                packets = int(((e.get("counter") or {}).get("packets")) or 0)
                flows.append((str(parts[0]), str(parts[1]), str(parts[2]), int(parts[3]), packets))
        return flows
