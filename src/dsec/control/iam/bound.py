"""Credentials bound to the token that made a sandbox or an object: an E2B sandbox's envd
access token and traffic token (and the file URLs signed with them), its SWE-ReX token, a
template's upload URL. Each is ``TOKEN_ID.MAC``: an HMAC, keyed with the server's secret,
over (purpose, the sandbox id or object, the token id). Checking one checks the MAC and
that the token is still live in the token store's in-memory table, so it ends when its
token is revoked or expires (on the revoking replica at once, on others within the
store's reload period) and costs no database query.

This module owns minting and checking them; a sandbox names its token in the
``dsec.token`` label, which the apiserver sets on every create whatever the request asks."""

from __future__ import annotations

import contextvars
import hmac
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from dsec.shared.wire.models import SandboxInfo

TOKEN_LABEL = "dsec.token"
ADMIN_TOKEN_ID = "admin"  # the cluster admin's token (dsec.control.iam.tokens.ADMIN)
# the purposes credentials are minted for: one never stands in for another
ENVD, TRAFFIC, SWEREX, TEMPLATE_FILES = "envd", "traffic", "swerex", "template-files"
MAC_CHARS = 40  # 160 bits of HMAC-SHA256, hex

# a create made in the background for a request that was accepted earlier (a batch's item):
# the token id of whoever submitted it, which its sandbox is bound to instead of the
# context's (the runner's, the cluster admin's)
on_behalf_of: contextvars.ContextVar[str | None] = contextvars.ContextVar("dsec_on_behalf_of", default=None)


def token_of(info: SandboxInfo) -> str:
    """The id of the token a sandbox is bound to. One without the label was made before
    labels were set (or by the platform itself): the cluster admin's, as its creator was."""
    return info.labels.get(TOKEN_LABEL) or ADMIN_TOKEN_ID


class TokenTable(Protocol):
    """What minting and checking need of the token store (dsec.control.iam.tokens.TokenStore): its
    signing key, and whether a token id is live now."""

    @property
    def secret(self) -> bytes: ...

    async def live(self, token_id: str) -> bool: ...


class BoundKeys:
    """Mints and checks bound credentials against one token store (its secret and its
    table of live tokens)."""

    def __init__(self, tokens: TokenTable) -> None:
        self.tokens = tokens

    def mint(self, purpose: str, subject: str, token_id: str) -> str:
        return f"{token_id}.{self._mac(purpose, subject, token_id)}"

    def mint_for(self, purpose: str, info: SandboxInfo) -> str:
        """A sandbox's own credential for ``purpose``, bound to the token that made it."""
        return self.mint(purpose, info.sandbox_id, token_of(info))

    def _mac(self, purpose: str, subject: str, token_id: str) -> str:
        # NUL-separated: none of the parts can hold one (ids and hashes), so no two
        # (purpose, subject, token) triples share a message
        msg = f"dsec.bound\0{purpose}\0{subject}\0{token_id}".encode()
        return hmac.digest(self.tokens.secret, msg, "sha256").hex()[:MAC_CHARS]  # one-shot: OpenSSL's fast path

    def signed_by(self, purpose: str, subject: str, credential: str) -> str | None:
        """The token id ``credential`` was minted with for (purpose, subject) when its MAC is
        right, whether or not that token still lives; None otherwise."""
        token_id, dot, mac = credential.rpartition(".")
        if not dot or not token_id or len(mac) != MAC_CHARS or "\0" in token_id:
            return None
        if not hmac.compare_digest(mac.encode(), self._mac(purpose, subject, token_id).encode()):
            return None
        return token_id

    async def check(self, purpose: str, subject: str, credential: str) -> str | None:
        """The token id behind a valid credential whose token is still live; None for a
        wrong, malformed or forged one, or one whose token was revoked or has expired."""
        token_id = self.signed_by(purpose, subject, credential)
        if token_id is None or not await self.tokens.live(token_id):
            return None
        return token_id
