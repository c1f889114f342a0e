"""A cluster's settings, as ``dsec cluster up`` gives them to the controller (and the
controller to each edge and replica it starts)."""

from __future__ import annotations

from pydantic import BaseModel, Field

EDGE_RESOURCE = "dsec_edge"
EDGE_NAME_LABEL = "dsec-edge-name"  # a Ray node label naming the node's edge (default: its host name)
NAMESPACE = "dsec"


class ClusterConfig(BaseModel):
    db: str = Field(description="the cluster's database URL (postgresql://...)")
    secret: str = Field(description="the cluster secret every edge requires of its callers")
    admin_token: str = Field(description="the cluster's admin API token (and the key envd tokens derive from)")
    store: str | None = Field(default=None, description="the shared layer store, mounted on every node")
    data_root: str = Field(default="/var/lib/dsec/cluster", description="each edge's data dir is DATA_ROOT/NAME")
    listen_host: str | None = Field(default=None, description="address daemons bind (default: the node's IP)")
    db_allow: list[str] = Field(
        default_factory=list, description="networks (CIDR) the private database admits besides the subnet of "
                                          "its own node's address: nodes routed from elsewhere")
    edge_port: int = Field(default=7801, description="each edge daemon's port (0: a free one)")
    api_port: int = Field(default=7777, description="replica i listens on API_PORT + i (0: free ports)")
    apiservers: int = Field(default=2, ge=1, le=64)
    apiserver_resource: str | None = Field(
        default=None, description="a Ray resource replicas require (a sliver each): keeps them on the nodes that "
                                  "have it; default: spread over every node")
    edge_args: list[str] = Field(default_factory=list, description="more `dsec edge serve` options, every edge")
    edge_args_by_name: dict[str, list[str]] = Field(default_factory=dict, description="... for one edge")
    tracing_env: dict[str, str] = Field(
        default_factory=dict, description="OTEL_* variables (docs/tracing.md) every edge daemon and replica gets "
                                          "where its node's environment does not set them; `cluster up` passes its own")
    protect: list[str] = Field(
        default_factory=list, description="more addresses, networks (CIDR) or host names no sandbox may reach, "
                                          "besides the cluster's own nodes, database and storage (which are found)")
    tls: bool = Field(default=True, description="mutual TLS between replicas and edges (the cluster CA in the "
                                                "registry, a certificate per daemon: dsec.control.cluster.certs)")
    resource: str = EDGE_RESOURCE
    log_level: str = "info"
