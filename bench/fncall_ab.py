"""FnCall python hello, two dsec trees against each other in the same minutes: a server of
each (each on a private data dir with this node's layers), measured in alternating rounds
at concurrency 1 and 8, so that load from anything else on a shared machine falls on both
alike. For "did this change make the hot path slower" on a busy machine.

    .venv/bin/python bench/fncall_ab.py --before OLD_TREE/src [--after NEW_TREE/src] [--rounds 6]

(OLD_TREE: e.g. `git worktree add /tmp/old <commit>` or `git archive <commit> src | tar -x -C DIR`.)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))

from container import free_port, pct, wait_ready  # noqa: E402

import dsec  # noqa: E402
from dsec.faces.embedded import data_dir_default  # noqa: E402
from dsec.node.layers.store import LayerStore  # noqa: E402

PY_HELLO = "print('hello')"


def server(src: str) -> tuple[subprocess.Popen[bytes], str, str, str]:
    data_dir = tempfile.mkdtemp(prefix="dsec-ab-")
    LayerStore(os.path.join(data_dir, "layers")).link_from(os.path.join(data_dir_default(), "layers"))
    token = "ab-" + os.urandom(8).hex()
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "dsec.client.cli.main", "serve", "--port", str(port), "--data-dir",
                             data_dir, "--token", token, "--log-level", "warning"],
                            env={**os.environ, "PYTHONPATH": os.path.abspath(src)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc)
    return proc, url, token, data_dir


async def rounds(urls: dict[str, tuple[str, str]], n_rounds: int, plan: dict[int, int]
                 ) -> dict[tuple[str, int], list[float]]:
    lat: dict[tuple[str, int], list[float]] = {}
    walls: dict[tuple[str, int], float] = {}
    clients = {name: dsec.AsyncClient(url=url, token=tok, timeout=120) for name, (url, tok) in urls.items()}
    try:
        for c in clients.values():  # warm each pool to its working size
            await c.fncall_many([dsec.FnCallArgs(language="python", code=PY_HELLO) for _ in range(32)],
                                concurrency=8)
        loop = asyncio.get_running_loop()
        for r in range(n_rounds):
            for name in (list(clients) if r % 2 == 0 else list(reversed(clients))):
                c = clients[name]
                for conc, n in plan.items():
                    left = iter(range(n))
                    got = lat.setdefault((name, conc), [])

                    async def worker(c: dsec.AsyncClient = c, left: object = left, got: list[float] = got) -> None:
                        for _ in left:  # type: ignore[attr-defined]
                            t = loop.time()
                            out = await c.fncall(dsec.FnCallArgs(language="python", code=PY_HELLO))
                            got.append(loop.time() - t)
                            assert out.stdout == "hello\n", out
                    t0 = loop.time()
                    await asyncio.gather(*(worker() for _ in range(conc)))
                    walls[(name, conc)] = walls.get((name, conc), 0.0) + loop.time() - t0
    finally:
        for c in clients.values():
            await c.close()
    return {k: [pct(v, 50) * 1000, len(v) / walls[k]] for k, v in lat.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="the src dir of the tree to compare against")
    ap.add_argument("--after", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                    "src"))
    ap.add_argument("--rounds", type=int, default=6)
    ns = ap.parse_args()
    plan = {1: 100, 8: 200}
    started = []
    try:
        for src in (ns.before, ns.after):
            started.append(server(src))
        urls = {"before": started[0][1:3], "after": started[1][1:3]}
        res = asyncio.run(rounds(urls, ns.rounds, plan))
    finally:
        for proc, _, _, data_dir in started:
            proc.terminate()
            proc.wait(60)
            shutil.rmtree(data_dir, ignore_errors=True)
    print(f"python hello, {ns.rounds} alternating rounds of {plan} calls (concurrency: calls)")
    print("| concurrency | before p50 ms | after p50 ms | before calls/s | after calls/s | after/before calls/s |")
    print("|---|---|---|---|---|---|")
    for conc in plan:
        b, a = res[("before", conc)], res[("after", conc)]
        print(f"| {conc} | {b[0]:.1f} | {a[0]:.1f} | {b[1]:.0f} | {a[1]:.0f} | {a[1] / b[1]:.2f}x |")


if __name__ == "__main__":
    main()
