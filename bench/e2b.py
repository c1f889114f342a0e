"""The E2B SDK against dsec, beside dsec's own SDK, in one run: create-to-first-command
latency and command round trip (the baseline is dsec's SDK on the same server), the same
on E2B's `base` template (commands as its user), and e2b-code-interpreter's create to
first cell result and cell round trip.

    .venv/bin/python bench/e2b.py --write docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

# this file is named e2b.py, as the issue asks: its own folder must not be where
# ``import e2b`` looks first, or it would import itself instead of the SDK
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]
sys.path.append(HERE)

from container import pct, private_server, report  # noqa: E402

import dsec  # noqa: E402


def with_dsec(url: str, token: str, n: int, cmds: int) -> dict[str, list[float]]:
    create, rtt = [], []
    with dsec.Client(url=url, token=token) as c:
        for _ in range(n):
            t = time.perf_counter()
            sb = c.run_container(dsec.ContainerArgs(image="base/debian:12"))
            sb.run_shell("true")
            create.append(time.perf_counter() - t)
            sb.stop()
        sb = c.run_container(dsec.ContainerArgs(image="base/debian:12"))
        for _ in range(cmds):
            t = time.perf_counter()
            sb.exec(["true"])
            rtt.append(time.perf_counter() - t)
        sb.stop()
    return {"create": create, "rtt": rtt}


def with_e2b(url: str, token: str, n: int, cmds: int, template: str = "base/debian:12") -> dict[str, list[float]]:
    os.environ.update({"E2B_API_URL": url, "E2B_SANDBOX_URL": url, "E2B_API_KEY": token})
    from e2b import Sandbox

    create, rtt = [], []
    for _ in range(n):
        t = time.perf_counter()
        sbx = Sandbox.create(template)
        sbx.commands.run("true")
        create.append(time.perf_counter() - t)
        sbx.kill()
    sbx = Sandbox.create(template)
    for _ in range(cmds):
        t = time.perf_counter()
        sbx.commands.run("true")
        rtt.append(time.perf_counter() - t)
    sbx.kill()
    return {"create": create, "rtt": rtt}


def with_interpreter(n: int, cells: int) -> dict[str, list[float]]:
    """e2b-code-interpreter on code-interpreter-v1: create to the first cell's result
    (the kernel starts with the sandbox) and a cell's round trip (``1 + 1``)."""
    from e2b_code_interpreter import Sandbox as CodeSandbox

    create, rtt = [], []
    for _ in range(n):
        t = time.perf_counter()
        sbx = CodeSandbox.create()
        sbx.run_code("1 + 1")
        create.append(time.perf_counter() - t)
        sbx.kill()
    sbx = CodeSandbox.create()
    for _ in range(cells):
        t = time.perf_counter()
        sbx.run_code("1 + 1")
        rtt.append(time.perf_counter() - t)
    sbx.kill()
    return {"create": create, "rtt": rtt}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=20)
    ap.add_argument("--commands", type=int, default=200)
    ap.add_argument("--data-dir", default=os.environ.get("DSEC_DATA_DIR", "/var/lib/dsec"))
    ap.add_argument("--write", metavar="MARKDOWN")
    a = ap.parse_args()
    proc, url, token, _ = private_server(a.data_dir)
    try:
        ds = with_dsec(url, token, a.n, a.commands)
        e2 = with_e2b(url, token, a.n, a.commands)
        e2u = with_e2b(url, token, a.n, a.commands, "base")
        ci = with_interpreter(max(1, a.n // 4), a.commands // 2)
    finally:
        proc.terminate()
        proc.wait(60)
    ms = 1000.0
    med = statistics.median
    rows = [f"n={a.n} creations, {a.commands} commands, base/debian:12, the same dsec server; "
            f"{os.cpu_count()} cores, kernel {platform.release()}", "",
            "| metric | dsec SDK (baseline) | E2B SDK (unmodified) | E2B / dsec |", "|---|---|---|---|",
            f"| create to first command p50 (ms) | {med(ds['create']) * ms:.1f} | {med(e2['create']) * ms:.1f} | "
            f"{med(e2['create']) / med(ds['create']):.2f}x |",
            f"| create to first command p90 (ms) | {pct(ds['create'], 90) * ms:.1f} | "
            f"{pct(e2['create'], 90) * ms:.1f} | |",
            f"| command round trip p50 (ms) | {med(ds['rtt']) * ms:.2f} | {med(e2['rtt']) * ms:.2f} | "
            f"{med(e2['rtt']) / med(ds['rtt']):.2f}x |",
            f"| command round trip p90 (ms) | {pct(ds['rtt'], 90) * ms:.2f} | {pct(e2['rtt'], 90) * ms:.2f} | |",
            f"| `base` template (as `user`): create to first command p50 (ms) | | {med(e2u['create']) * ms:.1f} | "
            f"{med(e2u['create']) / med(ds['create']):.2f}x |",
            f"| `base` template (as `user`): command round trip p50 (ms) | | {med(e2u['rtt']) * ms:.2f} | "
            f"{med(e2u['rtt']) / med(ds['rtt']):.2f}x |",
            f"| e2b-code-interpreter: create to first cell result p50 (ms, n={len(ci['create'])}) | | "
            f"{med(ci['create']) * ms:.0f} | |",
            f"| e2b-code-interpreter: cell round trip p50 (ms) | | {med(ci['rtt']) * ms:.2f} | |"]
    body = "\n".join(rows)
    if a.write:
        body += "\n\n" + figures(ds, e2, e2u, ci, a.write)
    report(body, a.write, "e2b.py", "e2b", "E2B SDK against dsec (`bench/e2b.py`)")


def figures(ds: dict[str, list[float]], e2: dict[str, list[float]], e2u: dict[str, list[float]],
            ci: dict[str, list[float]], markdown: str) -> str:
    """The latency distributions behind the table, as PNGs beside ``markdown``: their markdown links."""
    import plots

    out = plots.img_dir(markdown)

    def ms(xs: list[float]) -> list[float]:
        return [x * 1000 for x in xs]

    create = plots.latency_cdf({"dsec SDK (baseline)": ms(ds["create"]), "E2B SDK": ms(e2["create"]),
                                "E2B SDK, 'base' template": ms(e2u["create"])},
                               bench="e2b", name="create", xlabel="create to first command (ms)",
                               title="Create to first command, one at a time, same dsec server", out_dir=out)
    rtt = plots.latency_cdf({"dsec SDK (baseline)": ms(ds["rtt"]), "E2B SDK": ms(e2["rtt"]),
                             "E2B SDK, 'base' template": ms(e2u["rtt"]),
                             "e2b-code-interpreter cell (1 + 1)": ms(ci["rtt"])},
                            bench="e2b", name="round-trip", logx=True, xlabel="round trip (ms)",
                            title="Command ('true') and cell round trip in a running sandbox", out_dir=out)
    return "\n\n".join([plots.image_link("create to first command, dsec SDK vs E2B SDK", create),
                        plots.image_link("command round trip, dsec SDK vs E2B SDK", rtt)])


if __name__ == "__main__":
    main()
