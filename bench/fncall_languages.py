"""FnCall per language on its toolchain layer: the first call of the language on a node
(its pool's container started on the base + toolchain layer stack, the runtime's first
run), then warm calls (p50, p90; a compiled language's artifact comes from the edge's cache
after the first call, as on a rejudge; a different stdin each call).

    .venv/bin/python bench/fncall_languages.py [--calls 20] [--write docs/benchmarks.md]

A private server on this node's layers (hard-linked), so a running platform is untouched.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from container import pct, private_server, write_section  # noqa: E402

import dsec  # noqa: E402
from dsec.faces.embedded import data_dir_default  # noqa: E402
from dsec.node.layers.store import LayerStore  # noqa: E402
from dsec.node.layers.toolchains import toolchain_layer  # noqa: E402
from dsec.shared.wire.models import FnCallArgs  # noqa: E402

# language -> a program printing "hello <stdin>"
HELLO = {
    "python": 'print("hello", input())',
    "ruby": 'puts "hello #{gets}"',
    "php": '<?php echo "hello " . readline() . "\\n";',
    "perl": 'my $x = <STDIN>; print "hello $x";',
    "lua": 'print("hello " .. io.read("*l"))',
    "r": 'cat("hello", readLines(file("stdin"), n = 1), "\\n")',
    "d": 'import std.stdio, std.string;\nvoid main() { writeln("hello ", readln().strip()); }',
    "csharp": 'using System;\nclass P { static void Main() { Console.WriteLine("hello " + Console.ReadLine()); } }',
    "scala": 'object Main { def main(a: Array[String]): Unit = println("hello " + scala.io.StdIn.readLine()) }',
    "typescript": 'const s: string = require("fs").readFileSync(0, "utf8").trim();\nconsole.log(`hello ${s}`);',
    "verilog": 'module tb; initial begin $display("hello"); $finish; end endmodule',
    "racket": '#lang racket\n(displayln (string-append "hello " (read-line)))',
    "kotlin": 'println("hello " + readLine())',
    "pytest": "def test_hello():\n    print('hello')\n    assert 1 + 1 == 2\n",
    "junit": ("import org.junit.jupiter.api.Test;\nimport static org.junit.jupiter.api.Assertions.*;\n"
              "public class Hello { @Test void t() { System.out.println(\"hello\"); assertEquals(2, 1 + 1); } }\n"),
    "go_test": ('package main\nimport (\n\t"fmt"\n\t"testing"\n\t"github.com/stretchr/testify/assert"\n)\n'
                'func TestHello(t *testing.T) { fmt.Println("hello"); assert.Equal(t, 2, 1+1) }\n'),
    "jest": ("import { expect, test } from '@jest/globals';\n"
             "test('hello', () => { console.log('hello'); expect(1 + 1).toBe(2); });\n"),
}
RUNNERS = {"pytest", "junit", "go_test", "jest"}  # their output is the runner's report (pytest's -q hides print)


async def one(c: dsec.AsyncClient, lang: str, i: int) -> float:
    t = time.perf_counter()
    r = await c.fncall(FnCallArgs(language=lang, code=HELLO[lang], stdin=f"w{i}\n", time_limit_s=30,
                                  compile_time_limit_s=60, memory_limit_mb=512))
    dt = time.perf_counter() - t
    if r.status != "ok" or ("hello" not in r.stdout + r.stderr and lang not in RUNNERS):
        raise RuntimeError(f"{lang}: {r.status} {r.stdout[-300:]!r} {r.stderr[-600:]!r}")
    return dt


async def run(url: str, token: str, calls: int, langs: list[str]) -> list[tuple[str, float, float, float]]:
    rows = []
    async with dsec.AsyncClient(url=url, token=token) as c:
        for lang in langs:
            first = await one(c, lang, 0)
            lat = [await one(c, lang, i) for i in range(1, calls + 1)]
            rows.append((lang, first * 1000, pct(lat, 50) * 1000, pct(lat, 90) * 1000))
            print(f"{lang:<11} first {first * 1000:8.0f} ms  warm p50 {rows[-1][2]:7.1f} ms  p90 {rows[-1][3]:7.1f} ms",
                  flush=True)
    return rows


def render(rows: list[tuple[str, float, float, float]], calls: int) -> str:
    out = [f"{os.cpu_count()} cores, kernel {platform.release()}, a private server (fresh pools). First call: "
           "the language's first on the node (its pool's container started on the base + toolchain layer, the "
           "runtime's first run, a compile where there is one). Warm: the next "
           f"{calls} calls, one at a time, each with another stdin (compiled languages reuse the cached "
           "artifact).", "",
           "| language | layer | first call ms | warm p50 ms | warm p90 ms |", "|---|---|---|---|---|"]
    for lang, first, p50, p90 in rows:
        out.append(f"| {lang} | {toolchain_layer(lang) or '(base)'} | {first:.0f} | {p50:.1f} | {p90:.1f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--languages", default=",".join(HELLO))
    ap.add_argument("--write", metavar="MARKDOWN")
    ns = ap.parse_args()
    node = LayerStore(os.path.join(data_dir_default(), "layers"))
    langs = [lang for lang in ns.languages.split(",")
             if (ref := toolchain_layer(lang)) is None or node.has(ref)]  # on-demand layers: where built
    proc, url, token, data_dir = private_server(data_dir_default())
    try:
        rows = asyncio.run(run(url, token, ns.calls, langs))
    finally:
        proc.terminate()
        proc.wait(60)
        shutil.rmtree(data_dir, ignore_errors=True)
    text = render(rows, ns.calls)
    print(text)
    if ns.write:
        write_section(ns.write, text, f"python bench/fncall_languages.py --calls {ns.calls} --write {ns.write}",
                      "fncall-languages", "FnCall per language (`bench/fncall_languages.py`)")


if __name__ == "__main__":
    main()
