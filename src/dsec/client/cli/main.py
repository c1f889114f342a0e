"""The ``dsec`` command line: run the embedded platform, and drive sandboxes through
the SDK like any other client."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from typing import Annotated, Any

import rich.markup
import typer
from rich.table import Column, Table

from dsec.client.cli.common import StoreOpt, TokenOpt, UrlOpt, _errors, console, err, interruptible
from dsec.client.sdk import Client
from dsec.shared.wire.models import FNCALL_IMAGE

app = typer.Typer(help="dsec: elastic sandboxes for agentic RL", no_args_is_help=True,
                  pretty_exceptions_enable=False)
layer_app = typer.Typer(help="Environment layers", no_args_is_help=True)
app.add_typer(layer_app, name="layer")
fncall_app = typer.Typer(help="FnCall: short stateless tasks in pooled warm containers", no_args_is_help=True)
app.add_typer(fncall_app, name="fncall")
token_app = typer.Typer(help="API tokens: one project and one role each (made by an admin of the project or above)",
                        no_args_is_help=True)
app.add_typer(token_app, name="token")
@contextlib.contextmanager
def _api(url: str | None, token: str | None) -> Iterator[Client]:
    with _errors(), Client(url=url, token=token) as c:
        yield c


@app.command()
def setup(data_dir: Annotated[str | None, typer.Option()] = None, store: StoreOpt = None,
          toolchains: Annotated[bool, typer.Option(help="build FnCall's default toolchain layers")] = True) -> None:
    """Prepare this node: cgroups, dsec-init, and the built-in base layers (cached)."""
    from dsec.faces.e2b.template import ensure_interpreter_layer, ensure_user_layer
    from dsec.faces.embedded import data_dir_default, load_or_create_token
    from dsec.node.agent.native import ensure_binary, ensure_init_binary
    from dsec.node.host.prep import prepare_cgroups
    from dsec.node.layers.base import ensure_base_layers

    d = os.path.abspath(data_dir or data_dir_default())
    console.print(f"cgroups: {prepare_cgroups()}")
    ensure_init_binary(os.path.join(d, "bin", "dsec-init"))
    ensure_binary("dsec-reroot", os.path.join(d, "bin", "dsec-reroot"))  # in-place rollback (docs/snapshots.md)
    load_or_create_token(d)
    if shutil.which("qemu-system-x86_64"):
        from dsec.node.backends.vm.guest import ensure_guest
        from dsec.node.backends.vm.qemu import probe_accel

        with console.status("VM guest: kernel package, initramfs, accelerator probe"):
            for machine in ("microvm", "q35"):
                g = ensure_guest(d, machine)
            verdict = probe_accel(g.kernel, g.initrd, os.path.join(d, "vm", "accel.json"))
        console.print(f"VM guest {g.version}; accelerator {verdict['accel']} ({verdict.get('kvm_probe')})")
    layer_store = _store(d, store)
    with console.status("building base layers (first time: ~1 min)"):
        for layer in [*ensure_base_layers(layer_store), ensure_user_layer(layer_store),
                      ensure_interpreter_layer(layer_store)]:
            console.print(f"layer {layer.ref}: {layer.digest[:12]} {layer.size / 1e6:.1f} MB")
    if toolchains:
        from dsec.node.layers.toolchains import build_toolchains

        with console.status("building FnCall's toolchain layers (first time: ~2 min; `dsec fncall toolchains`)"):
            for layer in build_toolchains(layer_store):
                console.print(f"layer {layer.ref}: {layer.digest[:12]} {layer.size / 1e6:.1f} MB")


@app.command()
def ps(url: UrlOpt = None, token: TokenOpt = None, job: str | None = None,
       usage: Annotated[bool, typer.Option("--usage", help="CPU, memory, swap, disk, OOM kills of each")] = False,
       as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """List sandboxes."""
    with _api(url, token) as c:
        items = c.list(job=job, usage=usage)
    if as_json:
        print(json.dumps([i.model_dump(mode="json") for i in items], indent=1))
        return
    cols = ["CPU", "MEM"] + (["CPU S", "USED", "SWAP", "DISK", "PIDS", "OOM"] if usage else [])
    t = Table(Column("SANDBOX", no_wrap=True), "BACKEND", "STATE", Column("IMAGE", no_wrap=True), *cols,
              "AGE", "IDLE", "JOB")
    now = time.time()
    mib = 1 << 20
    for i in items:
        backend = i.backend.value + (f" ({i.vm.accelerator})" if i.vm else "")
        u = i.usage
        used = [f"{u.cpu_s:.1f}", f"{u.memory_bytes / mib:.1f}M", f"{u.swap_bytes / mib:.1f}M",
                f"{u.disk_bytes / mib:.1f}M", str(u.pids), str(u.oom_kills)] if u else ([""] * 6 if usage else [])
        t.add_row(i.sandbox_id, backend, i.state.value, i.image, f"{i.cpu_cores_limit:g}", f"{i.memory_limit_mb}M",
                  *used, f"{now - i.created_at:.0f}s", f"{now - i.last_active_at:.0f}s", i.job or "")
    console.print(t)


@app.command()
def create(image: str = "base/debian:12", memory_mb: int = 512, cpus: float = 1.0,
           ttl: int = 1800, job: str | None = None,
           backend: Annotated[str, typer.Option(help="container, microvm or vm")] = "container",
           disk_mb: Annotated[int, typer.Option(help="VM: writable disk size")] = 2048,
           template: Annotated[bool, typer.Option(help="VM: clone a snapshotted template")] = True,
           count: Annotated[int, typer.Option(help="this many, as one batch (up to 10000)")] = 1,
           all_or_nothing: Annotated[bool, typer.Option(
               help="with --count: all of them or none (quota and room held first, else refused at once)")] = False,
           url: UrlOpt = None, token: TokenOpt = None) -> None:
    """Create a sandbox and print its id (--count: a batch; prints each id made, exits 1 if any was not)."""
    from dsec.shared.wire.models import ContainerArgs, MicroVMArgs, VMArgs

    if backend == "container":
        args: ContainerArgs | MicroVMArgs | VMArgs = ContainerArgs(
            image=image, memory_limit_mb=memory_mb, cpu_cores_limit=cpus, ttl_running_stop=ttl, job=job)
    elif backend in ("microvm", "vm"):
        vm: dict[str, Any] = {"image": image, "memory_mb": memory_mb, "vcpus": max(1, round(cpus)),
                              "disk_mb": disk_mb, "template": template, "ttl_running_stop": ttl, "job": job}
        args = MicroVMArgs(**vm) if backend == "microvm" else VMArgs(**vm)
    else:
        raise typer.BadParameter("--backend must be container, microvm or vm")
    if count == 1 and not all_or_nothing:
        with _errors(), _api(url, token) as c:
            print(c.run_container(args).sandbox_id if isinstance(args, ContainerArgs) else
                  c.run_microvm(args).sandbox_id if isinstance(args, MicroVMArgs) else c.run_vm(args).sandbox_id)
        return
    interruptible()  # a batch can take minutes: Ctrl-C leaves it running (dsec ps shows it)
    with _errors(), _api(url, token) as c:
        batch = c.create_many(args, count, all_or_nothing=all_or_nothing)
        err.print(f"batch {batch.id}: {count} sandboxes" + (", all or nothing" if all_or_nothing else ""))
        made, failed = batch.result()
        for sb in made:
            print(sb.sandbox_id)
        info = batch.get()
        for item in failed:
            err.print(f"item {item.index}: {item.state}" + (f" ({item.error}: {item.reason})" if item.error else ""))
        if info.reason:
            err.print(f"batch {info.state}: {info.reason}")
        if failed:
            raise typer.Exit(1)


@app.command()
def pause(sandbox_id: str, url: UrlOpt = None, token: TokenOpt = None) -> None:
    """Pause a sandbox (a VM's memory goes to a snapshot file); any request resumes it."""
    with _errors(), _api(url, token) as c:
        info = c.connect(sandbox_id).pause()
        print(info.model_dump_json(include={"sandbox_id", "state", "vm"}))


@token_app.command("create")
def token_create(project: str, role: Annotated[str, typer.Option(help="admin (of the project's subtree), builder, "
                                                                      "runner or reader")] = "runner",
                 name: str = "",
                 ttl: Annotated[str | None, typer.Option(help="expires after this long: 90s, 30m, 12h, 30d")] = None,
                 url: UrlOpt = None, token: TokenOpt = None) -> None:
    """A token for PROJECT; prints its secret (shown only now)."""
    ttl_s = _duration(ttl, "--ttl") if ttl is not None else None
    with _errors(), _api(url, token) as c:
        info = c.create_token(project, role, name, ttl_s=ttl_s)
        print(info.model_dump_json())


def _duration(text: str, param: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    num, unit = text[:-1], text[-1:]
    if unit.isdigit():
        num, unit = text, "s"
    try:
        value = float(num) * units[unit]
    except (KeyError, ValueError):
        raise typer.BadParameter(f"{text!r}: a number with s, m, h or d, like 30d", param_hint=param) from None
    if value <= 0:
        raise typer.BadParameter(f"{text!r} must be more than 0", param_hint=param)
    return value


@token_app.command("events")
def token_events(after: int = 0, limit: int = 1000, url: UrlOpt = None, token: TokenOpt = None) -> None:
    """IAM changes (tokens, projects, quotas): who (a token id; admin is the node's own), what, when."""
    with _errors(), _api(url, token) as c:
        for e in c.iam_events(after, limit):
            print(e.model_dump_json())


@token_app.command("list")
def token_list(url: UrlOpt = None, token: TokenOpt = None) -> None:
    with _errors(), _api(url, token) as c:
        for t in c.tokens():
            print(t.model_dump_json(exclude={"token"}))


@token_app.command("revoke")
def token_revoke(token_id: str, url: UrlOpt = None, token: TokenOpt = None) -> None:
    with _errors(), _api(url, token) as c:
        c.revoke_token(token_id)
        print(f"revoked {token_id}")


@app.command()
def audit(sandbox_id: str, flagged: Annotated[bool, typer.Option(help="only detector flags")] = False,
          kind: Annotated[str | None, typer.Option(help="process, exec, file_write, egress_denied, flag, ...")] = None,
          limit: int = 200, url: UrlOpt = None, token: TokenOpt = None) -> None:
    """What happened in a sandbox: processes, platform requests, egress denials, flags."""
    import datetime

    with _errors(), _api(url, token) as c:
        for r in c.connect(sandbox_id).audit(kind=kind, flagged=flagged, limit=limit):
            when = datetime.datetime.fromtimestamp(r.ts).strftime("%H:%M:%S.%f")[:-3]
            flag = f" [red]<{r.flag}>[/red]" if r.flag else ""
            console.print(f"{when} {r.kind:<13}{flag} {rich.markup.escape(r.detail)}", highlight=False)


@app.command()
def resume(sandbox_id: str, url: UrlOpt = None, token: TokenOpt = None) -> None:
    """Resume a paused sandbox."""
    with _errors(), _api(url, token) as c:
        info = c.connect(sandbox_id).resume()
        print(info.model_dump_json(include={"sandbox_id", "state", "vm"}))


@app.command("exec", context_settings={"allow_interspersed_args": False})
def exec_(sandbox_id: str, cmd: Annotated[list[str], typer.Argument(help="command and arguments")],
          timeout: float = 300.0, url: UrlOpt = None, token: TokenOpt = None) -> None:
    """Run a command in a sandbox, streaming its output; exits with its exit code (Ctrl-C: 130)."""
    interruptible()
    with _api(url, token) as c:
        sb = c.connect(sandbox_id)
        if cmd and cmd[0] == "--":
            cmd = cmd[1:]
        if not cmd:
            raise typer.BadParameter("give a command after the sandbox id")
        argv = cmd if len(cmd) > 1 else cmd[0]
        code = 0
        try:
            for ev in sb.exec_stream(argv, timeout=timeout):
                if ev.type == "stdout":
                    sys.stdout.write(ev.data or "")
                    sys.stdout.flush()
                elif ev.type == "stderr":
                    sys.stderr.write(ev.data or "")
                    sys.stderr.flush()
                elif ev.result is not None:
                    code = ev.result.exit_code
                    if ev.result.timed_out:
                        err.print(f"[yellow]timed out after {timeout}s[/yellow]")
        except KeyboardInterrupt:  # Ctrl-C: the stream is closed, the way out is 130 as a shell's
            code = 130
    raise typer.Exit(code)


@app.command()
def shell(sandbox_id: str, url: UrlOpt = None, token: TokenOpt = None) -> None:
    """Interactive shell (TTY) in a sandbox."""
    from dsec.client.cli.tty import run_tty

    with _api(url, token) as c:
        sb = c.connect(sandbox_id)
        cols, rows = os.get_terminal_size(sys.stdin.fileno()) if sys.stdin.isatty() else (80, 24)
        ws_url, tok = sb.tty_url(cols, rows), c.token
    raise typer.Exit(asyncio.run(run_tty(ws_url, tok)))


@app.command()
def stop(sandbox_ids: list[str], url: UrlOpt = None, token: TokenOpt = None) -> None:
    """Stop sandboxes and release everything they held."""
    with _api(url, token) as c:
        for sid in sandbox_ids:
            info = c.connect(sid).stop()
            console.print(f"{sid} {info.state.value}")


def _store(data_dir: str | None, store: str | None = None):  # type: ignore[no-untyped-def]
    """The layer store the local `dsec layer` commands work on; with $DSEC_DB set, a
    cluster's (its catalog is in that database)."""
    from dsec.faces.embedded import data_dir_default
    from dsec.node.layers.store import open_store

    return open_store(data_dir or data_dir_default(), store, os.environ.get("DSEC_DB") or None)


@layer_app.command("import-dir")
def layer_import_dir(directory: str, ref: str,
                     kind: Annotated[str | None, typer.Option(help="base, workspace or toolkit")] = None,
                     data_dir: Annotated[str | None, typer.Option()] = None, store: StoreOpt = None) -> None:
    """Publish a directory tree as an immutable EROFS layer (e.g. ws/attrs-bug-17:v1)."""
    with _errors():
        with console.status(f"building EROFS image of {directory}"):
            layer = _store(data_dir, store).import_dir(directory, ref, kind=kind, source=f"import-dir {directory}")
    console.print(f"{layer.ref} {layer.kind} sha256:{layer.digest} {layer.size / 1e6:.1f} MB")


@layer_app.command("import-oci")
def layer_import_oci(source: Annotated[str, typer.Argument(
        help="registry ref [http://]host/name:tag, oci:DIR[:tag], docker-archive:FILE.tar")],
        ref: str, collapse_mb: Annotated[int, typer.Option(help="collapse consecutive layers under this size")] = 64,
        data_dir: Annotated[str | None, typer.Option()] = None, store: StoreOpt = None) -> None:
    """Convert an OCI image once to EROFS layers and publish it (e.g. base/python:3.12)."""
    interruptible()
    from rich.progress import Progress as Bar

    from dsec.node.layers.oci import import_oci

    with _errors():
        with Bar(console=console, transient=True) as bar:
            task = bar.add_task(f"importing {source}", total=None)
            layer = import_oci(_store(data_dir, store), source, ref, collapse_bytes=collapse_mb * 1024 * 1024,
                               progress=lambda _what, done, total: bar.update(task, completed=done, total=total))
    console.print(f"{layer.ref} {layer.kind} {len(layer.all_blobs)} EROFS image(s) {layer.size / 1e6:.1f} MB")


@layer_app.command("build")
def layer_build(spec: Annotated[str, typer.Argument(help="TOML spec: ref, image, layers, steps, files, scrub_paths")],
                url: UrlOpt = None, token: TokenOpt = None) -> None:
    """Build a layer: run the spec's steps in a fresh sandbox, publish its writes (pack_diff)."""
    interruptible()
    from dsec.node.layers.build import BuildSpec, build_layer

    with _api(url, token) as c:
        layer = build_layer(c, BuildSpec.load(spec),
                            log=lambda line: console.print(line, highlight=False, markup=False))
    console.print(f"{layer.ref} {layer.kind} sha256:{layer.digest[:16]} {layer.size / 1e6:.1f} MB")


@layer_app.command("ls")
def layer_ls(url: UrlOpt = None, token: TokenOpt = None) -> None:
    """Published layers."""
    with _api(url, token) as c:
        layers = c.layers()
    t = Table(Column("LAYER", no_wrap=True), "KIND", "DIGEST", "SIZE MB", "PARENT")
    for layer in layers:
        t.add_row(layer.ref, layer.kind, layer.digest[:16], f"{layer.size / 1e6:.1f}", layer.parent_image or "")
    console.print(t)


@layer_app.command("inspect")
def layer_inspect(ref: str, url: UrlOpt = None, token: TokenOpt = None) -> None:
    """Everything the catalog knows about a layer, as JSON."""
    with _api(url, token) as c:
        print(c.layer(ref).model_dump_json(indent=1))


@layer_app.command("rm")
def layer_rm(refs: list[str], url: UrlOpt = None, token: TokenOpt = None) -> None:
    """Unpublish layers (refused while a sandbox uses one); `dsec layer gc` frees blobs."""
    with _api(url, token) as c:
        for ref in refs:
            console.print(f"removed {c.remove_layer(ref).ref}")


@layer_app.command("visibility")
def layer_visibility(ref: str,
                     visibility: Annotated[str, typer.Argument(help="public | project | private")],
                     url: UrlOpt = None, token: TokenOpt = None) -> None:
    """Who may see and use a layer: every project, its owner project's subtree, or the owner alone."""
    with _api(url, token) as c:
        layer = c.set_layer_visibility(ref, visibility)
    console.print(f"{layer.ref} {layer.visibility} (project {layer.owner or '-'})")


@layer_app.command("stats")
def layer_stats(url: UrlOpt = None, token: TokenOpt = None,
                as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """What each node fetched of each layer: bytes from the shared store, cache hits and misses, chunk latency."""
    with _api(url, token) as c:
        stats = c.storage_stats()
    if as_json:
        print(json.dumps([s.model_dump() for s in stats], indent=1))
        return
    for s in stats:
        console.print(f"edge {s.edge}: {s.backend} store, {s.mode}; chunk cache {s.cache_bytes / 1e6:.1f}"
                      f"/{s.cache_max_bytes / 1e6:.0f} MB, {s.cache_entries} chunks, {s.cache_evictions} evicted, "
                      f"{s.cache_corrupt} corrupt refetched; copied whole {s.copied_bytes / 1e6:.1f} MB")
        t = Table(Column("LAYERS", no_wrap=True), "DATA BLOB", "FETCHED MB", "CHUNKS", "HITS", "MISSES",
                  "PREFETCHED", "ERRORS", "CHUNK MS")
        for b in s.blobs:
            t.add_row(",".join(b.layers) or "-", b.data[:12], f"{b.remote_bytes / 1e6:.1f}", str(b.remote_chunks),
                      str(b.hits), str(b.misses), str(b.prefetched), str(b.errors), f"{b.chunk_latency_s * 1e3:.1f}")
        console.print(t)


@layer_app.command("gc")
def layer_gc(url: UrlOpt = None, token: TokenOpt = None) -> None:
    """Delete layer blobs that nothing references."""
    with _api(url, token) as c:
        removed = c.gc_layers()
    console.print(f"removed {len(removed)} blobs")


@fncall_app.command("languages")
def fncall_languages(image: str = FNCALL_IMAGE, url: UrlOpt = None, token: TokenOpt = None) -> None:
    """Languages the FnCall image has toolchains for."""
    with _api(url, token) as c:
        print("\n".join(c.fncall_languages(image)))


@fncall_app.command("toolchains")
def fncall_toolchains(names: Annotated[list[str] | None, typer.Argument(
                          help="`build NAME...` builds those ('default', 'all': those sets); none: list them")] = None,
                      data_dir: Annotated[str | None, typer.Option()] = None, store: StoreOpt = None) -> None:
    """List FnCall's toolchain and library layers, or build some (each once: skipped when built)."""
    from dsec.node.layers.toolchains import TOOLCHAINS, build_toolchains

    layer_store = _store(data_dir, store)
    if names and names[0] == "build":
        names = names[1:] or ["default"]
    if not names:
        for name, tc in TOOLCHAINS.items():
            ref = tc.ref(name)
            built = "built" if layer_store.has(ref) else ("default, not built" if tc.default else "on demand")
            print(f"{name:<12} {ref:<28} {built:<19} {' '.join(tc.languages) or '(library set)'}")
        return
    if names == ["default"]:
        names = [n for n, t in TOOLCHAINS.items() if t.default]
    elif names == ["all"]:
        names = list(TOOLCHAINS)
    unknown = [n for n in names if n not in TOOLCHAINS]
    if unknown:
        err.print(f"unknown toolchain {', '.join(unknown)}; known: {', '.join(TOOLCHAINS)}")
        raise typer.Exit(2)
    for layer in build_toolchains(layer_store, names):
        console.print(f"layer {layer.ref}: {layer.digest[:12]} {layer.size / 1e6:.1f} MB")


@fncall_app.command("run")
def fncall_run(language: str, source: Annotated[str, typer.Argument(help="source file, - for stdin")],
               stdin_file: Annotated[str | None, typer.Option("--stdin", help="file fed to the program")] = None,
               time_limit: float = 5.0, memory_mb: int = 256, image: str = FNCALL_IMAGE,
               url: UrlOpt = None, token: TokenOpt = None) -> None:
    """Run a source file once; prints its output, exits with its exit code (3 on a limit)."""
    interruptible()
    from dsec.shared.wire.models import FnCallArgs

    code = sys.stdin.read() if source == "-" else open(source).read()
    stdin = open(stdin_file).read() if stdin_file else ""
    with _api(url, token) as c:
        r = c.fncall(FnCallArgs(language=language, code=code, stdin=stdin, time_limit_s=time_limit,
                                memory_limit_mb=memory_mb, image=image))
    sys.stdout.write(r.stdout)
    sys.stderr.write(r.stderr)
    err.print(f"{r.status} exit={r.exit_code} signal={r.signal} cpu={r.time_ms:.0f}ms wall={r.wall_ms:.0f}ms "
              f"mem={r.memory_kb}KB")
    raise typer.Exit(r.exit_code if r.status in ("ok", "runtime_error") and r.exit_code is not None else 3)


def main() -> None:
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    app()


from dsec.client.cli import servers  # noqa: E402  (registers serve, edge serve and apiserver on app)

servers.register(app)
from dsec.client.cli.cluster import cluster_app  # noqa: E402

app.add_typer(cluster_app, name="cluster")
from dsec.client.cli.jobs import job_app  # noqa: E402

app.add_typer(job_app, name="job")
from dsec.client.cli.checkpoints import checkpoint_app, drain, move, restore  # noqa: E402
from dsec.client.cli.nodes import node_app, nodes  # noqa: E402
from dsec.client.cli.projects import project_app  # noqa: E402
from dsec.client.cli.rollouts import rollout_app, worker  # noqa: E402
from dsec.client.cli.top import top  # noqa: E402

app.add_typer(node_app, name="node")
app.add_typer(checkpoint_app, name="checkpoint")
from dsec.client.cli.snapshots import branch, snapshot_app  # noqa: E402

app.add_typer(snapshot_app, name="snapshot")
app.command("branch")(branch)
app.command("move")(move)
app.command("restore")(restore)
node_app.command("drain")(drain)
app.command("nodes")(nodes)
app.command("top")(top)
app.add_typer(rollout_app, name="rollout")
app.add_typer(project_app, name="project")
app.command("rollout-worker")(worker)


if __name__ == "__main__":
    main()
