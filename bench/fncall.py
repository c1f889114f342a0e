"""FnCall latency and throughput, with a baseline in the same run.

dsec: ``client.fncall`` through SDK -> API -> edge -> pooled container -> warm worker.
Baseline: a fresh crun container per call on the same FnCall image (overlay over the same
EROFS mount), running ``python3 -c`` (or the compiler, then the program). Optionally
ByteDance SandboxFusion, if ``--sandboxfusion-url`` points at a running server (not
started here; its server is only in its public repository).

    .venv/bin/python bench/fncall.py --write docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable

sys.path.insert(0, os.path.dirname(__file__))

from container import RawCrun, pct, start_server, write_section  # noqa: E402

import dsec  # noqa: E402
from dsec.node.host import linux  # noqa: E402
from dsec.node.host.prep import prepare_cgroups  # noqa: E402
from dsec.node.layers.store import LayerStore  # noqa: E402
from dsec.shared.wire.models import FNCALL_IMAGE  # noqa: E402

IMAGE = FNCALL_IMAGE
PY_HELLO = "print('hello')"
CPP = '#include <cstdio>\nint main(){std::printf("hello\\n");}\n'


async def measure(call: Callable[[], Awaitable[str]], n: int, conc: int) -> dict[str, float]:
    lat: list[float] = []
    left = iter(range(n))

    async def worker() -> None:
        for _ in left:
            t = time.perf_counter()
            out = await call()
            lat.append(time.perf_counter() - t)
            if "hello" not in out:
                raise RuntimeError(f"unexpected output {out[:200]!r}")

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(conc)))
    wall = time.perf_counter() - t0
    return {"p50": pct(lat, 50) * 1000, "p90": pct(lat, 90) * 1000, "rps": n / wall,
            "lat": [x * 1000 for x in lat]}  # type: ignore[dict-item]


async def sandboxfusion(url: str, lang: str, code: str) -> str:
    import aiohttp

    async with aiohttp.ClientSession() as s, s.post(f"{url.rstrip('/')}/run_code",
                                                   json={"code": code, "language": lang}) as r:
        body = await r.json()
    return str((body.get("run_result") or {}).get("stdout", ""))


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default=os.environ.get("DSEC_DATA_DIR", "/var/lib/dsec"))
    ap.add_argument("--sandboxfusion-url")
    ap.add_argument("--write", metavar="MARKDOWN")
    a = ap.parse_args()
    prepare_cgroups()
    data_dir = tempfile.mkdtemp(prefix="dsec-bench-")
    store = LayerStore(os.path.join(data_dir, "layers"))
    store.link_from(os.path.join(a.data_dir, "layers"))
    token = "bench-" + os.urandom(8).hex()
    proc, url = start_server(data_dir, token)
    rows: list[tuple[str, int, str, dict[str, float]]] = []
    # "C++ compile+run" gives every call a distinct source (a numbered comment), so each one
    # compiles; "C++ same source" repeats one source, whose artifact dsec then reuses.
    plan = [("python hello", "python", PY_HELLO, {1: 200, 8: 400, 32: 400}, {1: 20, 8: 40, 32: 40}),
            ("C++ compile+run", "cpp", CPP, {1: 10, 8: 24, 32: 32}, {1: 5, 8: 8, 32: 8}),
            ("C++ same source", "cpp", CPP, {1: 100, 8: 200, 32: 200}, {})]
    serial = iter(range(1 << 30))
    try:
        async with dsec.AsyncClient(url=url, token=token, timeout=600) as c:
            # warm the pool to its working size, as a running service would be
            await c.fncall_many([dsec.FnCallArgs(language="python", code=PY_HELLO) for _ in range(64)],
                                concurrency=32)
            for name, lang, code, counts, _ in plan:
                for conc, n in counts.items():
                    async def call(lang: str = lang, code: str = code, vary: bool = name == "C++ compile+run"
                                   ) -> str:
                        src = code + f"// {next(serial)}\n" if vary else code
                        return (await c.fncall(dsec.FnCallArgs(language=lang, code=src))).stdout
                    rows.append((name, conc, "dsec", await measure(call, n, conc)))
                    print(rows[-1][:3], {k: round(v, 1) for k, v in rows[-1][3].items() if k != "lat"}, flush=True)
    finally:
        proc.terminate()
        proc.wait()
    digest = store.get(IMAGE).digest
    mnt = os.path.join(data_dir, "layers", "mnt", digest)
    os.makedirs(mnt, exist_ok=True)
    source, opts = store.mount_args(digest)
    linux.mount(source, mnt, "erofs", linux.MS_RDONLY, opts)
    raw = RawCrun(mnt)
    argv = {"python": ["python3", "-c", PY_HELLO],
            "cpp": ["sh", "-c", f"cat > a.cc <<'SRC'\n{CPP}SRC\ng++ -O2 a.cc -o a && ./a"]}
    try:
        for name, lang, code, _, counts in plan:
            for conc, n in counts.items():
                async def base(lang: str = lang) -> str:
                    return (await raw.run_once(argv[lang])).decode()
                rows.append((name, conc, "fresh crun container per call", await measure(base, n, conc)))
                print(rows[-1][:3], {k: round(v, 1) for k, v in rows[-1][3].items() if k != "lat"}, flush=True)
                if a.sandboxfusion_url:
                    async def sf(lang: str = lang, code: str = code) -> str:
                        return await sandboxfusion(a.sandboxfusion_url, lang, code)
                    rows.append((name, conc, "SandboxFusion", await measure(sf, n, conc)))
    finally:
        raw.close()
        linux.umount(mnt)
        shutil.rmtree(data_dir, ignore_errors=True)
    body = render(rows)
    if a.write:
        body += "\n\n" + figures(rows, a.write)
    print(body)
    if a.write:
        write_section(a.write, body, "python bench/fncall.py " + " ".join(sys.argv[1:]), name="fncall",
                      title="FnCall (`bench/fncall.py`)")


def figures(rows: list[tuple[str, int, str, dict[str, float]]], markdown: str) -> str:
    """Throughput against concurrency and the latency distribution behind the table, as PNGs
    beside ``markdown``: their markdown links."""
    import plots

    out = plots.img_dir(markdown)
    base = "fresh crun container per call"
    tput: dict[str, dict[int, float]] = {}
    for name, conc, who, m in rows:
        if name == "C++ same source" and who != "dsec":
            continue  # the table leaves these out too: the baseline always compiles
        tput.setdefault(f"{name}: {'fresh crun per call' if who == base else who}", {})[conc] = m["rps"]
    # the baselines first (grey), then dsec, as in every plot
    py = {k: v for k, v in tput.items() if k.startswith("python hello") and "crun" in k}
    py |= {k: v for k, v in tput.items() if k.startswith("python hello") and "crun" not in k}
    cpp = {k: v for k, v in tput.items() if k.startswith("C++") and "crun" in k}
    cpp |= {k: v for k, v in tput.items() if k.startswith("C++") and "crun" not in k}
    links = [plots.image_link("python hello: calls/s against concurrency, dsec vs a fresh crun container per call",
                              plots.throughput_vs_concurrency(py, bench="fncall", name="python-throughput",
                                                              title="FnCall python hello: throughput", out_dir=out)),
             plots.image_link("C++: calls/s against concurrency, dsec vs a fresh crun container per call",
                              plots.throughput_vs_concurrency(cpp, bench="fncall", name="cpp-throughput",
                                                              title="FnCall C++ compile+run: throughput",
                                                              logy=True, out_dir=out))]
    lat = {("fresh crun per call" if who == base else who) + f", concurrency {conc}": m["lat"]
           for name, conc, who, m in rows if name == "python hello" and conc == 1 and who in (base, "dsec")}
    if lat:
        links.append(plots.image_link(
            "python hello latency distribution at concurrency 1",
            plots.latency_cdf(dict(sorted(lat.items(), key=lambda kv: "crun" not in kv[0])),  # type: ignore[arg-type]
                              bench="fncall", name="python-latency", logx=True,
                              title="FnCall python hello: latency per call, one at a time", out_dir=out)))
    return "\n\n".join(links)


def render(rows: list[tuple[str, int, str, dict[str, float]]]) -> str:
    dsec_rps = {(name, conc): m["rps"] for name, conc, who, m in rows if who == "dsec"}
    out = [f"Image {IMAGE}; {os.cpu_count()} cores, kernel {platform.release()}; the pool warmed with 64 calls "
           "first. Latency is per call as the client sees it.", "",
           "| workload | concurrency | runner | p50 ms | p90 ms | calls/s | dsec throughput vs this |",
           "|---|---|---|---|---|---|---|"]
    for name, conc, who, m in rows:
        ratio = "" if who == "dsec" else f"{dsec_rps[(name, conc)] / m['rps']:.1f}x"
        if name == "C++ same source" and who != "dsec":
            continue
        out.append(f"| {name} | {conc} | {who} | {m['p50']:.1f} | {m['p90']:.1f} | {m['rps']:.1f} | {ratio} |")
    out += ["", "C++ compile+run: a distinct source per call, so every call compiles (g++ -O2) and runs. "
            "C++ same source: one source again and again; dsec reuses the compiled artifact (keyed by sha256 of "
            "image, language, code and files), as a judge does on a rejudge. The baseline always compiles.",
            "", "Targets on 2 cores (docs/performance.md): python hello p50 <= 5 ms, >= 400 calls/s at "
            "concurrency 8 and 32, >= 5x the throughput of either baseline. This section's python hello row "
            "is the figure to quote for that call: the other sections measure it beside something else "
            "(tracing on, SandboxFusion alternating with it, before/after pairs) and say so. "
            "SandboxFusion rows appear only when run with --sandboxfusion-url."]
    return "\n".join(out)


if __name__ == "__main__":
    asyncio.run(main())
