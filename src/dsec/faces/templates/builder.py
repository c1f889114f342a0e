"""Running a template build: resolve the base, find the longest prefix of the steps the
cache already holds, run the rest in a builder sandbox (the ``builder`` role's egress: the
package registries only), publish its writes as one toolkit layer on the base (pack_diff),
and record the result. A failing step fails the build with its log and publishes nothing;
the builder sandbox is stopped whatever happens.

A build belongs to the apiserver process that started it: it says so every few seconds in
the catalog, and a build whose runner goes quiet is failed by whichever replica looks next
(its builder sandbox stopped), so no build outlives its runner unseen. Every build is
bounded by ``max_build_s``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
import time
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from dsec.faces.e2b.accounts import ROOT, Account, UnknownUser
from dsec.faces.e2b.accounts import load as load_accounts
from dsec.faces.templates.catalog import LogRow, TemplateCatalog
from dsec.faces.templates.context import Contexts
from dsec.faces.templates.images import Images
from dsec.faces.templates.models import BuiltTemplate, RunConfig, Step, TemplateSpec, base_key, chain
from dsec.node.edge.api import EdgeAPI
from dsec.node.layers.store import LayerStore
from dsec.shared.errors import DsecError, SandboxError
from dsec.shared.wire.edge import ProcSpec
from dsec.shared.wire.models import ContainerArgs, CreateRequest, SandboxInfo

log = logging.getLogger("dsec.templates")
HEARTBEAT_S = 5.0
MAX_BUILD_S = 4 * 3600
SCRATCH = "/tmp/.dsec-build"
BUILDER_EGRESS = {"pypi": True, "npm": True, "debian": True}
MAX_LINE = 4096
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# E2B's images have an unprivileged ``user`` (uid 1000); an image without one gets it
PROVISION_USER = (
    "set -e; grep -q '^user:' /etc/passwd && exit 0; "
    "echo 'user:x:1000:1000:user:/home/user:/bin/sh' >> /etc/passwd; "
    "grep -q '^user:' /etc/group || echo 'user:x:1000:' >> /etc/group; "
    "if [ -x /bin/bash ]; then sed -i 's#^user:x:1000:1000:user:/home/user:/bin/sh$#"
    "user:x:1000:1000:user:/home/user:/bin/bash#' /etc/passwd; fi; "
    "mkdir -p /home/user; chown 1000:1000 /home/user; chmod 750 /home/user"
)
SHELL = 'if [ -x /bin/bash ]; then exec /bin/bash -l -c "$1"; fi; exec /bin/sh -l -c "$1"'


class BuildPlatform(Protocol):
    """What a build needs of the apiserver."""

    layers: LayerStore

    async def create(self, req: CreateRequest) -> SandboxInfo: ...
    def edge_for(self, sandbox_id: str) -> EdgeAPI: ...
    async def stop(self, sandbox_id: str) -> SandboxInfo: ...
    async def check_refs(self, image: str, layers: list[str]) -> None: ...
    async def template_layers(self, refs: list[str], project: str, public: bool) -> None:
        """A template's built layers follow it: its project's, private unless it is public."""


class StepFailed(Exception):
    def __init__(self, message: str, step: str) -> None:
        super().__init__(message)
        self.message, self.step = message, step


class _Log:
    """A build's log: entries buffered and written to the catalog in batches."""

    def __init__(self, catalog: TemplateCatalog, build_id: str) -> None:
        self.catalog, self.build_id = catalog, build_id
        self.pending: list[LogRow] = []
        self.step: str | None = None

    def __call__(self, message: str, level: str = "info") -> None:
        message = message[:MAX_LINE]
        self.pending.append(LogRow(time.time(), level, self.step, message))

    async def flush(self) -> None:
        batch, self.pending = self.pending, []
        if batch:
            await asyncio.to_thread(self.catalog.add_logs, self.build_id, batch)


class Builder:
    def __init__(self, platform: BuildPlatform, catalog: TemplateCatalog, images: Images, contexts: Contexts,
                 runner: str, max_build_s: float = MAX_BUILD_S) -> None:
        self.platform, self.catalog, self.images, self.contexts = platform, catalog, images, contexts
        self.runner, self.max_build_s = runner, max_build_s
        self.tasks: dict[str, asyncio.Task[None]] = {}

    async def start(self, build_id: str, spec: TemplateSpec) -> None:
        await asyncio.to_thread(self.catalog.start, build_id, spec, self.runner)
        task = asyncio.create_task(self._run(build_id, spec), name=f"template-build-{build_id}")
        self.tasks[build_id] = task
        task.add_done_callback(lambda _: self.tasks.pop(build_id, None))

    async def close(self) -> None:
        """Shutdown: running builds fail (their runner is going away) and their builders stop."""
        for t in list(self.tasks.values()):
            t.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)

    async def cancel(self, build_id: str, builder: str | None) -> None:
        """A build's template was deleted: stop it here, or its builder wherever it runs."""
        task = self.tasks.get(build_id)
        if task is not None:
            task.cancel()
        elif builder:
            await self._stop(builder)

    async def reap(self, at_start: bool = False) -> None:
        """Fail builds whose runner went quiet, and stop their builder sandboxes. At start,
        also those an earlier process on this host ran (it is gone, so are its builds)."""
        dead = self._gone if at_start else None
        for b in await asyncio.to_thread(self.catalog.reap, None, dead):
            if b.builder:
                await self._stop(b.builder)

    def _gone(self, runner: str) -> bool:
        host, _, pid = runner.rpartition(":")
        if host != self.runner.rpartition(":")[0] or not pid.isdigit() or runner == self.runner:
            return False
        return not os.path.exists(f"/proc/{pid}")

    async def _run(self, build_id: str, spec: TemplateSpec) -> None:
        out = _Log(self.catalog, build_id)
        builder: list[str] = []
        beat = asyncio.create_task(self._heartbeat(build_id, out))
        try:
            b = await asyncio.to_thread(self.catalog.build, build_id)
            assert b is not None
            t = await asyncio.to_thread(self.catalog.template, b.template_id)
            if t is None:
                raise StepFailed("the build's template was deleted", "base")
            result = await asyncio.wait_for(self._build(spec, out, builder, build_id, b.cpu_count, b.memory_mb,
                                                        t.project), self.max_build_s)
            await self.platform.template_layers(result.layers, t.project, t.public)
            out.step = "finalize"
            out(f"Build finished: {' + '.join([result.image, *result.layers])}")
            await out.flush()
            await asyncio.to_thread(self.catalog.finish, build_id, result)
        except StepFailed as e:
            out(e.message, "error")
            await out.flush()
            await asyncio.to_thread(self.catalog.fail, build_id, e.message, e.step)
        except TimeoutError:
            msg = f"the build took longer than {self.max_build_s:g} s"
            out(msg, "error")
            await out.flush()
            await asyncio.to_thread(self.catalog.fail, build_id, msg, out.step)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.catalog.fail, build_id, "the build was cancelled (its apiserver stopped)",
                                        out.step)
            raise
        except Exception as e:
            msg = e.message if isinstance(e, DsecError) else f"{type(e).__name__}: {e}"
            log.warning("template build %s failed: %s", build_id, msg, exc_info=not isinstance(e, DsecError))
            out(msg, "error")
            with contextlib.suppress(Exception):
                await out.flush()
                await asyncio.to_thread(self.catalog.fail, build_id, msg, out.step)
        finally:
            beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beat
            if builder:
                await asyncio.shield(self._stop(builder[0]))

    async def _heartbeat(self, build_id: str, out: _Log) -> None:
        """Logs reach the catalog every second (what a status poll streams); the runner
        says it is alive every ``HEARTBEAT_S``."""
        beat = time.monotonic()
        while True:
            await asyncio.sleep(1.0)
            with contextlib.suppress(Exception):
                await out.flush()
            if time.monotonic() - beat >= HEARTBEAT_S:
                beat = time.monotonic()
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(self.catalog.heartbeat, build_id)

    async def _stop(self, sandbox_id: str) -> None:
        with contextlib.suppress(Exception):
            await self.platform.stop(sandbox_id)

    # ---- the build ------------------------------------------------------------------
    async def _base(self, spec: TemplateSpec, out: _Log) -> tuple[BuiltTemplate, list[Step]]:
        """The stack the steps start from, and the steps (with E2B's user provisioned first
        on an image that lacks it)."""
        out.step = "base"
        if spec.fromTemplate:
            _, b = await asyncio.to_thread(self.catalog.resolve, spec.fromTemplate)
            assert b.result is not None
            out(f"FROM template {spec.fromTemplate} ({' + '.join([b.result.image, *b.result.layers])})")
            cfg = b.result.config.model_copy(update={"start_cmd": None, "ready_cmd": None})
            return b.result.model_copy(update={"config": cfg}), list(spec.steps)
        assert spec.fromImage is not None
        base = await self.images.resolve(spec.fromImage)
        # another project's private layer named as the image: unknown to this build, before
        # the log would show its stack (the build runs as the caller that started it)
        await self.platform.check_refs(base.image, base.layers)
        out(f"FROM {spec.fromImage} ({' + '.join([base.image, *base.layers])})")
        steps = list(spec.steps)
        if not base.has_user:
            steps.insert(0, Step(type="RUN", args=[PROVISION_USER, "root"]))
        return BuiltTemplate(image=base.image, layers=base.layers), steps

    async def _build(self, spec: TemplateSpec, out: _Log, builder: list[str], build_id: str, cpu: int,
                     memory_mb: int, project: str) -> BuiltTemplate:
        """``project``: the template's; its build contexts and its build cache are its own
        (another project's upload or cached step never lands in this build)."""
        start, steps = await self._base(spec, out)
        synthetic = len(steps) - len(spec.steps)  # the provisioning step, not the user's
        keys = [base_key(start.image, start.layers, start.config, project)]
        for s in steps:
            keys.append(chain(keys[-1], s.cache_text()))
        usable = 0 if spec.force else next((i for i, s in enumerate(steps) if s.force), len(steps))
        hits = await asyncio.to_thread(self.catalog.cached, keys[1:usable + 1])
        done, state = 0, start
        for i in range(usable, 0, -1):
            hit = hits.get(keys[i])
            if hit is not None and await asyncio.to_thread(self._present, hit):
                done, state = i, hit
                break
        for i in range(done):
            out.step = str(i + 1 - synthetic) if i >= synthetic else "base"
            out(f"CACHED [{i + 1}/{len(steps)}] {_describe(steps[i])}")
        config = state.config
        rest = steps[done:]
        if any(s.type in ("RUN", "COPY", "WORKDIR") for s in rest):
            state = await self._run_steps(state, steps, done, synthetic, out, builder, build_id, cpu, memory_mb,
                                          keys, project)
        else:
            for s in rest:
                config = config.after(s)
            state = state.model_copy(update={"config": config})
            if rest:
                await asyncio.to_thread(self.catalog.cache_put, keys[-1], state)
        final = state.config.model_copy(update={"start_cmd": spec.startCmd, "ready_cmd": spec.readyCmd})
        return state.model_copy(update={"config": final})

    def _present(self, t: BuiltTemplate) -> bool:
        """A cache entry is usable while its layers are still in the store."""
        return all(self.platform.layers.has(r) for r in [t.image, *t.layers])

    async def _run_steps(self, state: BuiltTemplate, steps: list[Step], done: int, synthetic: int, out: _Log,
                         builder: list[str], build_id: str, cpu: int, memory_mb: int,
                         keys: list[str], project: str) -> BuiltTemplate:
        out.step = "base"
        out(f"Starting the builder ({cpu} CPU, {memory_mb} MiB, egress: package registries)")
        info = await self.platform.create(CreateRequest(args=ContainerArgs(
            image=state.image, layers=state.layers, cpu_cores_limit=cpu, memory_limit_mb=max(memory_mb, 1024),
            network_rules=BUILDER_EGRESS, ttl_running_stop=None, max_lifetime_s=int(self.max_build_s) + 60,
            labels={"dsec-role": "template-builder", "dsec.template-build": build_id})))
        sid = info.sandbox_id
        builder.append(sid)
        await asyncio.to_thread(self.catalog.heartbeat, build_id, sid)
        edge = self.platform.edge_for(sid)
        config = state.config
        for i in range(done, len(steps)):
            s = steps[i]
            out.step = str(i + 1 - synthetic) if i >= synthetic else "base"
            out(f"[{i + 1}/{len(steps)}] {_describe(s)}")
            if s.type == "RUN":
                who = config.expand(s.args[1]) if len(s.args) > 1 and s.args[1] else config.user
                code = await self._sh(edge, sid, s.args[0], who, config, out)
                if code != 0:
                    raise StepFailed(f"step {out.step} ({_describe(s)}) failed: exit status {code}", out.step)
            elif s.type == "COPY":
                await self._copy(edge, sid, s, config, out, project)
            elif s.type == "WORKDIR":
                d = shlex.quote(config.resolve(s.args[0]))
                owner = await _owner_spec(edge, sid, config.user)
                code = await self._sh(edge, sid, f"[ -d {d} ] || {{ mkdir -p {d} && chown {owner} {d}; }}", "root",
                                      config, out)
                if code != 0:
                    raise StepFailed(f"step {out.step} ({_describe(s)}) failed: exit status {code}", out.step)
            config = config.after(s)
        out.step = "finalize"
        out("Publishing the build's files as a layer")
        ref = f"tk/e2bt-{keys[-1][:16]}-{build_id[:8]}:1"
        # its project's and private before it exists (a public template's shares it once built):
        # another project must not mount what this build wrote
        await self.platform.template_layers([ref], project, public=False)
        layer = await edge.pack_diff(sid, ref, scrub_paths=[SCRATCH], default_scrub=False,
                                     source=f"template build {build_id}")
        result = BuiltTemplate(image=state.image, layers=[*state.layers, layer.ref], config=config)
        await asyncio.to_thread(self.catalog.cache_put, keys[-1], result)
        return result

    async def _sh(self, edge: EdgeAPI, sid: str, script: str, user: str, config: RunConfig, out: _Log) -> int:
        """Run ``script`` in a login shell (as E2B's builds do) as ``user``, in the current
        WORKDIR with the build's ENV; its output goes to the build log line by line."""
        try:
            acct = await _account(edge, sid, user)
        except UnknownUser as e:
            raise StepFailed(str(e), out.step or "base") from None
        envs = {"PATH": PATH, **acct.env(), **config.envs}
        cwd = config.workdir
        spec = ProcSpec(cmd="/bin/sh", args=["-c", SHELL, "sh", script], envs=envs, cwd=cwd,
                        owner=acct.owner, tag=None)
        return await _stream(edge.proc_start(sid, spec), out)

    async def _copy(self, edge: EdgeAPI, sid: str, s: Step, config: RunConfig, out: _Log, project: str) -> None:
        assert s.filesHash is not None
        data = await asyncio.to_thread(self.contexts.read, project, s.filesHash)
        archive = f"{SCRATCH}/{s.filesHash}.tar"
        await edge.write_file(sid, archive, data, 0o600)
        src, dest = config.expand(s.args[0]), s.args[1]
        owner = await _owner_spec(edge, sid, config.expand(s.args[2]) if len(s.args) > 2 and s.args[2]
                                  else config.user)
        mode = s.args[3] if len(s.args) > 3 else ""
        target = config.resolve(dest) + ("/" if config.expand(dest).endswith("/") else "")
        z = "z" if data[:2] == b"\x1f\x8b" else ""
        pattern = src.rstrip("/") or "."
        globbed = any(c in pattern for c in "*?[")
        script = (
            f"set -e; ctx={SCRATCH}/ctx-{s.filesHash[:16]}; rm -rf \"$ctx\"; mkdir -p \"$ctx\"; "
            f"tar -x{z}f {shlex.quote(archive)} -C \"$ctx\"; rm -f {shlex.quote(archive)}; cd \"$ctx\"; "
            f"chown -R {owner} . ; {f'chmod -R {mode} . ; ' if mode else ''}"
            f"set -- {pattern if globbed else shlex.quote(pattern)}; "
            f"[ -e \"$1\" ] || {{ echo \"COPY: no files match {shlex.quote(src)}\" >&2; exit 1; }}; "
            f"D={shlex.quote(target)}; multi=0; [ $# -gt 1 ] && multi=1; "
            "for s in \"$@\"; do "
            "if [ -d \"$s\" ] && [ ! -L \"$s\" ]; then mkdir -p \"$D\"; cp -a \"$s\"/. \"$D\"/; "
            "elif [ $multi = 1 ] || [ -d \"$D\" ] || [ \"${D%/}\" != \"$D\" ]; then "
            "mkdir -p \"$D\"; cp -a \"$s\" \"$D\"/; "
            "else mkdir -p \"$(dirname \"$D\")\"; cp -a \"$s\" \"$D\"; fi; done; "
            "cd /; rm -rf \"$ctx\""
        )
        code = await self._sh(edge, sid, script, "root", config.model_copy(update={"workdir": "/"}), out)
        if code != 0:
            raise StepFailed(f"step {out.step} ({_describe(s)}) failed: exit status {code}", out.step or "base")


def _describe(s: Step) -> str:
    if s.type == "RUN":
        text = "provision E2B's user" if s.args[0] == PROVISION_USER else s.args[0]
        return f"RUN {text[:200]}"
    if s.type == "ENV":
        return "ENV " + " ".join(f"{k}={v}" for k, v in zip(s.args[::2], s.args[1::2], strict=True))[:200]
    return f"{s.type} {' '.join(a for a in s.args if a)[:200]}"


async def _account(edge: EdgeAPI, sid: str, user: str) -> Account:
    name = user.split(":", 1)[0]
    if name in ("root", "0"):
        return ROOT
    accounts = await load_accounts(edge, sid)
    if name.isdigit():
        uid = int(name)
        match = [a for a in accounts.users.values() if a.uid == uid]
        return match[0] if match else Account(name, uid, uid, "/")
    return accounts.user(name)


async def _owner_spec(edge: EdgeAPI, sid: str, user: str) -> str:
    """``uid:gid`` for chown: a name the image lacks is the build's error, said clearly."""
    name, _, group = user.partition(":")
    try:
        acct = await _account(edge, sid, name)
    except UnknownUser as e:
        raise StepFailed(str(e), "base") from None
    if group and not group.isdigit():
        return f"{acct.uid}:{shlex.quote(group)}"
    return f"{acct.uid}:{group or acct.gid}"


async def _stream(stream: AsyncIterator[object], out: Callable[..., None]) -> int:
    """Follow a process to its end: output lines into the log, the exit code back."""
    partial = {"stdout": b"", "stderr": b""}
    code = -1
    try:
        async for ev in stream:
            kind = getattr(ev, "kind", "")
            if kind == "data":
                name = getattr(ev, "stream", "stdout")
                buf = partial.get(name, b"") + getattr(ev, "data", b"")
                *lines, partial[name] = buf.split(b"\n")
                for line in lines:
                    out(line.decode(errors="replace").rstrip("\r"))
                if len(partial[name]) > MAX_LINE:
                    out(partial[name].decode(errors="replace"))
                    partial[name] = b""
            elif kind == "lost":
                out("(output dropped: the build produced it faster than it could be logged)", "warn")
            elif kind == "end":
                code = getattr(ev, "exit_code", -1)
                break
    finally:
        with contextlib.suppress(Exception):
            await stream.aclose()  # type: ignore[attr-defined]
    for rest in partial.values():
        if rest:
            out(rest.decode(errors="replace"))
    if code == -1:
        raise SandboxError("the builder sandbox ended under the step")
    return code
