"""The metadata tables, as SQLAlchemy Core objects the queries use. Alembic's revisions
(dsec/shared/meta/migrations/versions) create and change them; a change here is a new revision
there."""

from __future__ import annotations

from sqlalchemy import BigInteger, Boolean, Column, Float, Index, Integer, MetaData, String, Table, Text, false

metadata = MetaData()

tokens = Table(
    "tokens", metadata,
    Column("id", String, primary_key=True),
    Column("digest", String, nullable=False, unique=True),
    Column("project", String, nullable=False),
    Column("role", String, nullable=False),
    Column("name", String, nullable=False),
    Column("created_at", Float, nullable=False),
    Column("expires_at", Float, nullable=True),  # None: never (revision 0007)
    Column("created_by", String, nullable=True),  # the token id that made it ("admin": the node's own)
)

# every IAM change, who made it and when (revision 0007)
iam_events = Table(
    "iam_events", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("at", Float, nullable=False),
    Column("actor", String, nullable=False),  # a token id ("admin": the node's own token)
    Column("action", String, nullable=False),  # token.create | token.revoke
    Column("target", String, nullable=False),
    Column("detail", Text, nullable=False, default="{}"),  # JSON
    Column("project", String, nullable=True),  # the project it changed; None: cluster-wide (revision 0008)
)

# the project tree (revision 0008): a project's name is its path. q_*: its quota (None: no
# cap of its own); u_*: what its whole subtree holds, kept by admission in the same
# transaction for every ancestor, so two replicas cannot both take the last unit.
# CPU is in millicores: sums of floats would drift.
projects = Table(
    "projects", metadata,
    Column("name", String, primary_key=True),
    Column("parent", String, nullable=True),
    Column("description", Text, nullable=False, default=""),
    Column("created_at", Float, nullable=False),
    Column("created_by", String, nullable=True),
    Column("q_sandboxes", BigInteger, nullable=True),
    Column("q_cpu_milli", BigInteger, nullable=True),
    Column("q_memory_mb", BigInteger, nullable=True),
    Column("q_disk_mb", BigInteger, nullable=True),
    Column("q_starting", BigInteger, nullable=True),
    Column("q_fncall_per_s", Float, nullable=True),
    Column("u_sandboxes", BigInteger, nullable=False, default=0),
    Column("u_cpu_milli", BigInteger, nullable=False, default=0),
    Column("u_memory_mb", BigInteger, nullable=False, default=0),
    Column("u_disk_mb", BigInteger, nullable=False, default=0),
    Column("u_starting", BigInteger, nullable=False, default=0),
    Index("projects_by_parent", "parent"),
)

# what each admitted sandbox holds of its project's quota (revision 0008): a row from
# admission until the sandbox is gone. ``sandbox_id`` is set once the edge made it; the
# charged amounts (CPU 0 while paused) are what the u_* counters include.
project_holds = Table(
    "project_holds", metadata,
    Column("id", String, primary_key=True),
    Column("sandbox_id", String, nullable=True, unique=True),
    Column("project", String, nullable=False),
    Column("job", String, nullable=True),
    Column("state", String, nullable=False),  # starting | running | paused
    Column("cpu_milli", BigInteger, nullable=False),  # its CPU when running
    Column("memory_mb", BigInteger, nullable=False),
    Column("disk_mb", BigInteger, nullable=False),
    Column("charged_cpu_milli", BigInteger, nullable=False),  # what the counters hold of its CPU now
    Column("created_at", Float, nullable=False),
    Column("bound_at", Float, nullable=True),  # when the edge's answer came (the sandbox exists since)
    Index("project_holds_by_project", "project"),
)

# a share of a project lineage's quota charged ahead to one apiserver replica (revision
# 0012, dsec.control.iam.blocks): the u_* counters of the project and its ancestors include these
# amounts, which the replica's creates take in memory and their binds move to holds
quota_blocks = Table(
    "quota_blocks", metadata,
    Column("id", String, primary_key=True),  # <replica>/<project>
    Column("replica", String, nullable=False),
    Column("project", String, nullable=False),
    Column("sandboxes", BigInteger, nullable=False),
    Column("cpu_milli", BigInteger, nullable=False),
    Column("memory_mb", BigInteger, nullable=False),
    Column("disk_mb", BigInteger, nullable=False),
    Column("starting", BigInteger, nullable=False),
    Column("renewed_at", Float, nullable=False),  # the holder's wall clock at its last write
)

# who owns a layer and which projects may see it (revision 0008); a layer without a row
# (base images, OCI imports, layers older than this table) is public
layer_acl = Table(
    "layer_acl", metadata,
    Column("ref", String, primary_key=True),
    Column("project", String, nullable=False),  # the owner
    Column("visibility", String, nullable=False),  # public | project | private
    Column("created_by", String, nullable=True),  # the token id that published or last changed it
    Column("created_at", Float, nullable=False),
)

# one row per edge the cluster ever had; the controller writes stats, replicas read them
edges = Table(
    "edges", metadata,
    Column("name", String, primary_key=True),
    Column("url", String, nullable=False),
    Column("node_id", String, nullable=False),
    Column("state", String, nullable=False),  # active | lost | removed
    Column("reason", Text, nullable=False, default=""),
    Column("registered_at", Float, nullable=False),
    Column("changed_at", Float, nullable=False),
    Column("stats", Text, nullable=True),  # NodeStats JSON, from the watcher's last poll
    Column("stats_at", Float, nullable=True),
    # the detector's verdict (dsec.control.health): ok | suspect | cordoned, why, and the signals behind it
    Column("health", String, nullable=False, server_default="ok"),
    Column("health_reason", Text, nullable=False, server_default=""),
    Column("health_at", Float, nullable=True),
    Column("evidence", Text, nullable=False, server_default="[]"),  # JSON list of Evidence
    Column("cordoned_by", String, nullable=False, server_default=""),  # "" | detector | operator token id
)

# which edge holds each sandbox made through an apiserver (cluster mode): what a lost
# node's sandboxes were, when the node cannot say
sandboxes = Table(
    "sandboxes", metadata,
    Column("id", String, primary_key=True),
    Column("edge", String, nullable=False),
    Column("project", String, nullable=False),
    Column("created_at", Float, nullable=False),
    Column("info", Text, nullable=False),  # SandboxInfo JSON as created
    Column("lost_reason", Text, nullable=True),
    # restored (or drained) onto an edge other than the one its id names: routing looks here
    Column("moved", Boolean, nullable=False, server_default=false()),
    Column("restore", Text, nullable=True),  # while a restore runs or after it failed: why
    Index("sandboxes_by_edge", "edge"),
    Index("sandboxes_moved", "moved"),
)

# what happened to the fleet and why: health changes, cordons, drains, moves, restores
fleet_events = Table(
    "fleet_events", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("at", Float, nullable=False),
    Column("edge", String, nullable=False),
    Column("sandbox_id", String, nullable=True),
    Column("kind", String, nullable=False),
    Column("actor", String, nullable=False),  # detector | controller | a token id
    Column("reason", Text, nullable=False),
    Column("detail", Text, nullable=False, server_default="{}"),
    Index("fleet_events_at", "at"),
)

# a sandbox's checkpoints (dsec.node.checkpoints): each row is complete; ``stack`` is every blob
# to stack over the sandbox's own layers to get its files back, bottom to top
checkpoints = Table(
    "checkpoints", metadata,
    Column("sandbox_id", String, primary_key=True),
    Column("seq", Integer, primary_key=True),
    Column("kind", String, nullable=False),  # full | delta
    Column("edge", String, nullable=False),
    Column("project", String, nullable=False),
    Column("digest", String, nullable=True),  # this checkpoint's own blob (None: nothing changed)
    Column("stack", Text, nullable=False),  # JSON list of blob digests
    Column("bytes", BigInteger, nullable=False),
    Column("files", Integer, nullable=False),
    Column("freeze_ms", Float, nullable=False),
    Column("build_ms", Float, nullable=False),
    Column("taken_at", Float, nullable=False),
    Column("record", Text, nullable=False),  # the sandbox's CreateRequest args and info, JSON
    Column("commands", String, nullable=True),  # its command log's blob in the store
    Index("checkpoints_taken_at", "taken_at"),
)

# the web console's ended sessions (revision 0010): "s:<nonce>" one session (logged out),
# "t:<token id>" every session of that token made before ``cut``; a row goes at ``until``
console_revocations = Table(
    "console_revocations", metadata,
    Column("key", String, primary_key=True),
    Column("cut", Float, nullable=False),
    Column("until", Float, nullable=False),
)

settings = Table(
    "settings", metadata,
    Column("key", String, primary_key=True),
    Column("value", Text, nullable=False),
)
