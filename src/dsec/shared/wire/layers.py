"""A layer as the catalog and the API describe it."""

from __future__ import annotations

from pydantic import BaseModel, Field

from dsec.shared.errors import InvalidRequest


class Layer(BaseModel):
    ref: str
    kind: str
    digest: str
    size: int
    created_at: float
    parent_image: str | None = None
    parent_layers: list[str] = []
    source: str = ""
    blobs: list[str] = Field(default_factory=list, description="EROFS images bottom to top, when more than one")
    data: dict[str, str] = Field(default_factory=dict, description="metadata image digest -> its data blob")
    prefetch_chunks: int = Field(default=0, description="chunks in its data blobs' access lists")
    owner: str | None = Field(default=None, description="the project that published it (None: no project's, "
                              "as base images and imports; then it is public)")
    visibility: str = Field(default="public", description="who may see and use it: public (every project), "
                            "project (the owner's subtree and its admins), private (the owner and its admins)")

    @property
    def all_blobs(self) -> list[str]:
        return self.blobs or [self.digest]

    def stack(self) -> tuple[str, list[str]]:
        """(image, layers) of a sandbox that sees exactly this layer's tree."""
        if self.kind == "base":
            return self.ref, []
        if self.parent_image is None:
            raise InvalidRequest(f"layer {self.ref!r} was not taken from a sandbox; give an image to stack it on",
                                 field="snapshot")
        return self.parent_image, [*self.parent_layers, self.ref]
