"""What every ``dsec`` command shares: the consoles, common options, and turning a
platform error into one red line."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Annotated

import typer
from rich.console import Console

console = Console()
err = Console(stderr=True)

StoreOpt = Annotated[str | None, typer.Option(
    "--store", help="shared layer store: a distributed filesystem path mounted on every node (default $DSEC_STORE, "
    "else the local data dir)")]
UrlOpt = Annotated[str | None, typer.Option("--url", help="apiserver URL, or several replicas comma-separated "
                                             "(default $DSEC_URL or local)")]
TokenOpt = Annotated[str | None, typer.Option("--token", help="API token (default $DSEC_TOKEN or local file)")]


@contextlib.contextmanager
def _errors() -> Iterator[None]:
    """A platform error becomes one red line and exit code 2, not a traceback."""
    from dsec.errors import DsecError

    try:
        yield
    except DsecError as e:
        err.print(f"[red]error[/red] ({e.code}): {e.message}")
        raise typer.Exit(2) from None


