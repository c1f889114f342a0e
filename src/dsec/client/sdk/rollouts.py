"""The SDK's rollouts face (``client.rollouts``), the trainer's side of the rollout service
(docs/rl.md, "Rollouts that outlive the trainer"): submit specs by key, stream finished
rollouts, fetch a trajectory, acknowledge what a training step used. It holds nothing of
its own: a new trainer process resubmits the same keys and gets the same rollouts back."""

from __future__ import annotations

import builtins
import time
from collections.abc import AsyncIterator, Sequence

from dsec.client.sdk.transport import Api
from dsec.shared.wire.rollouts import MAX_SUBMIT, RolloutCounts, RolloutInfo, RolloutSpec, SubmitResult

WAIT_S = 30.0
SETTLE_S = 10.0
LOOK_BACK_EVERY_S = 1.0
PAGE = 1000
LIST_PAGE = 5000


class AsyncRollouts:
    def __init__(self, client: Api, project: str | None = None) -> None:
        self._client = client
        self._params = {"project": project} if project else {}

    async def submit(self, specs: Sequence[RolloutSpec] | RolloutSpec) -> builtins.list[RolloutInfo]:
        """Queue rollouts for the workers (any number: sent 10,000 a call). A spec whose key
        was submitted before answers that rollout, whatever its state."""
        items = [specs] if isinstance(specs, RolloutSpec) else list(specs)
        out: builtins.list[RolloutInfo] = []
        for i in range(0, len(items), MAX_SUBMIT):
            body = {"rollouts": [s.model_dump(mode="json") for s in items[i:i + MAX_SUBMIT]]}
            res = SubmitResult.model_validate(await self._client._json(
                "POST", "/v1/rollouts", json=body, params=self._params, timeout=120.0))
            out += res.rollouts
        return out

    async def get(self, rollout_id: str, *, steps: bool = False, spec: bool = False) -> RolloutInfo:
        """Its state and outcome; ``steps=True`` adds the trajectory (every journaled step)."""
        params = {**self._params, "steps": str(steps).lower(), "spec": str(spec).lower()}
        return RolloutInfo.model_validate(await self._client._json("GET", f"/v1/rollouts/{rollout_id}",
                                                                   params=params))

    async def list(self, *, job: str | None = None, state: Sequence[str] = (), consumed: bool | None = None,
                   labels: dict[str, str] | None = None) -> builtins.list[RolloutInfo]:
        """Every matching rollout, in creation order (paged from the platform)."""
        out: builtins.list[RolloutInfo] = []
        after: str | None = None
        while True:
            params: builtins.list[tuple[str, str]] = [*self._params.items(), ("limit", str(LIST_PAGE))]
            params += [("state", s) for s in state] + [("label", f"{k}={v}") for k, v in (labels or {}).items()]
            if job:
                params.append(("job", job))
            if consumed is not None:
                params.append(("consumed", str(consumed).lower()))
            if after:
                params.append(("after", after))
            page = [RolloutInfo.model_validate(x) for x in await self._client._json("GET", "/v1/rollouts",
                                                                                   params=params)]
            out += page
            if len(page) < LIST_PAGE:
                return out
            after = page[-1].id

    async def counts(self, *, job: str | None = None) -> RolloutCounts:
        params = {**self._params, **({"job": job} if job else {})}
        return RolloutCounts.model_validate(await self._client._json("GET", "/v1/rollouts/counts", params=params))

    async def wait(self, *, job: str | None = None, limit: int = 100, timeout: float = WAIT_S, since: float = 0.0
                   ) -> builtins.list[RolloutInfo]:
        """Finished rollouts not yet acknowledged (those finished at ``since`` or later, in the
        order they finished), as soon as there is one; empty after ``timeout``."""
        params = {**self._params, "limit": str(limit), "timeout": str(min(timeout, 60.0)), "since": repr(since)}
        if job:
            params["job"] = job
        data = await self._client._json("GET", "/v1/rollouts/wait", params=params, timeout=min(timeout, 60.0) + 30)
        return [RolloutInfo.model_validate(x) for x in data]

    async def finished(self, *, job: str | None = None, timeout: float | None = None
                       ) -> AsyncIterator[RolloutInfo]:
        """Each finished, unacknowledged rollout once (in this process), as it finishes, until
        ``timeout`` passes with none (None: forever). Acknowledge with :meth:`ack` once it is
        used: what was not acknowledged comes again to the next trainer process."""
        # finished_at is stamped before the commit, so one may appear a little after a later
        # stamp was seen: a look-back query (SETTLE_S behind the newest seen) runs once every
        # LOOK_BACK_EVERY_S, what it yielded before skipped; between them a long poll for
        # stamps past the newest answers a new finish at once (the apiserver wakes it)
        seen: dict[str, float] = {}
        newest = 0.0
        crowded = False  # the last page was full of rollouts already yielded: page on, no look-back
        look_back_at = 0.0
        idle_since = time.monotonic()
        while timeout is None or time.monotonic() - idle_since < timeout:
            now = time.monotonic()
            left = WAIT_S if timeout is None else max(0.0, timeout - (now - idle_since))
            if crowded or now >= look_back_at:
                look_back_at = now + LOOK_BACK_EVERY_S
                since, wait_s = (newest if crowded else max(0.0, newest - SETTLE_S)), min(WAIT_S, left)
            else:
                since, wait_s = newest + 1e-6, min(look_back_at - now, left)
            page = await self.wait(job=job, limit=PAGE, timeout=wait_s, since=since)
            batch = [r for r in page if r.id not in seen]
            crowded = len(page) >= PAGE and not batch
            if page:
                newest = max(newest, *(r.finished_at or 0.0 for r in page))
            if not batch:
                continue
            idle_since = time.monotonic()
            for r in batch:
                seen[r.id] = r.finished_at or 0.0
            seen = {k: v for k, v in seen.items() if v >= newest - 2 * SETTLE_S}
            for r in batch:
                yield r

    async def ack(self, ids: Sequence[str]) -> int:
        """Mark finished rollouts consumed; returns how many were."""
        n = 0
        ids = list(ids)
        for i in range(0, len(ids), MAX_SUBMIT):
            res = await self._client._json("POST", "/v1/rollouts/ack", json={"ids": ids[i:i + MAX_SUBMIT]},
                                           params=self._params)
            n += int(res["acked"])
        return n

    async def cancel(self, rollout_id: str) -> RolloutInfo:
        """A queued or running rollout cancelled (its sandbox stopped)."""
        return RolloutInfo.model_validate(await self._client._json("POST", f"/v1/rollouts/{rollout_id}/cancel",
                                                                   params=self._params))
