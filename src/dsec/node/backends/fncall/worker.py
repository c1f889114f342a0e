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
import ctypes
import gc
import importlib
import json
import os
import re
import resource
import select
import shutil
import signal
import socket
import stat
import struct
import sys
import time
import traceback
from typing import NamedTuple


class Lang(NamedTuple):
    src: str  # the file the code is written to
    compile: list[str] | None
    run: list[str] | None  # None: Python, run in the forked warm process itself
    # address space the runtime reserves up front whatever the program does (PROT_NONE
    # arenas, code ranges, thread stacks): added to RLIMIT_AS so a memory limit bounds
    # the program's own use, not the runtime's reservations. Measured on Debian 12.
    extra_as_mb: int = 0
    min_pids: int = 0  # threads the runtime starts on its own (RLIMIT_NPROC counts threads)
    compile_mb: int = 1024  # the compiler's memory limit, whatever the call's
    env: tuple[tuple[str, str], ...] = ()
    needs: str | None = None  # a path the language's toolchain layer has: the language is served where it exists
    # symlinks made in the scratch dir (name -> target): a test runner's modules and config beside the code
    links: tuple[tuple[str, str], ...] = ()
    prefix: str = ""  # the code must start with this (after leading blanks), else it is put in front
    # put in front of the code on its own first line, unless the code has preprocessor
    # definitions (which must come first)
    preamble: str = ""
    # a regex whose first group names the program's main class or object: "{main}" in src
    # and argv stands for it; without a match, main_default (None: a compile error)
    main_re: str | None = None
    main_default: str | None = None
    # directories of the image copied into the scratch dir, owned by the call (a warm build
    # cache the runtime must be able to write to): image path -> name in the scratch dir
    seed: tuple[tuple[str, str], ...] = ()
    run_file_mb: int = 0  # a run that compiles (go test) writes files bigger than the output limit


# "{mem}" in a run argv is the call's memory limit in MB (the managed runtimes' heap size)
_JVM = ["-XX:+UseSerialGC", "-XX:ReservedCodeCacheSize=64m", "-XX:CompressedClassSpaceSize=64m",
        "-XX:MaxMetaspaceSize=256m",
        "-XX:-UsePerfData"]  # else the JVM writes /tmp/hsperfdata_<user>, and the sweep retires the container
# glibc gives each thread a 64 MiB malloc arena reservation, which RLIMIT_AS counts
_FEW_ARENAS = (("MALLOC_ARENA_MAX", "2"),)
_CPUS = "2"  # a pool container's CPU limit: runtimes size their thread pools by it, not the host's cores
LANGS = {
    "python": Lang("main.py", None, None),
    "bash": Lang("main.sh", None, ["/bin/bash", "main.sh"]),
    "c": Lang("main.c", ["gcc", "-O2", "-std=gnu11", "-o", "main", "main.c", "-lm"], ["./main"]),
    "cpp": Lang("main.cpp", ["g++", "-O2", "-std=gnu++17", "-o", "main", "main.cpp"], ["./main"]),
    # SandboxFusion's conventions: class Main in Main.java, assertions enabled
    "java": Lang("Main.java", ["javac", "-J-Xmx512m", "-J-XX:TieredStopAtLevel=1", *("-J" + f for f in _JVM),
                               "-encoding", "UTF-8", "-d", ".", "Main.java"],
                 ["java", "-Xmx{mem}m", *_JVM, "-ea", "-cp", ".", "Main"],
                 extra_as_mb=512, min_pids=64, env=_FEW_ARENAS),
    "go": Lang("main.go", ["go", "build", "-o", "main", "main.go"], ["./main"],
               extra_as_mb=768, min_pids=16, env=(("GOMAXPROCS", _CPUS), ("GO111MODULE", "off"))),
    # NODE_PATH: the npm toolchain layer's modules (lodash, ...), where a call stacks that layer
    "nodejs": Lang("main.js", None, ["node", "--max-old-space-size={mem}", f"--v8-pool-size={_CPUS}", "main.js"],
                   extra_as_mb=512, min_pids=16,
                   env=(*_FEW_ARENAS, ("NODE_PATH", "/usr/local/lib/dsec-node/node_modules"))),
    # debuginfo stripped: 0.5 MB instead of 11 MB (std's), and a third of the link time
    "rust": Lang("main.rs", ["rustc", "-O", "--edition=2021", "-C", "strip=debuginfo", "-o", "main", "main.rs"],
                 ["./main"], compile_mb=2048, env=_FEW_ARENAS),  # rustc's threads ran out at 1 GiB
}
# the toolchain layers' languages (dsec.node.layers.toolchains builds them; the worker, standard
# library only, names the few paths it needs itself)
_NODE = "/usr/local/lib/dsec-node"
_JUNIT = "/usr/share/java/junit-platform-console-standalone.jar"
_JAVA_OPTS = " ".join(["-Xss8m", *_JVM])
_NODE_LINKS = (("node_modules", f"{_NODE}/node_modules"),)
_CS_ENTRY = "/usr/local/lib/dsec-cs/DsecEntry.cs"
LANGS.update({
    # pytest as SandboxFusion runs it: the file given to pytest, its exit status the verdict
    "pytest": Lang("test_main.py", None, ["python3", "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_main.py"],
                   needs="/usr/lib/python3/dist-packages/pytest"),
    "ruby": Lang("main.rb", None, ["ruby", "main.rb"], min_pids=8, env=_FEW_ARENAS),
    "php": Lang("main.php", None, ["php", "-f", "main.php"], prefix="<?php", env=_FEW_ARENAS),
    "perl": Lang("main.pl", None, ["perl", "main.pl"]),
    "lua": Lang("main.lua", None, ["lua5.4", "main.lua"]),
    "r": Lang("main.R", None, ["Rscript", "main.R"], min_pids=8, env=_FEW_ARENAS),
    # SandboxFusion's D_ut mode: unittest blocks run, then main
    "d": Lang("main.d", ["ldc2", "-O", "-unittest", "-of=main", "main.d"], ["./main"], min_pids=8, compile_mb=2048,
              env=_FEW_ARENAS),
    # Mono (Debian has no .NET SDK), with what SandboxFusion's `dotnet` gives a program:
    # .NET's implicit usings, and a failed Debug.Assert failing the run (the layer's entry)
    "csharp": Lang("main.cs", ["mcs", "-d:DEBUG", "-debug-", "-nowarn:105", "-r:System.Numerics.dll",
                               "-main:DsecEntry", "-out:main.exe", "main.cs", _CS_ENTRY],
                   ["mono", "main.exe"], extra_as_mb=512, min_pids=16, env=_FEW_ARENAS, needs=_CS_ENTRY,
                   preamble="using System; using System.Collections.Generic; using System.IO; using System.Linq; "
                            "using System.Threading; using System.Threading.Tasks;"),
    # scalac on the JVM's quick compiler only: a compile's JVM is short-lived (half the time)
    "scala": Lang("main.scala", ["scalac", "-J-XX:TieredStopAtLevel=1", "-d", ".", "main.scala"],
                  ["scala", "-cp", ".", "{main}"],
                  extra_as_mb=512, min_pids=64, compile_mb=2048, main_re=r"object\s+(\w+)",
                  env=(*_FEW_ARENAS, ("JAVA_OPTS", _JAVA_OPTS + " -Xmx{mem}m"))),
    "verilog": Lang("main.sv", ["iverilog", "-Wall", "-Winfloop", "-Wno-timescale", "-g2012", "-s", "tb", "-o",
                                "main.vvp", "main.sv"], ["vvp", "-n", "main.vvp"]),
    # JUnit 5's console launcher over the classes compiled from the code (class named as its public one)
    "junit": Lang("{main}.java", ["javac", "-J-Xmx512m", "-J-XX:TieredStopAtLevel=1", *("-J" + f for f in _JVM),
                                  "-encoding", "UTF-8", "-cp", f".:{_JUNIT}", "-d", ".", "{main}.java"],
                  ["java", "-Xmx{mem}m", *_JVM, "-jar", _JUNIT, "--disable-banner", "--disable-ansi-colors",
                   "--details=tree", "--class-path", ".", "--scan-class-path"],
                  extra_as_mb=512, min_pids=64, env=_FEW_ARENAS, needs=_JUNIT,
                  main_re=r"public\s+(?:final\s+|abstract\s+)*class\s+(\w+)", main_default="Main"),
    # go test in GOPATH mode: Debian's Go libraries (testify) under /usr/share/gocode
    "go_test": Lang("main_test.go", None, ["go", "test", "main_test.go"], extra_as_mb=768, min_pids=64,
                    env=(("GOMAXPROCS", _CPUS), ("GO111MODULE", "off"), ("GOPATH", "/usr/share/gocode"),
                         ("GOFLAGS", "-count=1"), ("GOCACHE", "{scratch}/.gocache")),
                    seed=(("/usr/local/lib/dsec-go-cache", ".gocache"),), run_file_mb=256,
                    needs="/usr/share/gocode/src/github.com/stretchr/testify"),
    # TypeScript without a type check, as SandboxFusion's tsx runs it, but translated once by
    # esbuild (the native binary tsx uses; tsx's WebAssembly wants 10 GiB of address space)
    # into a CommonJS main.js that the artifact cache keeps
    "typescript": Lang("main.ts", [f"{_NODE}/node_modules/esbuild/bin/esbuild", "main.ts", "--outfile=main.js",
                                   "--format=cjs", "--platform=node", "--target=node18", "--log-level=warning"],
                       ["node", "--max-old-space-size={mem}", f"--v8-pool-size={_CPUS}", "main.js"],
                       extra_as_mb=768, min_pids=16, env=_FEW_ARENAS, links=_NODE_LINKS),
    "jest": Lang("main.test.ts", None, ["node", "--max-old-space-size={mem}",
                                        f"{_NODE}/node_modules/jest/bin/jest.js", "--ci", "--runInBand",
                                        "--watchman=false", "--rootDir", "."],
                 extra_as_mb=1280, min_pids=32, env=(*_FEW_ARENAS, ("FORCE_COLOR", "0")),
                 links=(*_NODE_LINKS, ("package.json", f"{_NODE}/package.json"),
                        ("babel.config.js", f"{_NODE}/babel.config.js")),
                 needs=f"{_NODE}/node_modules/jest"),
    "racket": Lang("main.rkt", None, ["racket", "main.rkt"], min_pids=8, env=_FEW_ARENAS),
    # kotlin_script: the compiler compiles the script and runs it in one JVM, which maps its
    # jars (address space) and needs a compiler's heap whatever the script's own limit
    "kotlin": Lang("main.kts", None, ["kotlinc", "-script", "main.kts"], extra_as_mb=4096, min_pids=64,
                   env=(*_FEW_ARENAS, ("JAVA_OPTS", _JAVA_OPTS + " -Xmx1g -XX:TieredStopAtLevel=1"))),
})
PATH = "/usr/local/bin:/usr/bin:/bin"
ARTIFACT_MAX = 16 << 20
# a compiler's own files (objects, the binary) are not the call's output: bounded apart
COMPILE_FILE_MB = 256
FETCH_MAX = 16 << 20  # fetch_files: bytes read back per call, in all
# how the runtimes other than Python and C++ say they ran out of memory (JVM, Go, V8, Rust)
OOM_MARKERS = ("OutOfMemoryError", "insufficient memory for the Java Runtime", "out of memory",
               "Fatal process OOM", "Array buffer allocation failed", "memory allocation of")
SHARED_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm", "/dev/mqueue")


def available() -> list[str]:
    out = []
    for name, lang in LANGS.items():
        tool = (lang.compile or lang.run or [sys.executable])[0]
        if lang.needs and not os.path.exists(lang.needs):
            continue
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
        self.root = root  # beside this file, <uid>: root-only, holds captured output
        self.scratch = f"/tmp/fncall-{uid}"
        os.makedirs(root, mode=0o700, exist_ok=True)
        self.zygote = Zygote(self)

    # ---- one call ---------------------------------------------------------
    def handle(self, req: dict) -> dict:  # type: ignore[type-arg]
        lang = LANGS[req["language"]]
        code = req["code"]
        if lang.prefix and not code.lstrip().startswith(lang.prefix):
            code = f"{lang.prefix}\n{code}"
        if lang.preamble and "#define" not in code and "#undef" not in code:
            code = f"{lang.preamble}\n{code}"
        main = lang.main_default
        if lang.main_re and (m := re.search(lang.main_re, code)):
            main = m.group(1)
        if lang.main_re and main is None:
            return {"runs": [], "retire": False, "compile": {
                "status": "runtime_error", "exit_code": 1, "signal": None, "stdout": "", "time_ms": 0.0,
                "wall_ms": 0.0, "memory_kb": 0,
                "stderr": f"no main object or class found (looked for /{lang.main_re}/)"}}
        mem = str(req["limits"]["memory_limit_mb"])

        def fill(a: str, mem: str = mem) -> str:
            return a.replace("{main}", main or "").replace("{mem}", mem).replace("{scratch}", self.scratch)

        src = fill(lang.src)
        self._fresh_scratch()
        try:
            inputs = {src}
            for rel, text in req.get("files", {}).items():
                inputs.add(self._write(rel, text.encode()))
            for rel, b64 in req.get("binary_files", {}).items():
                inputs.add(self._write(rel, base64.b64decode(b64)))
            for name, target in lang.links:  # the call's own files of that name win
                if not os.path.lexists(os.path.join(self.scratch, name)):
                    os.symlink(target, os.path.join(self.scratch, name))
                    inputs.add(name)
            for image_dir, name in lang.seed:
                dest = os.path.join(self.scratch, name)
                if os.path.isdir(image_dir) and not os.path.lexists(dest):
                    shutil.copytree(image_dir, dest, symlinks=True)
                    for d, dirs, files in os.walk(dest):
                        for n in [d, *(os.path.join(d, f) for f in dirs + files)]:
                            os.chown(n, self.uid, self.uid, follow_symlinks=False)
                    inputs.add(name)
            self._write(src, code.encode())
            out: dict = {"runs": [], "retire": False}  # type: ignore[type-arg]
            limits = {**req["limits"], "extra_as_mb": lang.extra_as_mb,
                      "env": {k: fill(v) for k, v in lang.env}}
            run_limits = {**limits, "pids_limit": max(limits["pids_limit"], lang.min_pids),
                          "file_limit_mb": lang.run_file_mb}
            if lang.compile and req.get("artifact"):  # an identical compile ran before: reuse its output
                for rel, b64 in json.loads(req["artifact"]).items():
                    self._write(rel, base64.b64decode(b64), mode=0o755)
                out["compile"] = {"status": "ok", "cached": True, "time_ms": 0.0, "wall_ms": 0.0, "memory_kb": 0}
            elif lang.compile:
                comp_mb = max(limits["memory_limit_mb"], lang.compile_mb)
                comp = self.run([fill(a) for a in lang.compile], b"", {
                    **limits, "time_limit_s": req["compile_time_limit_s"], "memory_limit_mb": comp_mb,
                    "env": {k: fill(v, str(comp_mb)) for k, v in lang.env},
                    "pids_limit": max(limits["pids_limit"], 128), "file_limit_mb": COMPILE_FILE_MB})
                out["compile"] = comp
                out["retire"] |= comp.pop("tainted")
                if comp["status"] == "ok":
                    out["artifact"] = self._artifact(inputs)
            run_argv = [fill(a) for a in lang.run] if lang.run else None
            for stdin in req["stdins"] if out.get("compile", {"status": "ok"})["status"] == "ok" else []:
                res = self.run(run_argv, stdin.encode(), run_limits,
                               python_code=code if lang.run is None else None)
                out["retire"] |= res.pop("tainted")
                out["runs"].append(res)
            if req.get("fetch_files"):  # after a failed compile too, as SandboxFusion does
                out["files"], out["files_left_out"] = self._fetch(req["fetch_files"])
            return out
        finally:
            shutil.rmtree(self.scratch, ignore_errors=True)

    def _artifact(self, inputs: set[str]) -> str | None:
        """What the compiler wrote at the top of the scratch dir (a binary, Java's classes),
        for the edge to hand back on an identical call; None past ARTIFACT_MAX."""
        files, total = {}, 0
        for name in sorted(os.listdir(self.scratch)):
            path = os.path.join(self.scratch, name)
            if name in inputs or not os.path.isfile(path) or os.path.islink(path):
                continue
            total += os.path.getsize(path)
            if total > ARTIFACT_MAX:
                return None
            with open(path, "rb") as f:
                files[name] = base64.b64encode(f.read()).decode()
        return json.dumps(files) if files else None

    def _fetch(self, rels: list[str]) -> tuple[dict[str, str], list[str]]:
        """Files the call asked back, base64, up to FETCH_MAX in all (the rest are named in
        the second list); missing ones are left out, as SandboxFusion does. Only regular
        files the call's uid owns, reached without symlinks: the worker reads them as root,
        and nothing of the uid runs any more (the sweep after each run saw to that)."""
        got: dict[str, str] = {}
        left_out: list[str] = []
        total = 0
        for rel in rels:
            path = os.path.normpath(os.path.join(self.scratch, rel))
            if not path.startswith(self.scratch + "/") or os.path.realpath(path) != path:
                continue
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError:
                continue
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_uid != self.uid:
                    continue
                if total + st.st_size > FETCH_MAX:
                    left_out.append(rel)
                    continue
                data = f.read(FETCH_MAX - total + 1)
            total += len(data)
            got[rel] = base64.b64encode(data).decode()
        return got, left_out

    def _fresh_scratch(self) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)
        os.mkdir(self.scratch, 0o700)
        os.chown(self.scratch, self.uid, self.uid)

    def _write(self, rel: str, data: bytes, mode: int = 0o644) -> str:
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
        return os.path.relpath(path, self.scratch)

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
        # "cpu" (a judge's rule): the verdict compares CPU time, the wall clock allows 2 x + 1 s;
        # "wall" (SandboxFusion's rule): the limit is on wall-clock time
        wall_only = limits.get("time_limit_kind") == "wall"
        wall_limit = float(limits["time_limit_s"]) * (1 if wall_only else 2) + (0.0 if wall_only else 1.0)
        t0 = time.monotonic()
        try:
            status, usage, timed_out = self.zygote.run(spec, [in_fd, out_fd, err_fd], wall_limit)
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
        over_cpu = cpu > float(limits["time_limit_s"]) and not wall_only
        if timed_out or over_cpu or res["signal"] == signal.SIGXCPU:
            res["status"] = "time_limit"
        elif stdout[1] or res["signal"] == signal.SIGXFSZ:
            res["status"] = "output_limit"
        elif usage["maxrss"] >= mem_limit_kb * 0.95 or "MemoryError" in stderr[0] or "bad_alloc" in stderr[0] or \
                res["exit_code"] != 0 and any(m in stderr[0] or m in stdout[0][-4096:] for m in OOM_MARKERS):
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
            mem = (int(limits["memory_limit_mb"]) + int(limits.get("extra_as_mb", 0))) << 20
            resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
            resource.setrlimit(resource.RLIMIT_AS, (mem + _vm_size(), mem + _vm_size()))
            resource.setrlimit(resource.RLIMIT_NPROC, (int(limits["pids_limit"]),) * 2)
            fsize = max(cap + 1, int(limits.get("file_limit_mb", 0)) << 20)
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            os.setgroups([])
            os.setgid(self.uid)
            os.setuid(self.uid)
            os.chdir(self.scratch)
            env = {**limits.get("env", {}), "PATH": PATH, "HOME": self.scratch, "LANG": "C.UTF-8",
                   "TMPDIR": self.scratch}
            if python_code is None:
                assert argv is not None
                # Python ignores SIGXFSZ and an ignored signal survives exec: without this a
                # program past the output limit would go on running, its writes failing
                signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
                os.execve(argv[0] if argv[0].startswith(("/", ".")) else shutil.which(argv[0], path=PATH) or argv[0],
                          argv, env)
            os.environ.clear()
            os.environ.update(env)
            sys.stdin = open(0, closefd=False)  # noqa: SIM115
            sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
            sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
            sys.argv = ["main.py"]
            sys.path.insert(0, self.scratch)  # as `python main.py` has it: the call's own files import
            code = 0
            try:
                exec(compile(python_code, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__,
                                                               "__file__": os.path.join(self.scratch, "main.py")})
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
        left |= _remove_ipc(self.uid)
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


def _remove_ipc(uid: int) -> bool:
    """Remove the System V shared memory, semaphores and message queues ``uid`` made or
    owns: they outlive their processes, and a mode of 0666 would hand them to the next call
    (the container has its own IPC namespace, so these are its calls' alone)."""
    libc: ctypes.CDLL | None = None
    found = False
    for kind, ctl in (("shm", "shmctl"), ("sem", "semctl"), ("msg", "msgctl")):
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                head, *rows = f.read().splitlines()
        except OSError:
            continue
        cols = head.split()
        for row in rows:
            v = dict(zip(cols, row.split(), strict=False))
            if str(uid) not in (v.get("uid"), v.get("cuid")):
                continue
            found = True
            if libc is None:
                libc = ctypes.CDLL(None, use_errno=True)
            ident = int(v.get("shmid") or v.get("semid") or v.get("msqid") or -1)
            if kind == "sem":
                getattr(libc, ctl)(ident, 0, 0, None)  # IPC_RMID is 0
            else:
                getattr(libc, ctl)(ident, 0, None)
    return found


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
    w = Worker(uid, os.path.join(os.path.dirname(os.path.abspath(__file__)), str(uid)))
    _send({"ready": True, "languages": available()})
    while (req := _recv()) is not None:
        try:
            _send(w.handle(req))
        except Exception as e:  # the edge gets the reason; the worker stays up
            _send({"error": f"{type(e).__name__}: {e}", "retire": True})


if __name__ == "__main__":
    main()
