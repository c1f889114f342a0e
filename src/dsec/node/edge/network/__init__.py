"""Sandbox networking: routed veths, egress rules in nftables, a resolver and an egress
gate that admit allowed service names. See docs/network.md."""

from dsec.node.edge.network.manager import NetworkManager

__all__ = ["NetworkManager"]
