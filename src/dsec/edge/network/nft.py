"""The edge's nftables table: the kernel half of sandbox egress policy.

One ``inet`` table per edge, written whole at start and changed by element updates:

- ``vifs``/``veths``: each sandbox's host-side veth and the one source address allowed on
  it (anything else arriving there, and all IPv6, is dropped: no spoofing another sandbox).
- DNS (udp/tcp 53 to anywhere) is redirected to the edge's resolver, and TCP 80/443 not
  named by a raw rule to the edge's egress gate; both learn the sandbox from the source
  address. Nothing else of the host is reachable from a sandbox (input chain).
- ``raw_allow`` (sandbox . destination . proto . port, intervals): the raw ``ip:port/proto``
  rules. Everything else a sandbox sends is rejected and remembered in ``denied``
  (dynamic, with a counter per flow) for the audit log.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import subprocess
from dataclasses import dataclass

from dsec.errors import SandboxError


@dataclass(frozen=True)
class RawRule:
    net: ipaddress.IPv4Network
    ports: tuple[int, int]
    proto: str

    def element(self, src: str) -> str:
        lo, hi = self.ports
        port = str(lo) if lo == hi else f"{lo}-{hi}"
        return f"{src} . {self.net.with_prefixlen if self.net.prefixlen < 32 else self.net.network_address} " \
               f". {self.proto} . {port}"

    def __str__(self) -> str:
        lo, hi = self.ports
        net = self.net.with_prefixlen if self.net.prefixlen < 32 else str(self.net.network_address)
        return f"{net}:{lo if lo == hi else f'{lo}-{hi}'}/{self.proto}"


class NftTable:
    def __init__(self, name: str, subnet: ipaddress.IPv4Network, dns_port: int, gate_port: int) -> None:
        self.name, self.subnet, self.dns_port, self.gate_port = name, subnet, dns_port, gate_port

    def ruleset(self) -> str:
        s, t = self.subnet.with_prefixlen, self.name
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
  set denied {{ type {flow}; size 65535; flags dynamic,timeout; timeout 1h; }}
  chain guard {{ type filter hook prerouting priority raw; policy accept;
    iifname @vifs meta nfproto ipv6 drop
    iifname @vifs iifname . ip saddr != @veths drop
  }}
  chain steer {{ type nat hook prerouting priority dstnat; policy accept;
    ip saddr {s} meta l4proto {{ tcp, udp }} th dport 53 redirect to :{self.dns_port}
    ip saddr {s} ip saddr . ip daddr . meta l4proto . th dport @raw_allow accept
    ip saddr {s} tcp dport {{ 80, 443 }} redirect to :{self.gate_port}
  }}
  chain input {{ type filter hook input priority filter; policy accept;
    ip saddr {s} ct status dnat meta l4proto {{ tcp, udp }} th dport {{ {self.dns_port}, {self.gate_port} }} accept
    ip saddr {s} ip saddr . ip daddr . meta l4proto . th dport @raw_allow accept
    ip saddr {s} ct state established,related accept
    ip saddr {s} {deny}
    ip saddr != {s} meta l4proto {{ tcp, udp }} th dport {{ {self.dns_port}, {self.gate_port} }} drop
  }}
  chain forward {{ type filter hook forward priority filter; policy accept;
    ip daddr {s} ct state established,related accept
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
        proc = await asyncio.create_subprocess_exec(
            "nft", "-f", "-", stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        out, _ = await proc.communicate(script.encode())
        if proc.returncode != 0:
            raise SandboxError(f"nft: {out.decode(errors='replace').strip()}")

    async def install(self) -> None:
        await self.apply(self.ruleset())

    async def remove(self) -> None:
        await self.apply(f"table inet {self.name}\ndelete table inet {self.name}\n")

    def set_sandbox(self, ifname: str, ip: str, old: list[RawRule], new: list[RawRule], add_if: bool) -> str:
        """The nft script that moves sandbox ``ip`` from rules ``old`` to ``new``."""
        t = self.name
        lines = []
        if add_if:
            lines += [f"add element inet {t} vifs {{ {json.dumps(ifname)} }}",
                      f"add element inet {t} veths {{ {json.dumps(ifname)} . {ip} }}"]
        gone = [r for r in old if r not in new]
        fresh = [r for r in new if r not in old]
        if gone:
            lines.append(f"delete element inet {t} raw_allow {{ {', '.join(r.element(ip) for r in gone)} }}")
        if fresh:
            lines.append(f"add element inet {t} raw_allow {{ {', '.join(r.element(ip) for r in fresh)} }}")
        return "\n".join(lines) + "\n"

    def drop_sandbox(self, ifname: str, ip: str, rules: list[RawRule]) -> str:
        t = self.name
        lines = [f"delete element inet {t} vifs {{ {json.dumps(ifname)} }}",
                 f"delete element inet {t} veths {{ {json.dumps(ifname)} . {ip} }}"]
        if rules:
            lines.append(f"delete element inet {t} raw_allow {{ {', '.join(r.element(ip) for r in rules)} }}")
        return "\n".join(lines) + "\n"

    async def denied(self) -> list[tuple[str, str, str, int, int]]:
        """Flows rejected so far: (sandbox ip, destination, proto, port, packets)."""
        proc = await asyncio.create_subprocess_exec(
            "nft", "-j", "list", "set", "inet", self.name, "denied",
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        out, _ = await proc.communicate()
        if proc.returncode != 0:
            return []
        flows = []
        for item in json.loads(out or b"{}").get("nftables", []):
            for el in (item.get("set") or {}).get("elem", []):
                e = el.get("elem", el)
                val = e.get("val", e)
                parts = val.get("concat") if isinstance(val, dict) else None
                if not parts or len(parts) != 4:
                    continue
                packets = int(((e.get("counter") or {}).get("packets")) or 0)
                flows.append((str(parts[0]), str(parts[1]), str(parts[2]), int(parts[3]), packets))
        return flows
