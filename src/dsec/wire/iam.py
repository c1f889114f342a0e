"""API tokens as the API takes and shows them."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

PROJECT_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")


class TokenSpec(BaseModel):
    project: str = Field(description="the project the token acts in")
    role: Literal["builder", "runner"] = Field(description="builder publishes environments; runner only runs them")
    name: str = Field(default="", max_length=128)
    ttl_s: float | None = Field(default=None, gt=0, le=10 * 365 * 86400,
                                description="it stops working this many seconds after it is made (None: never)")

    @field_validator("project")
    @classmethod
    def _project(cls, v: str) -> str:
        if not PROJECT_RE.match(v):
            raise ValueError("project: lowercase letters, digits, '.', '_' and '-', at most 63")
        return v


class TokenInfo(BaseModel):
    id: str
    project: str
    role: str
    name: str
    created_at: float
    expires_at: float | None = None
    created_by: str | None = Field(default=None, description="the token id that made it ('admin': the node's own)")
    token: str | None = Field(default=None, description="the secret, shown once, when the token is created")


class IamEvent(BaseModel):
    """One IAM change: who (a token id; "admin" is the node's own token), what, when."""

    id: int
    at: float
    actor: str
    action: str
    target: str
    detail: dict[str, Any] = Field(default_factory=dict)
