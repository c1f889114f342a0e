"""The layer catalog's tables (dsec.node.layers.catalog queries them): published layer names,
the data blob of each metadata image, builds by content key, prefetch access lists.

In cluster mode they live in the cluster's database, where Alembic revision 0002 made
them; in embedded mode in ``catalog.db`` at the layer store's root, a file older
versions created with raw SQL, which dsec.node.layers.catalog brings up to these definitions
itself (a column added here needs a server default, for the rows such a file holds)."""

from __future__ import annotations

from sqlalchemy import BigInteger, Column, Float, MetaData, String, Table, Text

metadata = MetaData()

layers = Table(
    "layers", metadata,
    Column("ref", String, primary_key=True),
    Column("kind", String, nullable=False),
    Column("digest", String, nullable=False),
    Column("size", BigInteger, nullable=False),  # bytes: past 2 GiB for big images
    Column("created_at", Float, nullable=False),
    # lineage and blob stack, JSON (parent_image, parent_layers, source, blobs)
    Column("meta", Text, nullable=False, server_default="{}"),
)

# a content key (an OCI layer group) -> the metadata image built from it, so a rebuild reuses it
built = Table(
    "built", metadata,
    Column("key", String, primary_key=True),
    Column("digest", String, nullable=False),
)

# metadata image digest -> its data blob's digest
blob_data = Table(
    "blob_data", metadata,
    Column("meta", String, primary_key=True),
    Column("data", String, nullable=False),
)

# a data blob's chunks in first-touch order (JSON list): advisory prefetch hints
access_lists = Table(
    "access_lists", metadata,
    Column("data", String, primary_key=True),
    Column("chunks", Text, nullable=False),
    Column("source", String, nullable=False),
    Column("recorded_at", Float, nullable=False),
)
