"""``dsec top`` (docs/console.md) against the session's platform: one frame names the edge,
the job and the busy sandbox first (CPU % between two polls), a bad token or an apiserver
that is not there is one clear line and a nonzero exit, and the live view in a terminal
redraws and quits on Ctrl-C without a traceback. Also the CPU-rate arithmetic, and the
SDK's console face (``client.console``) it reads through."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import pty
import secrets
import select
import signal
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import AsyncIterator, Callable

from conftest import TOKEN, Platform

import dsec
from dsec.client.cli.top import CpuRates, cpu_pct
from dsec.shared.wire.models import SandboxInfo, SandboxUsage

BUSY = "timeout 30 sh -c 'while :; do :; done'; true"


def _env(platform: Platform, **extra: str) -> dict[str, str]:
    return {**os.environ, "DSEC_URL": platform.url, "DSEC_TOKEN": TOKEN, "COLUMNS": "120", **extra}


async def _cli(*args: str, env: dict[str, str], timeout: float = 30) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "dsec.client.cli.main", "top", *args, env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


@contextlib.asynccontextmanager
async def _busy_and_idle(client: dsec.AsyncClient) -> AsyncIterator[tuple[str, dsec.AsyncSandbox, dsec.AsyncSandbox]]:
    """A job of two busybox sandboxes made by one batch: one spinning a core (for 30 s at
    most), one idle. Stopping the job stops them."""
    job = await client.create_job(f"top-{secrets.token_hex(3)}")
    spin: asyncio.Task[object] | None = None
    try:
        batch = await client.create_many(dsec.ContainerArgs(image="base/busybox", memory_limit_mb=64,
                                                            cpu_cores_limit=1), 2, job=job.name)
        (busy, idle), failed = await batch.result(timeout=60)
        assert not failed, failed
        spin = asyncio.create_task(busy.exec(BUSY, timeout=40))
        await asyncio.sleep(0.5)  # the loop is on its way before the first poll
        yield job.name, busy, idle
    finally:
        if spin is not None:
            spin.cancel()
        await job.stop()
        if spin is not None:
            with contextlib.suppress(asyncio.CancelledError, dsec.DsecError):
                await spin


def test_cpu_pct() -> None:
    assert cpu_pct(10.0, 11.0, 2.0) == 50.0
    assert cpu_pct(10.0, 14.0, 2.0) == 200.0  # two cores
    assert cpu_pct(10.0, 9.0, 2.0) is None  # the counter went back: restored elsewhere
    assert cpu_pct(1.0, 2.0, 0.0) is None
    info = {"edge": "e", "backend": "container", "state": "running", "image": "i", "layers": [], "created_at": 0,
            "last_active_at": 0, "memory_limit_mb": 64, "cpu_cores_limit": 1}

    def at(cpu_s: float) -> SandboxInfo:
        return SandboxInfo.model_validate({**info, "sandbox_id": "a", "usage": SandboxUsage(cpu_s=cpu_s)})

    rates = CpuRates()
    assert rates.update([at(5.0)], 100.0) == {}  # one read: no rate yet
    assert rates.update([at(6.5)], 102.0) == {"a": 75.0}


async def test_one_frame_busy_first(platform: Platform, client: dsec.AsyncClient) -> None:
    async with _busy_and_idle(client) as (job, busy, idle):
        page = await client.console.sandboxes(job=job, sort="-cpu", limit=5)  # the SDK's face of what top reads
        assert [i.sandbox_id for i in page.items][0] == busy.sandbox_id and page.states == {"running": 2}
        edge = busy.sandbox_id.split("-")[0]
        assert edge in [n.edge for n in (await client.console.fleet()).nodes]
        assert job in [b.job for b in await client.console.batches(limit=5)]

        code, out, err = await _cli("--once", "--limit", "5", "--interval", "1", "--job", job, env=_env(platform))
        print(out)
        assert code == 0, err
        lines = out.splitlines()
        assert all(len(line) <= 120 for line in lines)
        assert "edges 1/1 up" in out and "sandboxes 2: 2 running" in out
        assert any(line.startswith(f"{edge} ") and " up " in line for line in lines), out  # the Edges row
        assert any(line.startswith(job) and "active" in line and "2 running" in line and "2/2 done" in line
                   for line in lines), out  # the Jobs row, with its batch
        rows = [line for line in lines if line.startswith(f"{edge}-")]
        assert [r.split()[0] for r in rows] == [busy.sandbox_id, idle.sandbox_id], out
        busy_pct, idle_pct = (int(r.split()[1].rstrip("%")) for r in rows)
        assert busy_pct >= 40 and idle_pct <= 10, out  # CPU %: one core spinning (its limit is one core)

        code, out, err = await _cli("--once", "--sort", "memory", "--interval", "0.2", env=_env(platform))
        assert code == 0 and "busiest by memory" in out and busy.sandbox_id in out, err


async def test_errors_are_one_line(platform: Platform) -> None:
    code, out, err = await _cli("--once", env=_env(platform, DSEC_TOKEN="not-a-token"))
    assert code == 2 and "unauthorized" in err and "Traceback" not in err + out, err
    code, out, err = await _cli("--once", "--url", "http://127.0.0.1:9", env=_env(platform))
    assert code == 2 and "edge_unavailable" in err and "cannot reach dsec" in err and "Traceback" not in err, err


class Proxy:
    """A TCP relay to the platform that can be made to hang: every byte stops flowing both
    ways and new connections are taken but never answered (an apiserver stuck under load)."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.hung = threading.Event()
        self.srv = socket.socket()
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen(64)
        self.url = f"http://127.0.0.1:{self.srv.getsockname()[1]}"
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            self.held.append(c)
            if not self.hung.is_set():
                up = socket.create_connection(("127.0.0.1", self.target))
                self.held.append(up)
                threading.Thread(target=self._pump, args=(c, up), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while not self.hung.is_set():
                ready = select.select([a, b], [], [], 0.1)[0]
                for s in ready:
                    data = s.recv(65536)
                    if not data:
                        return
                    (b if s is a else a).sendall(data)

    def close(self) -> None:
        self.srv.close()
        for s in self.held:
            s.close()


def _top_in_a_terminal(env: dict[str, str], frames: int, before_sigint: Callable[[], None] = lambda: None
                       ) -> tuple[int, bytes, float]:
    """``dsec top`` on a 120x40 pseudo-terminal until it drew ``frames`` frames, then
    ``before_sigint``, then Ctrl-C (SIGINT): its exit code, everything it wrote, and the
    seconds from SIGINT to its exit. It starts with SIGINT ignored, as every process under
    a script's background job has it (how CI and test runners start it): dsec top must
    take Ctrl-C all the same."""
    fd, tty = pty.openpty()
    fcntl.ioctl(tty, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "dsec.client.cli.main", "top", "--interval", "0.5"], env=env,
                            stdin=tty, stdout=tty, stderr=tty, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    os.close(tty)
    seen = b""

    def read() -> None:
        nonlocal seen
        if select.select([fd], [], [], 0.05)[0]:
            with contextlib.suppress(OSError):  # EIO once the child is gone
                seen += os.read(fd, 65536)

    try:
        deadline = time.monotonic() + 20
        while seen.count(b"Busiest sandboxes") < frames and time.monotonic() < deadline and proc.poll() is None:
            read()
        assert seen.count(b"Busiest sandboxes") >= frames, seen[-2000:]
        before_sigint()
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        deadline = t0 + 10
        while proc.poll() is None and time.monotonic() < deadline:
            read()
        took = time.monotonic() - t0
        read()
        assert proc.returncode is not None, f"dsec top did not quit on SIGINT: {seen[-2000:]!r}"
        return proc.returncode, seen, took
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(fd)


async def test_live_in_a_terminal_quits_on_ctrl_c(platform: Platform, client: dsec.AsyncClient) -> None:
    env = _env(platform, TERM="xterm-256color")
    env.pop("COLUMNS")  # the terminal's size
    async with _busy_and_idle(client) as (_, busy, _):
        code, seen, took = await asyncio.to_thread(_top_in_a_terminal, env, 3)
    assert code == 0 and took < 1.5, (took, seen[-2000:])
    assert b"Traceback" not in seen and b"KeyboardInterrupt" not in seen, seen[-2000:]
    assert b"\x1b[?1049h" in seen and b"\x1b[?1049l" in seen  # the alternate screen, given back at the end
    # the first frame with CPU time, the next ones with CPU %; the busy one's id on them
    assert busy.sandbox_id.encode() in seen and b"CPU TIME" in seen and b"CPU %" in seen


async def test_ctrl_c_quits_within_a_second_whatever_the_apiserver_does(platform: Platform,
                                                                        client: dsec.AsyncClient) -> None:
    """The apiserver hangs (every connection stalls, new ones are never answered) with a poll
    in flight, or is gone: Ctrl-C still ends dsec top within a second, the terminal given back."""
    for what in ("hung", "gone"):
        proxy = Proxy(platform.port)
        env = _env(platform, TERM="xterm-256color", DSEC_URL=proxy.url)
        env.pop("COLUMNS")
        try:
            def fail(p: Proxy = proxy, w: str = what) -> None:
                if w == "hung":
                    p.hung.set()
                else:
                    p.close()
                time.sleep(0.8)  # the next poll is under way and stuck
            async with _busy_and_idle(client):
                code, seen, took = await asyncio.to_thread(_top_in_a_terminal, env, 2, fail)
        finally:
            proxy.close()
        assert code == 0 and took < 1.5, (what, took, seen[-2000:])
        assert b"Traceback" not in seen, (what, seen[-2000:])
        assert seen.rfind(b"\x1b[?1049l") > seen.rfind(b"\x1b[?1049h") >= 0, (what, seen[-500:])  # screen given back


def _ctrl_c(argv: list[str], env: dict[str, str], ready: Callable[[subprocess.Popen[bytes]], None]
            ) -> tuple[int | None, float, bytes]:
    """``dsec ARGV`` started with SIGINT ignored (as a script's background job is), Ctrl-C
    once ``ready`` returns: its exit code (None: still running 10 s later), how long it
    took to go, what it wrote to stderr."""
    proc = subprocess.Popen([sys.executable, "-m", "dsec.client.cli.main", *argv], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        ready(proc)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        took = time.monotonic() - t0
        assert proc.stderr is not None
        return proc.poll(), took, proc.stderr.read() if proc.poll() is not None else b""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_dsec_exec_of_a_long_command_quits_on_ctrl_c(platform: Platform, busybox: dsec.AsyncSandbox) -> None:
    """The other CLI command that streams: `dsec exec` of a long command, started with SIGINT
    ignored like dsec top above, quits on Ctrl-C at once with 130 and no traceback."""
    def started(proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None and proc.stdout.readline() == b"started\n"
    code, took, err = await asyncio.to_thread(
        _ctrl_c, ["exec", busybox.sandbox_id, "--", "sh", "-c", "echo started; sleep 100"], _env(platform), started)
    assert code == 130 and took < 1.5, (code, took, err[-2000:])
    assert b"Traceback" not in err, err[-2000:]


async def test_every_waiting_cli_command_quits_on_ctrl_c_against_a_hung_apiserver(
        platform: Platform, tmp_path: os.PathLike[str]) -> None:
    """The CLI commands that wait on the apiserver for long (a batch, a move, a drain, a
    restore, an FnCall), started with SIGINT ignored as a script's background job is, end
    within a second of Ctrl-C while the apiserver hangs: exit 130, no traceback."""
    src = os.path.join(tmp_path, "hello.py")
    with open(src, "w") as f:
        f.write("print('hi')\n")
    commands = [["create", "--image", "base/busybox", "--count", "2", "--all-or-nothing"],
                ["move", "n1-000000000000"], ["restore", "n1-000000000000"], ["node", "drain", "n1"],
                ["fncall", "run", "python", src]]
    proxy = Proxy(platform.port)
    proxy.hung.set()  # connections taken, never answered

    def stuck(proc: subprocess.Popen[bytes]) -> None:
        time.sleep(6)  # imported, its request sent and stuck
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else b""

    def run(argv: list[str]) -> tuple[list[str], int | None, float, bytes]:
        return (argv, *_ctrl_c(argv, _env(platform, DSEC_URL=proxy.url), stuck))
    try:
        results = await asyncio.gather(*(asyncio.to_thread(run, argv) for argv in commands))
    finally:
        proxy.close()
    for argv, code, took, err in results:
        assert code == 130 and took < 1.5, (argv, code, took, err[-2000:])
        assert b"Traceback" not in err, (argv, err[-2000:])
