"""What every ``dsec`` command shares: the consoles, common options, and turning a
platform error into one red line."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Annotated

import typer
from rich.console import Console

console = Console()
err = Console(stderr=True)
# leave the alternate screen and show the cursor: harmless on a terminal that was in neither
RESTORE_TERMINAL = b"\x1b[?1049l\x1b[?25h"

StoreOpt = Annotated[str | None, typer.Option(
    "--store", help="shared layer store: a distributed filesystem path mounted on every node (default $DSEC_STORE, "
    "else the local data dir)")]
UrlOpt = Annotated[str | None, typer.Option("--url", help="apiserver URL, or several replicas comma-separated "
                                             "(default $DSEC_URL or local)")]
TokenOpt = Annotated[str | None, typer.Option("--token", help="API token (default $DSEC_TOKEN or local file)")]


@contextlib.contextmanager
def _errors() -> Iterator[None]:
    """A platform error, or a value the request's model refuses here before sending it,
    becomes one red line and exit code 2, not a traceback."""
    from pydantic import ValidationError

    from dsec.shared.errors import DsecError

    try:
        yield
    except DsecError as e:
        err.print(f"[red]error[/red] ({e.code}): {e.message}")
        raise typer.Exit(2) from None
    except ValidationError as e:
        errors = e.errors()
        where = ".".join(str(p) for p in errors[0]["loc"]) if errors else e.title
        err.print(f"[red]error[/red] (invalid_request): {where or e.title}: {errors[0]['msg'] if errors else e}")
        raise typer.Exit(2) from None




def interruptible(grace_s: float = 1.0, exit_code: int = 130) -> None:
    """Ctrl-C ends this command, within ``grace_s`` whatever it is waiting for.

    SIGINT is taken even when this process inherited it ignored: a shell runs a script's
    background jobs (``cmd &``, CI runners, test suites started that way) with SIGINT
    ignored, every process below keeps it ignored, and Python then installs no handler of
    its own, so asyncio.run installs none either and Ctrl-C did nothing. The first SIGINT
    raises KeyboardInterrupt where the command is (its own cleanup runs); if the process is
    still there ``grace_s`` later (a cleanup stuck on a hung apiserver), the terminal is
    restored and it exits with ``exit_code``."""
    def on_sigint(signum: int, frame: FrameType | None) -> None:
        if not getattr(on_sigint, "armed", False):
            on_sigint.armed = True  # type: ignore[attr-defined]
            timer = threading.Timer(grace_s, _hard_exit, (exit_code,))
            timer.daemon = True
            timer.start()
        raise KeyboardInterrupt
    signal.signal(signal.SIGINT, on_sigint)


def _hard_exit(code: int) -> None:
    with contextlib.suppress(OSError):
        if os.isatty(1):
            os.write(1, RESTORE_TERMINAL)
    sys.stdout.flush()
    os._exit(code)
