"""FnCall's toolchain-layer languages and test-runner modes against the real platform: each
through FnCall (its own pool, stacked on the language's tk/fncall-* layer) and through the
SandboxFusion face's /run_code with SandboxFusion's request and response semantics; layer
selection per call (scientific Python), pools keyed by the stack, isolation of a new language."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

import dsec
from dsec.node.layers.store import LayerStore
from dsec.node.layers.toolchains import TOOLCHAINS, toolchain_layer
from dsec.shared.wire.models import FnCallArgs, TestCase
from tests.conftest import SRC_DATA, TOKEN, Platform

# language -> (code printing "hello <first stdin token>", a program that fails: an assertion or exit 1)
PROGRAMS: dict[str, tuple[str, str]] = {
    "ruby": ('puts "hello #{STDIN.read.split[0]}"',
             'require "test/unit"\nclass T < Test::Unit::TestCase\n  def test_x\n    assert_equal(1, 0)\n  end\nend\n'),
    "php": ('<?php echo "hello " . trim(readline()) . "\\n";', 'trigger_error("boom", E_USER_ERROR);'),
    "perl": ('my $x = <STDIN>; chomp $x; print "hello $x\\n";',
             'use Test::Deep;\nexit(eq_deeply([1, 2], [1, 3]) ? 0 : 1);'),
    "lua": ('print("hello " .. io.read("*l"))', 'lu = require("luaunit")\nlu.assertEquals(1, 2)'),
    "r": ('x <- readLines(file("stdin"), n = 1)\ncat("hello", x, "\\n", sep = " ")',
          'stopifnot(isTRUE(all.equal(1, 0)))'),
    "d": ('import std.stdio, std.string;\nvoid main() { writeln("hello ", readln().strip()); }',
          'unittest { assert(0 == 1); }\nvoid main() {}'),
    "csharp": ('using System;\nclass P { static void Main() { Console.WriteLine("hello " + Console.ReadLine()); } }',
               'using System.Diagnostics;\nclass P { static void Main() { System.Environment.Exit(1); } }'),
    "scala": ('object Main { def main(a: Array[String]): Unit = println("hello " + scala.io.StdIn.readLine()) }',
              'object Main { def main(a: Array[String]): Unit = assert(1 == 2) }'),
    "verilog": ('module tb; initial begin $display("hello verilog"); $finish; end endmodule',
                'module tb; initial begin $fatal(1, "boom"); end endmodule'),
    "typescript": ('const s: string = require("fs").readFileSync(0, "utf8").trim();\nconsole.log(`hello ${s}`);',
                   'const x: number = 1;\nif (x !== 2) { throw new Error("boom"); }'),
}
PASSING_TESTS: dict[str, str] = {  # the test-runner modes: a suite that passes, then one that fails
    "pytest": "def add(a, b):\n    return a + b\n\ndef test_add():\n    assert add(1, 2) == 3\n",
    "junit": ("import org.junit.jupiter.api.Test;\nimport static org.junit.jupiter.api.Assertions.*;\n"
              "public class Adder { static int add(int a, int b) { return a + b; } }\n"
              "class AdderTest { @Test void adds() { assertEquals(3, Adder.add(1, 2)); } }\n"),
    "go_test": ('package main\nimport (\n\t"testing"\n\t"github.com/stretchr/testify/assert"\n)\n'
                'func Add(a, b int) int { return a + b }\n'
                'func TestAdd(t *testing.T) { assert.Equal(t, 3, Add(1, 2)) }\n'),
    "jest": ("import { describe, expect, test } from '@jest/globals';\n"
             "function add(a: number, b: number): number { return a + b; }\n"
             "describe('add', () => { test('adds', () => { expect(add(1, 2)).toBe(3); }); });\n"),
}
SF_NAMES = {"r": "R", "d": "D_ut", "kotlin": "kotlin_script"}  # SandboxFusion's names where they differ


def failing(code: str) -> str:
    """A runner's suite made to fail: the expected sum is wrong."""
    return code.replace("3", "4", 1) if "== 3" in code else code.replace("(3", "(4", 1).replace("3,", "4,", 1)


@pytest.mark.parametrize("language", list(PROGRAMS))
async def test_language_runs_on_its_toolchain_layer(client: dsec.AsyncClient, language: str) -> None:
    hello, bad = PROGRAMS[language]
    r = await client.fncall(FnCallArgs(language=language, code=hello, time_limit_s=10, compile_time_limit_s=60,
                                       memory_limit_mb=512, tests=[TestCase(stdin="world\n"), TestCase(stdin="x\n")]))
    assert r.status == "ok", r
    want = "hello verilog" if language == "verilog" else "hello world"
    assert r.tests[0].stdout.split() == want.split() and r.tests[0].exit_code == 0, r
    assert language == "verilog" or r.tests[1].stdout.split() == ["hello", "x"], r
    fail = await client.fncall(FnCallArgs(language=language, code=bad, time_limit_s=10, compile_time_limit_s=60,
                                          memory_limit_mb=512))
    assert fail.status == "runtime_error" and fail.exit_code != 0, fail


@pytest.mark.parametrize("language", list(PASSING_TESTS))
async def test_runner_modes_pass_and_fail(client: dsec.AsyncClient, language: str) -> None:
    code = PASSING_TESTS[language]
    ok = await client.fncall(FnCallArgs(language=language, code=code, time_limit_s=30, compile_time_limit_s=60,
                                        memory_limit_mb=512))
    assert ok.status == "ok" and ok.exit_code == 0, ok
    bad = await client.fncall(FnCallArgs(language=language, code=failing(code), time_limit_s=30,
                                         compile_time_limit_s=60, memory_limit_mb=512))
    assert failing(code) != code and bad.status == "runtime_error" and bad.exit_code != 0, bad
    assert any(w in bad.stdout + bad.stderr for w in ("4", "FAIL", "failed", "expected")), bad


def sf(platform: Platform, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{platform.url}/sandboxfusion/{TOKEN}/run_code", json=body, timeout=180)
    assert r.status_code == 200, r.text
    return dict(r.json())


@pytest.mark.parametrize("language", [*PROGRAMS, *PASSING_TESTS])
def test_sandboxfusion_run_code_each_language(platform: Platform, language: str) -> None:
    name = SF_NAMES.get(language, language)
    if language in PASSING_TESTS:
        good, bad, stdin = PASSING_TESTS[language], failing(PASSING_TESTS[language]), None
    else:
        (good, bad), stdin = PROGRAMS[language], "world\n"
    ok = sf(platform, {"language": name, "code": good, "stdin": stdin, "run_timeout": 30, "compile_timeout": 60})
    assert ok["status"] == "Success" and ok["run_result"]["status"] == "Finished", ok
    assert ok["run_result"]["return_code"] == 0
    if language in PROGRAMS:
        assert "hello" in ok["run_result"]["stdout"], ok
    failed = sf(platform, {"language": name, "code": bad, "run_timeout": 30, "compile_timeout": 60})
    assert failed["status"] == "Failed" and failed["run_result"]["status"] == "Finished", failed
    assert failed["run_result"]["return_code"] != 0


def test_sandboxfusion_semantics_per_language(platform: Platform) -> None:
    php = sf(platform, {"language": "php", "code": "echo 6 * 7;"})  # SandboxFusion puts <?php in front
    assert php["status"] == "Success" and php["run_result"]["stdout"] == "42", php
    slow = sf(platform, {"language": "ruby", "code": "sleep 5", "run_timeout": 1})
    assert slow["status"] == "Failed" and slow["run_result"]["status"] == "TimeLimitExceeded", slow
    assert slow["run_result"]["execution_time"] < 3
    cs = sf(platform, {"language": "csharp", "stdin": "41", "code": (  # no `using System;`: .NET's implicit usings
        "public class P { public static void Main(string[] a) { Console.WriteLine(int.Parse(Console.ReadLine()) + 1); "
        "var l = new List<int> { 1 }; System.Diagnostics.Debug.Assert(l.Count == 2, \"count is off\"); } }")})
    assert cs["status"] == "Failed" and cs["run_result"]["stdout"] == "42\n", cs  # Debug.Assert fails the run
    assert cs["run_result"]["return_code"] == 1 and "count is off" in cs["run_result"]["stderr"]
    py = sf(platform, {"language": "python", "code": (  # SandboxFusion's Python has its data-science set
        "import numpy, pandas, requests, socket\nprint(numpy.arange(3).sum(), socket.gethostbyname('localhost'))")})
    assert py["status"] == "Success" and py["run_result"]["stdout"] == "3 127.0.0.1\n", py
    js = sf(platform, {"language": "nodejs", "code": "console.log(require('lodash').chunk([1, 2, 3], 2).length)"})
    assert js["status"] == "Success" and js["run_result"]["stdout"] == "2\n", js
    noobj = sf(platform, {"language": "scala", "code": "class A"})
    assert noobj["status"] == "Failed" and noobj["run_result"] is None, noobj
    assert noobj["compile_result"]["return_code"] == 1 and "object" in noobj["compile_result"]["stderr"]


async def test_pools_keyed_by_layer_stack_and_a_library_layer_per_call(client: dsec.AsyncClient) -> None:
    probe = "import shutil, importlib.util as u; print(shutil.which('ruby'), u.find_spec('numpy') is not None)"
    plain = await client.fncall(FnCallArgs(language="python", code=probe))
    assert plain.stdout == "None False\n", plain  # the Python pool carries no other toolchain nor library
    scipy = TOOLCHAINS["scipy"].ref("scipy")
    sci = await client.fncall(FnCallArgs(language="python", layers=[scipy], code=(
        "import numpy as np, pandas as pd, scipy.linalg, sympy, networkx as nx\n"
        "print(int(np.arange(4).sum()), len(pd.DataFrame({'a': [1, 2]})), sympy.factorint(12), "
        "nx.path_graph(3).number_of_edges())"), memory_limit_mb=1024, time_limit_s=20))
    assert sci.status == "ok" and sci.stdout == "6 2 {2: 2, 3: 1} 2\n", sci
    ruby = await client.fncall(FnCallArgs(language="ruby", code="puts RUBY_VERSION"))
    assert ruby.status == "ok" and ruby.stdout.startswith("3."), ruby
    assert len({plain.container, sci.container, ruby.container}) == 3
    langs = await client.fncall_languages()
    assert {"python", "cpp", "ruby", "php", "r", "d", "jest", "go_test", "pytest"} <= set(langs), langs
    # the language needs its own layer: with the Ruby layer asked for, PHP still gets PHP's
    php = await client.fncall(FnCallArgs(language="php", code="<?php echo PHP_MAJOR_VERSION;",
                                         layers=[str(toolchain_layer("ruby"))]))
    assert php.status == "ok" and php.stdout == "8", php


async def test_a_new_language_call_is_isolated_and_swept(client: dsec.AsyncClient) -> None:
    hostile = await client.fncall(FnCallArgs(language="ruby", time_limit_s=2, code=(
        'File.write("/tmp/planted", "x"); File.write("/dev/shm/planted", "x")\n'
        'Process.detach(fork { sleep 60 })\nputs Process.uid\n'
        'begin; File.write("/tmp/.dsec-fncall/worker.py", "x"); puts "wrote"; rescue => e; puts e.class; end')))
    assert hostile.status == "ok" and int(hostile.stdout.split()[0]) >= 20000, hostile
    assert "Errno::EACCES" in hostile.stdout and "wrote" not in hostile.stdout
    for _ in range(3):  # whichever worker or container takes it sees none of that
        after = await client.fncall(FnCallArgs(language="ruby", code=(
            'puts [File.exist?("/tmp/planted"), File.exist?("/dev/shm/planted"), '
            '`ps -e -o comm=`.split.count("ruby")].inspect')))
        assert after.stdout == "[false, false, 1]\n", after
    net = await client.fncall(FnCallArgs(language="ruby", time_limit_s=5, code=(
        'require "socket"\nbegin; TCPSocket.new("1.1.1.1", 80); puts "connected"; '
        'rescue SystemCallError => e; puts e.class; end')))
    assert net.status == "ok" and "connected" not in net.stdout and "Errno::" in net.stdout, net
    mle = await client.fncall(FnCallArgs(language="ruby", code='x = "a" * (600 << 20); puts x.size',
                                         memory_limit_mb=128))
    assert mle.status in ("memory_limit", "runtime_error") and mle.exit_code != 0, mle


async def test_an_unbuilt_toolchain_is_a_400_naming_the_language(client: dsec.AsyncClient) -> None:
    built = LayerStore(f"{SRC_DATA}/layers").has(TOOLCHAINS["kotlin"].ref("kotlin"))
    if built:  # someone built the on-demand layer on this machine: then it serves
        r = await client.fncall(FnCallArgs(language="kotlin", code='println("hi")', time_limit_s=30))
        assert r.status == "ok" and r.stdout == "hi\n", r
        return
    with pytest.raises(dsec.DsecError) as e:
        await client.fncall(FnCallArgs(language="kotlin", code='println("hi")'))
    assert e.value.status == 400 and e.value.field == "language" and "toolchains build kotlin" in e.value.message


def test_toolchain_layers_hold_their_toolchain_and_no_build_residue(tmp_path: Any) -> None:
    """Each default toolchain layer of this node (as setup built it): the packages it names
    are installed in it, and nothing of the build is (apt's lists and caches, logs, /tmp)."""
    from dsec.node.host import linux

    store = LayerStore(f"{SRC_DATA}/layers")
    for name, tc in TOOLCHAINS.items():
        if not tc.default:
            continue
        layer = store.get(tc.ref(name))
        mnt = tmp_path / name
        mnt.mkdir()
        source, opts = store.mount_args(layer.digest)
        linux.mount(source, str(mnt), "erofs", linux.MS_RDONLY, opts)
        try:
            for residue in ("var/lib/apt/lists", "var/cache/apt/pkgcache.bin", "var/log", "tmp", "root/.cache"):
                assert not (mnt / residue).exists(), (name, residue)
            if tc.apt:
                status = (mnt / "var/lib/dpkg/status").read_text()
                for pkg in tc.apt:
                    assert f"Package: {pkg}\nStatus: install ok installed" in status, (name, pkg)
            if tc.pip:
                assert (mnt / "usr/local/lib/python3.11/dist-packages/numpy").is_dir()
            if tc.npm:
                assert (mnt / "usr/local/lib/dsec-node/node_modules/jest/package.json").is_file()
            assert not (mnt / "usr/bin/python3").exists()  # the base's files are not copied into it
        finally:
            linux.umount(str(mnt))
