"""The sandbox's own users, as envd sees them: who a request runs as (E2B names the user
per request, in Basic auth for RPCs and ``username`` for /files; without one, envd's
default user), which uid/gid that is, where its home is, and the names stat reports.

Read from the sandbox's /etc/passwd and /etc/group, so a template decides its users
(E2B's ``base`` template has ``user``, uid 1000, the default when present; a bare
Debian root has only root). The sandbox owns those files: what it writes there only
changes who its own processes run as.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dsec.shared.errors import InvalidRequest, NotFound

if TYPE_CHECKING:
    from dsec.node.edge.api import EdgeAPI

DEFAULT_USER = "user"


@dataclass(frozen=True)
class Account:
    name: str
    uid: int
    gid: int
    home: str

    @property
    def owner(self) -> tuple[int, int] | None:
        """What files written for this user are chowned to (None: root, the default)."""
        return None if self.uid == 0 else (self.uid, self.gid)

    def env(self) -> dict[str, str]:
        return {"HOME": self.home, "USER": self.name, "LOGNAME": self.name}


ROOT = Account("root", 0, 0, "/root")


class UnknownUser(LookupError):
    pass


@dataclass
class Accounts:
    users: dict[str, Account] = field(default_factory=dict)
    user_names: dict[int, str] = field(default_factory=dict)
    group_names: dict[int, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, passwd: bytes, group: bytes) -> Accounts:
        out = cls()
        for line in passwd.decode(errors="replace").splitlines():
            f = line.split(":")
            if len(f) >= 6 and f[2].isdigit() and f[3].isdigit():
                acct = Account(f[0], int(f[2]), int(f[3]), f[5] or "/")
                out.users.setdefault(acct.name, acct)
                out.user_names.setdefault(acct.uid, acct.name)
        for line in group.decode(errors="replace").splitlines():
            f = line.split(":")
            if len(f) >= 3 and f[2].isdigit():
                out.group_names.setdefault(int(f[2]), f[0])
        return out

    def user(self, name: str | None) -> Account:
        if name is None:
            return self.users.get(DEFAULT_USER) or self.users.get("root") or ROOT
        if name == "root":
            return self.users.get("root") or ROOT
        if name not in self.users:
            raise UnknownUser(f"user {name!r} does not exist in the sandbox")
        return self.users[name]

    def owner_name(self, uid: int) -> str:
        return self.user_names.get(uid, str(uid))

    def group_name(self, gid: int) -> str:
        return self.group_names.get(gid, str(gid))


async def load(edge: EdgeAPI, sandbox_id: str) -> Accounts:
    """The sandbox's users and groups, read from its /etc/passwd and /etc/group (a file
    that is missing or not a regular file gives none)."""
    async def read(path: str) -> bytes:
        try:
            return await edge.read_file(sandbox_id, path)
        except (NotFound, InvalidRequest) as e:
            if e.field == "sandbox_id":
                raise
            return b""
    return Accounts.parse(await read("/etc/passwd"), await read("/etc/group"))


def basic_user(authorization: str | None) -> str | None:
    """The user named by an ``Authorization: Basic base64(user:)`` header, if any."""
    if not authorization or not authorization.lower().startswith("basic "):
        return None
    try:
        raw = base64.b64decode(authorization[6:].strip(), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None
    return raw.split(":", 1)[0] or None
