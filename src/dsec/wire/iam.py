"""API tokens as the API takes and shows them."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, Field, field_validator

PROJECT_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")


class TokenSpec(BaseModel):
    project: str = Field(description="the project the token acts in")
    role: Literal["builder", "runner"] = Field(description="builder publishes environments; runner only runs them")
    name: str = Field(default="", max_length=128)

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
    token: str | None = Field(default=None, description="the secret, shown once, when the token is created")
