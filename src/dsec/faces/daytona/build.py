"""Daytona's declarative images (``Image.base(...).run_commands(...)``, ``Image.from_dockerfile``
without a build context) as dsec template builds: the Dockerfile the SDK sends is read into
E2B-style build steps and built by the template builder E2B's template API uses
(dsec.faces.templates), once per project and Dockerfile (the template is named by their hash, so
the next create with the same image finds it built and starts at once).

Served: ``FROM``, ``RUN`` (shell or JSON form), ``ENV``, ``WORKDIR``, ``USER``; ``CMD``,
``ENTRYPOINT``, ``EXPOSE`` and ``LABEL`` are ignored (a Daytona sandbox runs its own
daemon, not the image's command). ``COPY``/``ADD`` (their files go to Daytona's object
storage, which dsec does not serve), ``ARG`` and the rest are refused naming the line."""

from __future__ import annotations

import asyncio
import hashlib
import json
import shlex
import time

from dsec.control.iam import current_principal
from dsec.faces.e2b.templates_api import TemplatesApi
from dsec.faces.templates.models import BuildRequest, Step, TemplateSpec
from dsec.shared.errors import DeadlineExceeded, DsecError, InvalidRequest, NotFound

IGNORED = {"CMD", "ENTRYPOINT", "EXPOSE", "LABEL", "MAINTAINER", "STOPSIGNAL", "HEALTHCHECK", "SHELL", "VOLUME"}
POLL_S = 0.25


class NotServed(DsecError):
    status = 501
    code = "not_implemented"


def _lines(text: str) -> list[str]:
    out, cur = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not cur and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            cur += line[:-1] + " "
            continue
        out.append(cur + line)
        cur = ""
    if cur.strip():
        out.append(cur)
    return out


def parse_dockerfile(text: str) -> TemplateSpec:
    lines = _lines(text)
    if not lines or not lines[0].upper().startswith("FROM "):
        raise InvalidRequest("image: a Dockerfile starts with FROM", field="image")
    head = lines[0].split()
    if len(head) not in (2, 4):
        raise InvalidRequest(f"image: {lines[0]!r} is not 'FROM <image> [AS name]'", field="image")
    steps: list[Step] = []
    for line in lines[1:]:
        op, _, rest = line.partition(" ")
        op, rest = op.upper(), rest.strip()
        if op == "RUN":
            if rest.startswith("["):
                try:
                    rest = shlex.join([str(a) for a in json.loads(rest)])
                except (ValueError, TypeError):
                    raise InvalidRequest(f"image: {line!r}: not a JSON list", field="image") from None
            steps.append(Step(type="RUN", args=[rest]))
        elif op == "ENV":
            words = shlex.split(rest)
            if words and all("=" in w for w in words):
                pairs = [p for w in words for p in w.split("=", 1)]
            elif len(words) >= 2:
                pairs = [words[0], " ".join(words[1:])]  # the legacy form: ENV name value...
            else:
                raise InvalidRequest(f"image: {line!r}: ENV name=value", field="image")
            steps.append(Step(type="ENV", args=pairs))
        elif op == "WORKDIR":
            steps.append(Step(type="WORKDIR", args=[rest]))
        elif op == "USER":
            steps.append(Step(type="USER", args=[rest]))
        elif op not in IGNORED:
            raise NotServed(f"image: {op} is not served by dsec's Daytona face ({line!r}); an image with files "
                            "to copy is built through E2B's template API and its name given as the snapshot",
                            field="image")
    return TemplateSpec(fromImage=head[1], steps=steps)


async def build(templates_api: TemplatesApi, dockerfile: str, cpu: int | None, memory_mb: int | None,
                timeout_s: float) -> str:
    """The name of a template built from ``dockerfile`` for the caller's project: found
    ready, or built now (waited for, at most ``timeout_s``)."""
    spec = parse_dockerfile(dockerfile)
    principal = current_principal.get()
    project = principal.project if principal is not None else "default"
    name = "daytona-" + hashlib.sha256(f"{project}\n{dockerfile}".encode()).hexdigest()[:16]
    catalog = templates_api.catalog
    try:
        await asyncio.to_thread(catalog.resolve, name)
        return name
    except NotFound:
        pass
    made = await templates_api.request(BuildRequest(name=name, cpuCount=cpu, memoryMB=memory_mb))
    await templates_api.start(made["templateID"], made["buildID"], spec)
    deadline = time.monotonic() + timeout_s
    while True:
        b = await asyncio.to_thread(catalog.build, made["buildID"])
        if b is not None and b.status == "ready":
            return name
        if b is None or b.status == "error":
            why = (b.reason or {}).get("message", "unknown") if b is not None else "the build is gone"
            raise InvalidRequest(f"image: its build failed: {why}", field="image")
        if time.monotonic() > deadline:
            raise DeadlineExceeded(f"image: still building after {timeout_s:.0f} s (build {made['buildID']}); "
                                   "create again with the same image to use it once built", field="image")
        await asyncio.sleep(POLL_S)
