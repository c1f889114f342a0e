"""Leases in the metadata database: one holder at a time of a named duty (the quota
sweep) among the processes sharing the database, taken over once its holder stops
renewing it. A row of the settings table per lease; blocking calls (run them in a thread)."""

from __future__ import annotations

import json
import time

from sqlalchemy import Engine, insert, select, update
from sqlalchemy.exc import IntegrityError

from dsec.shared.meta.schema import settings


def take_lease(db: Engine, name: str, owner: str, ttl_s: float) -> bool:
    """Hold (or renew) lease ``name`` for ``ttl_s`` as ``owner``: True if this owner holds it
    now, False while another's is unexpired."""
    key, now = f"lease:{name}", time.time()
    value = json.dumps({"owner": owner, "until": now + ttl_s})
    try:
        with db.begin() as c:
            q = select(settings.c.value).where(settings.c.key == key)
            if c.dialect.name == "postgresql":
                q = q.with_for_update()
            held = c.execute(q).scalar()
            if held is None:
                c.execute(insert(settings).values(key=key, value=value))
                return True
            cur = json.loads(held)
            if cur.get("owner") != owner and cur.get("until", 0) > now:
                return False
            c.execute(update(settings).where(settings.c.key == key).values(value=value))
            return True
    except IntegrityError:  # another took it at the same moment
        return False


def release_lease(db: Engine, name: str, owner: str) -> None:
    """Give lease ``name`` up (a clean shutdown), if ``owner`` holds it: the next taker need
    not wait for it to expire."""
    key = f"lease:{name}"
    with db.begin() as c:
        held = c.execute(select(settings.c.value).where(settings.c.key == key)).scalar()
        if held is not None and json.loads(held).get("owner") == owner:
            c.execute(update(settings).where(settings.c.key == key).values(
                value=json.dumps({"owner": owner, "until": 0})))
