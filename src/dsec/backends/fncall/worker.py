"""The FnCall worker: a warm Python process inside a pooled FnCall container.

Copied into the container (root-owned, read-only to calls) and started by the edge with a
socketpair as stdin/stdout. Standard library only. It reads one request at a time
(4-byte big-endian length + JSON), runs it, and answers the same way.

A call runs in a child forked from this warm process: for Python the child executes the
code itself (modules named at start are already imported), for other languages it
execs the compiled artifact or interpreter. Before that the child drops to the worker's
own unprivileged uid, enters a fresh scratch dir, and takes rlimits (CPU seconds,
address space, processes, file size, no core dumps). After each run everything the uid
left is killed and its files outside the scratch dir are looked for; if the call left
anything behind (a process, a file, a timeout), the answer says ``retire`` and the edge
replaces the container instead of trusting the cleanup.
"""

from __future__ import annotations

import base64
import contextlib
import gc
import importlib
import json
import os
import resource
import select
import shutil
import signal
import socket
import struct
import sys
import time
import traceback

LANGS = {
    # name: (source file, compile argv or None, run argv)
    "python": ("main.py", None, None),
    "bash": ("main.sh", None, ["/bin/bash", "main.sh"]),
    "c": ("main.c", ["gcc", "-O2", "-std=gnu11", "-o", "main", "main.c", "-lm"], ["./main"]),
    "cpp": ("main.cpp", ["g++", "-O2", "-std=gnu++17", "-o", "main", "main.cpp"], ["./main"]),
}
PATH = "/usr/local/bin:/usr/bin:/bin"
ARTIFACT_MAX = 16 << 20
SHARED_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm", "/dev/mqueue")


def available() -> list[str]:
    out = []
    for name, (_, comp, run) in LANGS.items():
        tool = (comp or run or [sys.executable])[0]
        if tool.startswith("/") and os.path.exists(tool) or shutil.which(tool, path=PATH):
            out.append(name)
    return out


def _recv() -> dict | None:  # type: ignore[type-arg]
    head = _read_exact(4)
    if not head:
        return None
    return json.loads(_read_exact(struct.unpack(">I", head)[0]))  # type: ignore[no-any-return]


def _read_exact(n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        got = os.read(0, n - len(buf))
        if not got:
            return b""
        buf += got
    return buf


def _send(obj: object) -> None:
    data = json.dumps(obj).encode()
    os.write(1, struct.pack(">I", len(data)) + data)


class Worker:
    def __init__(self, uid: int, root: str) -> None:
        self.uid = uid
        self.root = root  # /run/fncall/<uid>: root-only, holds captured output
        self.scratch = f"/tmp/fncall-{uid}"
        os.makedirs(root, mode=0o700, exist_ok=True)
        self.zygote = Zygote(self)

    # ---- one call ---------------------------------------------------------
    def handle(self, req: dict) -> dict:  # type: ignore[type-arg]
        lang = req["language"]
        src_name, compile_argv, run_argv = LANGS[lang]
        self._fresh_scratch()
        try:
            for rel, text in req.get("files", {}).items():
                self._write(rel, text.encode())
            self._write(src_name, req["code"].encode())
            out: dict = {"runs": [], "retire": False}  # type: ignore[type-arg]
            limits = req["limits"]
            if compile_argv and req.get("artifact"):  # an identical compile ran before: reuse its output
                self._write("main", base64.b64decode(req["artifact"]), mode=0o755)
                out["compile"] = {"status": "ok", "cached": True, "time_ms": 0.0, "wall_ms": 0.0, "memory_kb": 0}
            elif compile_argv:
                comp = self.run(compile_argv, b"", {**limits, "time_limit_s": req["compile_time_limit_s"],
                                                    "memory_limit_mb": max(limits["memory_limit_mb"], 1024),
                                                    "pids_limit": max(limits["pids_limit"], 64)})
                out["compile"] = comp
                out["retire"] |= comp.pop("tainted")
                if comp["status"] != "ok":
                    return out
                artifact = os.path.join(self.scratch, "main")
                if os.path.isfile(artifact) and os.path.getsize(artifact) <= ARTIFACT_MAX:
                    with open(artifact, "rb") as f:
                        out["artifact"] = base64.b64encode(f.read()).decode()
            for stdin in req["stdins"]:
                res = self.run(run_argv, stdin.encode(), limits, python_code=req["code"] if lang == "python" else None)
                out["retire"] |= res.pop("tainted")
                out["runs"].append(res)
            return out
        finally:
            shutil.rmtree(self.scratch, ignore_errors=True)

    def _fresh_scratch(self) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)
        os.mkdir(self.scratch, 0o700)
        os.chown(self.scratch, self.uid, self.uid)

    def _write(self, rel: str, data: bytes, mode: int = 0o644) -> None:
        path = os.path.normpath(os.path.join(self.scratch, rel))
        if not path.startswith(self.scratch + "/"):
            raise ValueError(f"file path {rel!r} leaves the scratch dir")
        parent = os.path.dirname(path)
        os.makedirs(parent, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        d = parent
        while d.startswith(self.scratch):
            os.chown(d, self.uid, self.uid)
            d = os.path.dirname(d)
        os.chown(path, self.uid, self.uid)

    def run(self, argv: list[str] | None, stdin: bytes, limits: dict, python_code: str | None = None) -> dict:  # type: ignore[type-arg]
        out_path, err_path, in_path = (os.path.join(self.root, f"{n}") for n in ("out", "err", "in"))
        with open(in_path, "wb") as f:
            f.write(stdin)
        cap = int(limits["output_limit_kb"]) * 1024
        in_fd = os.open(in_path, os.O_RDONLY)
        out_fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        err_fd = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        code_path = None
        if python_code is not None:
            code_path = os.path.join(self.root, "code")
            with open(code_path, "w") as f:
                f.write(python_code)
        spec = {"argv": argv, "limits": limits, "cap": cap, "code_path": code_path}
        t0 = time.monotonic()
        try:
            status, usage, timed_out = self.zygote.run(spec, [in_fd, out_fd, err_fd],
                                                       float(limits["time_limit_s"]) * 2 + 1.0)
        finally:
            for fd in (in_fd, out_fd, err_fd):
                os.close(fd)
        wall = time.monotonic() - t0
        tainted = self._sweep() or timed_out
        stdout = _read_capped(out_path, cap)
        stderr = _read_capped(err_path, 64 * 1024)
        cpu = usage["utime"] + usage["stime"]
        res = {"exit_code": None, "signal": None, "stdout": stdout[0], "stderr": stderr[0],
               "time_ms": round(cpu * 1000, 2), "wall_ms": round(wall * 1000, 2),
               "memory_kb": usage["maxrss"], "tainted": tainted}
        if os.WIFEXITED(status):
            res["exit_code"] = os.WEXITSTATUS(status)
        elif os.WIFSIGNALED(status):
            res["signal"] = os.WTERMSIG(status)
        mem_limit_kb = int(limits["memory_limit_mb"]) * 1024
        if timed_out or cpu > float(limits["time_limit_s"]) or res["signal"] == signal.SIGXCPU:
            res["status"] = "time_limit"
        elif stdout[1] or res["signal"] == signal.SIGXFSZ:
            res["status"] = "output_limit"
        elif usage["maxrss"] >= mem_limit_kb * 0.95 or "MemoryError" in stderr[0] or "bad_alloc" in stderr[0]:
            res["status"] = "memory_limit"
        elif res["exit_code"] == 0:
            res["status"] = "ok"
        else:
            res["status"] = "runtime_error"
        return res

    def _child(self, argv: list[str] | None, python_code: str | None, limits: dict,  # type: ignore[type-arg]
               cap: int, in_fd: int, out_fd: int, err_fd: int) -> None:
        try:
            os.setsid()
            for src, dst in ((in_fd, 0), (out_fd, 1), (err_fd, 2)):
                os.dup2(src, dst)
            os.closerange(3, 1 << 16)
            cpu = int(float(limits["time_limit_s"])) + 1
            mem = int(limits["memory_limit_mb"]) << 20
            resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
            resource.setrlimit(resource.RLIMIT_AS, (mem + _vm_size(), mem + _vm_size()))
            resource.setrlimit(resource.RLIMIT_NPROC, (int(limits["pids_limit"]),) * 2)
            resource.setrlimit(resource.RLIMIT_FSIZE, (cap + 1, cap + 1))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            os.setgroups([])
            os.setgid(self.uid)
            os.setuid(self.uid)
            os.chdir(self.scratch)
            env = {"PATH": PATH, "HOME": self.scratch, "LANG": "C.UTF-8", "TMPDIR": self.scratch}
            if python_code is None:
                assert argv is not None
                os.execve(argv[0] if argv[0].startswith(("/", ".")) else shutil.which(argv[0], path=PATH) or argv[0],
                          argv, env)
            os.environ.clear()
            os.environ.update(env)
            sys.stdin = open(0, closefd=False)  # noqa: SIM115
            sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
            sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
            sys.argv = ["main.py"]
            code = 0
            try:
                exec(compile(python_code, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except BaseException:
                traceback.print_exc()
                code = 1
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except BaseException:
                    code = code or 1
            os._exit(code)
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(127)

    def _sweep(self) -> bool:
        """Kill whatever the uid still runs and remove what it wrote outside the scratch
        dir; True when there was anything (the container is then retired)."""
        left = False
        for _ in range(3):
            pids = _pids_of(self.uid)
            if not pids:
                break
            left = True
            killer = os.fork()
            if killer == 0:  # signals every process of the uid, nothing else
                try:
                    os.setuid(self.uid)
                    os.kill(-1, signal.SIGKILL)
                finally:
                    os._exit(0)
            os.waitpid(killer, 0)
            time.sleep(0.01)
        for top in SHARED_WRITABLE:  # only their top level is writable by a call's uid
            try:
                entries = os.listdir(top)
            except OSError:
                continue
            for name in entries:
                path = os.path.join(top, name)
                if path == self.scratch:
                    continue
                try:
                    if os.lstat(path).st_uid != self.uid:
                        continue
                    left = True
                    if os.path.isdir(path) and not os.path.islink(path):
                        shutil.rmtree(path, ignore_errors=True)
                    else:
                        os.unlink(path)
                except OSError:
                    pass
        return left


class Zygote:
    """Forks every call's process. It is forked from the worker before the worker reads
    any request and only ever sees small control messages (argv, limits, a path), so a
    call's process holds no other call's code or input in its memory. It keeps one child
    forked ahead, so a call does not wait for fork(), and reaps it for its rusage."""

    def __init__(self, worker: Worker) -> None:
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.pid = os.fork()
        if self.pid == 0:
            try:
                self.sock.close()
                _zygote(theirs, worker)
            finally:
                os._exit(0)
        theirs.close()

    def run(self, spec: dict, fds: list[int], wall_limit: float) -> tuple[int, dict, bool]:  # type: ignore[type-arg]
        socket.send_fds(self.sock, [json.dumps(spec).encode()], fds)
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        timed_out = not poller.poll(wall_limit * 1000)
        if timed_out:  # the zygote kills the call's process group and still reports it
            self.sock.send(b"kill")
        done = json.loads(self.sock.recv(4096))
        return int(done.pop("status")), done, timed_out


def _zygote(sock: socket.socket, worker: Worker) -> None:
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # the worker's channel to the edge must not live on in here
        os.dup2(null, fd)
    keep = sock.fileno()
    os.closerange(3, keep)
    os.closerange(keep + 1, 1 << 16)
    spare = _fork_ahead(worker)
    while True:
        msg, fds, _, _ = socket.recv_fds(sock, 65536, 3)
        if not msg:
            return
        pid, ctl = spare
        try:
            socket.send_fds(ctl, [msg], fds)
        except OSError:  # the spare died: fork another
            pid, ctl = _fork_ahead(worker)
            socket.send_fds(ctl, [msg], fds)
        ctl.close()
        for fd in fds:
            os.close(fd)
        pidfd = os.pidfd_open(pid)
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        poller.register(sock, select.POLLIN)
        while not any(fd == pidfd for fd, _ in poller.poll()):
            if sock.recv(16) == b"kill":
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
                break
        os.close(pidfd)
        _, status, ru = os.wait4(pid, 0)
        sock.send(json.dumps({"status": status, "utime": ru.ru_utime, "stime": ru.ru_stime,
                              "maxrss": ru.ru_maxrss}).encode())
        spare = _fork_ahead(worker)


def _fork_ahead(worker: Worker) -> tuple[int, socket.socket]:
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        try:
            mine.close()
            msg, fds, _, _ = socket.recv_fds(theirs, 65536, 3)
            if msg and len(fds) == 3:
                spec = json.loads(msg)
                code = None
                if spec["code_path"]:
                    with open(spec["code_path"]) as f:
                        code = f.read()
                worker._child(spec["argv"], code, spec["limits"], spec["cap"], *fds)
        finally:
            os._exit(127)
    theirs.close()
    return pid, mine


def _pids_of(uid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    out.append(int(name))
            except OSError:
                pass
    return out


def _vm_size() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()


def _read_capped(path: str, cap: int) -> tuple[str, bool]:
    with open(path, "rb") as f:
        data = f.read(cap + 1)
    return data[:cap].decode("utf-8", errors="replace"), len(data) > cap


def main() -> None:
    uid = int(sys.argv[1])
    for mod in sys.argv[2:]:  # warm: imported once, shared by every forked call
        try:
            importlib.import_module(mod)
        except ImportError:
            pass
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    # everything imported so far moves out of the collector's reach: a forked call then
    # does not dirty (copy) those pages just by running a collection
    gc.freeze()
    w = Worker(uid, f"/run/fncall/{uid}")
    _send({"ready": True, "languages": available()})
    while (req := _recv()) is not None:
        try:
            _send(w.handle(req))
        except Exception as e:  # the edge gets the reason; the worker stays up
            _send({"error": f"{type(e).__name__}: {e}", "retire": True})


if __name__ == "__main__":
    main()
