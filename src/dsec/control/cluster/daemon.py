"""A service process owned by a Ray actor: started with the actor, healthy before the
actor's constructor returns, and tied to it both ways. Should the process exit on its
own, the actor process exits too, so Ray restarts the actor and with it the service;
should the actor process die, the kernel kills the service (PR_SET_PDEATHSIG, set by
setpriv). One
owner, Ray's restart semantics, no orphan holding a port."""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable

log = logging.getLogger("dsec.cluster")
START_TIMEOUT_S = 120.0  # an edge's first start builds its volume and network: tens of seconds at worst
STOP_GRACE_S = 30.0
START_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 15.0, 30.0)  # between failed starts; the last one repeats


def _tied(argv: list[str]) -> list[str]:
    """``argv`` run through util-linux's setpriv, which sets PR_SET_PDEATHSIG and execs it
    (Popen's preexec_fn would do the same in Python between fork and exec, which can
    deadlock in a process with threads: a Ray worker has dozens), at niceness 0: Ray runs
    its workers at a raised niceness (worker_niceness), which every sandbox an edge
    starts would inherit, and a replica's and an edge's latency with it."""
    return ["nice", "-n", str(-os.nice(0)), "setpriv", "--pdeathsig", "KILL", "--", *argv]


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def dsec_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "dsec.client.cli.main", *args]


def http_ok(url: str, headers: dict[str, str], context: ssl.SSLContext | None = None) -> Callable[[], bool]:
    """A probe of ``url`` (``context``: the client side of an https daemon's mutual TLS)."""
    def check() -> bool:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=2,
                                        context=context) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False
    return check


class Daemon:
    def __init__(self, argv: list[str], log_path: str, healthy: Callable[[], bool],
                 env: dict[str, str] | None = None, user: int | None = None,
                 stop_signal: int = signal.SIGTERM, start_timeout_s: float = START_TIMEOUT_S) -> None:
        self.argv, self.log_path, self._healthy, self.stop_signal = argv, log_path, healthy, stop_signal
        self.start_timeout_s = start_timeout_s
        self.stopping = False
        with open(log_path, "ab") as logf:
            if user is not None:
                os.fchown(logf.fileno(), user, -1)
            # its own session: a signal to the actor's process group is not one to it
            self.proc = subprocess.Popen(_tied(argv), stdin=subprocess.DEVNULL, stdout=logf,
                                         stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                         start_new_session=True, user=user,
                                         group=None if user is None else pwd.getpwuid(user).pw_gid)
        self._wait_healthy()
        threading.Thread(target=self._watch, name="daemon-watch", daemon=True).start()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: {self.log_tail()}")
            if self._healthy():
                return
            time.sleep(0.1)
        self.proc.kill()
        raise RuntimeError(f"{self.name} did not become healthy in {self.start_timeout_s:g} s: {self.log_tail()}")

    @property
    def name(self) -> str:
        return " ".join(os.path.basename(a) for a in self.argv[:5])

    def log_tail(self, n: int = 2000) -> str:
        with contextlib.suppress(OSError), open(self.log_path, "rb") as f:
            f.seek(max(0, os.path.getsize(self.log_path) - n))
            return f.read().decode(errors="replace")
        return ""

    def _watch(self) -> None:
        rc = self.proc.wait()
        if not self.stopping:
            log.error("%s exited with %s; the actor exits so that Ray restarts it", self.name, rc)
            os._exit(1)

    def stop(self) -> int | None:
        """Its stop signal (SIGTERM: a graceful stop, an edge's sandboxes run on), SIGKILL
        past the grace."""
        self.stopping = True
        if self.proc.poll() is None:
            self.proc.send_signal(self.stop_signal)
            try:
                self.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_retrying(make: Callable[[], Daemon], report: Callable[[str | None, int], None]) -> Daemon:
    """``make()`` until it gives a healthy daemon. A failed start (the process exited, or
    never answered) is reported with its error and the number of tries so far, and tried
    again after a backoff growing to 30 s; ``report(None, tries)`` once it serves. Why here
    and not left to Ray: an actor whose constructor raised is dead for good (Ray restarts
    actors that die, not ones that fail to be made), so one failed start lost an edge."""
    tries = 0
    while True:
        tries += 1
        try:
            daemon = make()
        except (RuntimeError, OSError) as e:
            with contextlib.suppress(Exception):  # the database may be what is down: keep trying anyway
                report(str(e)[-2000:], tries)
            pause = START_BACKOFF_S[min(tries, len(START_BACKOFF_S)) - 1]
            log.warning("start %d failed (again in %g s): %s", tries, pause, e)
            time.sleep(pause)
            continue
        with contextlib.suppress(Exception):
            report(None, tries)
        return daemon
