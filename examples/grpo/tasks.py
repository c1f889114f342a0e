"""The task set of the GRPO example: real bugs injected into small pure-Python packages.

This module owns the task definitions (:class:`TaskDef`, :data:`TASKS`, :data:`CI_TASKS`),
fetching the packages' sources (:func:`fetch_sources`), building one workspace layer per
task on a dsec platform (:func:`build_task_layers`) and turning a definition plus its layer
into a gradable :class:`dsec.client.rl.Task` (:func:`to_task`).

Each task is one package's importable source, unpacked from its sdist, with one snippet of
one file replaced by a buggy variant; its hidden tests pass on the original and fail on the
bug. Each task also carries four candidate shell edits, exactly one of which is the fix: a
scripted "policy" can pick among them, which is what lets the example and its tests check
rewards end to end without a language model.

The packages must not be importable from the base image's own python: the grader appends
the solution's directory to ``sys.path``, so an installed copy would shadow the workspace
(``more-itertools``, a pytest dependency there, is why it is not in the set).
"""

from __future__ import annotations

import ast
import asyncio
import io
import os
import posixpath
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import dsec
from dsec.client.rl import Task

IMAGE = "base/debian:12"
WORKSPACE = "/work"
# never shipped into a workspace: the package's own tests, docs and build residue
_SKIP_DIRS = {"tests", "test", "testing", "docs", "doc", "__pycache__"}
_SKIP_SUFFIXES = (".pyc", ".pyo", ".so")
_SDIST_SUFFIXES = (".tar.gz", ".tgz", ".tar.bz2", ".zip")


@dataclass(frozen=True)
class TaskDef:
    """One bug-fixing task over a pinned PyPI package's source.

    ``module_dir`` is the directory of the unpacked sdist that goes on ``sys.path``;
    ``modules`` the top-level packages/modules in it that make up the workspace (their
    ``tests``/``docs`` subdirectories left out). ``file`` is relative to the unpacked root,
    which is also the layout of the workspace (``/work/<package>/<file>``). The bug is
    ``original`` replaced by ``buggy`` (``original`` occurs exactly once). ``candidates``
    are shell edits run from ``workspace_dir``; ``candidates[fix]`` restores the behaviour
    the ``hidden_tests`` check, the others do not."""

    name: str
    package: str
    version: str
    module_dir: str
    modules: tuple[str, ...]
    file: str
    original: str
    buggy: str
    candidates: list[str]
    fix: int
    hidden_tests: dict[str, str]
    prompt: str
    max_turns: int = 8

    @property
    def workspace_dir(self) -> str:
        return f"{WORKSPACE}/{self.package}"

    @property
    def solution_path(self) -> str:
        """The directory the hidden tests import the package from."""
        return posixpath.normpath(posixpath.join(self.workspace_dir, self.module_dir))

    @property
    def layer_ref(self) -> str:
        return layer_ref(self)

    def inject(self, text: str) -> str:
        """``text`` (the original ``file``) with the bug in it."""
        n = text.count(self.original)
        if n != 1:
            raise ValueError(f"{self.name}: the original snippet occurs {n} times in {self.file}, not once")
        return text.replace(self.original, self.buggy)


def layer_ref(td: TaskDef, tag: str = "v1") -> str:
    return f"ws/grpo-{td.name}:{tag}"


def count_tests(hidden_tests: dict[str, str]) -> int:
    """Test functions (module level ``test_*``, sync or async) in the hidden tests: what a
    complete run reports (a run that collects fewer, e.g. after an import error, is no pass)."""
    n = 0
    for src in hidden_tests.values():
        for node in ast.parse(src).body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test"):
                n += 1
    return n


TASKS: list[TaskDef] = [
    TaskDef(
        name="inflection-camelize",
        package="inflection", version="0.5.1", module_dir=".", modules=("inflection",),
        file="inflection/__init__.py",
        original='return re.sub(r"(?:^|_)(.)", lambda m: m.group(1).upper(), string)',
        buggy='return re.sub(r"(?:^|_)(.)", lambda m: m.group(1).lower(), string)',
        candidates=[
            "sed -i 's/string\\[0\\].lower()/string[0].upper()/' inflection/__init__.py",
            "sed -i 's/m.group(1).lower()/m.group(1).upper()/' inflection/__init__.py",
            "sed -i 's/m.group(1).lower()/m.group(0).upper()/' inflection/__init__.py",
            "sed -i 's/uppercase_first_letter: bool = True/uppercase_first_letter: bool = False/' "
            "inflection/__init__.py",
        ],
        fix=1,
        hidden_tests={"test_camelize.py": (
            "from inflection import camelize\n\n\n"
            "def test_upper_camel_case():\n"
            "    assert camelize(\"device_type\") == \"DeviceType\"\n\n\n"
            "def test_lower_camel_case():\n"
            "    assert camelize(\"device_type\", False) == \"deviceType\"\n\n\n"
            "def test_single_word():\n"
            "    assert camelize(\"product\") == \"Product\"\n\n\n"
            "def test_many_parts():\n"
            "    assert camelize(\"special_guest_of_honor\") == \"SpecialGuestOfHonor\"\n"
        )},
        prompt=("inflection.camelize() no longer produces CamelCase: camelize('device_type') returns "
                "'devicetype' instead of 'DeviceType', and camelize('device_type', False) returns "
                "'devicetype' instead of 'deviceType'. underscore() and the other helpers look fine."),
    ),
    TaskDef(
        name="inflection-ordinal",
        package="inflection", version="0.5.1", module_dir=".", modules=("inflection",),
        file="inflection/__init__.py",
        original="if number % 100 in (11, 12, 13):",
        buggy="if number % 10 in (11, 12, 13):",
        candidates=[
            "sed -i 's/(11, 12, 13)/(1, 2, 3)/' inflection/__init__.py",
            "sed -i 's/.get(number % 10, \"th\")/.get(number % 100, \"th\")/' inflection/__init__.py",
            "sed -i 's/number = abs(int(number))/number = int(number)/' inflection/__init__.py",
            "sed -i 's/number % 10 in/number % 100 in/' inflection/__init__.py",
        ],
        fix=3,
        hidden_tests={"test_ordinal.py": (
            "from inflection import ordinal, ordinalize\n\n\n"
            "def test_teens_take_th():\n"
            "    for n in (11, 12, 13, 111, 1012, -11):\n"
            "        assert ordinal(n) == \"th\", n\n\n\n"
            "def test_regular_suffixes():\n"
            "    cases = {1: \"st\", 2: \"nd\", 3: \"rd\", 4: \"th\", 21: \"st\", 102: \"nd\",\n"
            "             1003: \"rd\", 10: \"th\"}\n"
            "    for n, suffix in cases.items():\n"
            "        assert ordinal(n) == suffix, n\n\n\n"
            "def test_ordinalize():\n"
            "    assert ordinalize(11) == \"11th\"\n"
            "    assert ordinalize(-13) == \"-13th\"\n"
            "    assert ordinalize(22) == \"22nd\"\n"
        )},
        prompt=("inflection.ordinalize() gets the teens wrong: ordinalize(11) gives '11st', ordinalize(12) "
                "'12nd' and ordinalize(113) '113rd', where English wants '11th', '12th' and '113th'. "
                "Numbers such as 1, 22 or 103 still come out right."),
    ),
    TaskDef(
        name="six-ensure-str",
        package="six", version="1.16.0", module_dir=".", modules=("six.py",),
        file="six.py",
        original=("    elif PY3 and isinstance(s, binary_type):\n"
                  "        return s.decode(encoding, errors)\n"),
        buggy=("    elif PY3 and isinstance(s, binary_type):\n"
               "        return s.decode('ascii', errors)\n"),
        candidates=[
            "sed -i \"s/s.decode('ascii', errors)/s.decode('utf-8', errors)/\" six.py",
            "sed -i \"s/errors='strict'/errors='ignore'/\" six.py",
            "sed -i \"s/s.decode('ascii', errors)/s.decode(encoding, errors)/\" six.py",
            "sed -i 's/if type(s) is str:/if isinstance(s, str):/' six.py",
        ],
        fix=2,
        hidden_tests={"test_ensure_str.py": (
            "import pytest\n\nimport six\n\n\n"
            "def test_utf8_bytes():\n"
            "    assert six.ensure_str(\"caf\\u00e9\".encode(\"utf-8\")) == \"caf\\u00e9\"\n\n\n"
            "def test_explicit_encoding():\n"
            "    data = \"caf\\u00e9\".encode(\"latin-1\")\n"
            "    assert six.ensure_str(data, encoding=\"latin-1\") == \"caf\\u00e9\"\n\n\n"
            "def test_str_passes_through():\n"
            "    assert six.ensure_str(\"abc\") == \"abc\"\n\n\n"
            "def test_rejects_other_types():\n"
            "    with pytest.raises(TypeError):\n"
            "        six.ensure_str(3)\n"
        )},
        prompt=("six.ensure_str() fails on non-ASCII bytes: six.ensure_str('caf\u00e9'.encode()) raises "
                "UnicodeDecodeError ('ascii' codec can't decode byte 0xc3), and passing encoding='latin-1' "
                "for latin-1 bytes makes no difference. Plain ASCII bytes and str arguments work."),
    ),
    TaskDef(
        name="semver-bump-minor",
        package="semver", version="3.0.2", module_dir="src", modules=("semver",),
        file="src/semver/version.py",
        original="return cls(self._major, self._minor + 1)\n",
        buggy="return cls(self._major, self._minor + 1, self._patch)\n",
        candidates=[
            "sed -i 's/cls(self._major, self._minor, self._patch + 1)/cls(self._major, self._minor, 0)/' "
            "src/semver/version.py",
            "sed -i 's/cls(self._major, self._minor + 1, self._patch)/cls(self._major, self._minor + 1)/' "
            "src/semver/version.py",
            "sed -i 's/self._minor + 1, self._patch)/self._minor + 1, self._patch, self._prerelease)/' "
            "src/semver/version.py",
            "sed -i 's/return cls(self._major + 1)/return cls(self._major + 1, 0, 0)/' src/semver/version.py",
        ],
        fix=1,
        hidden_tests={"test_bump.py": (
            "from semver import Version\n\n\n"
            "def test_bump_minor_resets_the_patch():\n"
            "    assert str(Version.parse(\"3.4.5\").bump_minor()) == \"3.5.0\"\n\n\n"
            "def test_bump_minor_drops_prerelease_and_build():\n"
            "    assert Version.parse(\"1.2.3-rc.1+build.7\").bump_minor() == Version(1, 3, 0)\n\n\n"
            "def test_bump_patch():\n"
            "    assert str(Version.parse(\"3.4.5\").bump_patch()) == \"3.4.6\"\n\n\n"
            "def test_bump_major():\n"
            "    assert str(Version.parse(\"3.4.5\").bump_major()) == \"4.0.0\"\n\n\n"
            "def test_next_version_minor():\n"
            "    assert Version.parse(\"1.2.3\").next_version(\"minor\") == Version(1, 3, 0)\n"
        )},
        prompt=("semver's Version.bump_minor() keeps the old patch number: Version.parse('3.4.5').bump_minor() "
                "gives 3.5.5 instead of 3.5.0, and next_version('minor') is off the same way. bump_major() and "
                "bump_patch() are right."),
    ),
    TaskDef(
        name="toolz-partition-all",
        package="toolz", version="1.0.0", module_dir=".", modules=("toolz",),
        file="toolz/itertoolz.py",
        original="yield prev[:len(seq) % n]",
        buggy="yield prev[:len(seq) // n]",
        candidates=[
            "sed -i 's|prev\\[:len(seq) // n\\]|prev[:len(seq) - n]|' toolz/itertoolz.py",
            "sed -i 's/lo, hi = 0, n$/lo, hi = 0, n - 1/' toolz/itertoolz.py",
            "sed -i 's/if prev\\[-1\\] is no_pad:/if prev[-1] == no_pad:/' toolz/itertoolz.py",
            "sed -i 's|prev\\[:len(seq) // n\\]|prev[:len(seq) % n]|' toolz/itertoolz.py",
        ],
        fix=3,
        hidden_tests={"test_partition_all.py": (
            "from toolz import partition_all\n\n\n"
            "def test_list_with_a_remainder():\n"
            "    assert list(partition_all(2, [1, 2, 3, 4, 5])) == [(1, 2), (3, 4), (5,)]\n\n\n"
            "def test_longer_list():\n"
            "    assert list(partition_all(3, list(range(7)))) == [(0, 1, 2), (3, 4, 5), (6,)]\n\n\n"
            "def test_tuple():\n"
            "    got = list(partition_all(4, tuple(\"abcdefghi\")))\n"
            "    assert got == [tuple(\"abcd\"), tuple(\"efgh\"), (\"i\",)]\n\n\n"
            "def test_even_split():\n"
            "    assert list(partition_all(2, [1, 2, 3, 4])) == [(1, 2), (3, 4)]\n\n\n"
            "def test_iterator():\n"
            "    assert list(partition_all(3, iter(range(8)))) == [(0, 1, 2), (3, 4, 5), (6, 7)]\n"
        )},
        prompt=("toolz.partition_all() returns a wrong last chunk for lists and tuples: "
                "list(partition_all(2, [1, 2, 3, 4, 5])) ends with (5, '__no__pad__') instead of (5,), and "
                "partition_all(3, list(range(7))) ends with (6, '__no__pad__'). With a plain iterator "
                "(partition_all(2, iter([1, 2, 3, 4, 5]))) the result is right."),
    ),
    TaskDef(
        name="termcolor-colored",
        package="termcolor", version="2.4.0", module_dir="src", modules=("termcolor",),
        file="src/termcolor/termcolor.py",
        original='fmt_str = "\\033[%dm%s"',
        buggy='fmt_str = "\\033[%d%s"',
        candidates=[
            "python3 -c 'import pathlib; p = pathlib.Path(\"src/termcolor/termcolor.py\"); "
            "p.write_text(p.read_text().replace(\"[%d%s\", \"[%d;%s\"))'",
            "sed -i 's/result += RESET/result = RESET + result + RESET/' src/termcolor/termcolor.py",
            "python3 -c 'import pathlib; p = pathlib.Path(\"src/termcolor/termcolor.py\"); "
            "p.write_text(p.read_text().replace(\"[%d%s\", \"[%dm%s\"))'",
            "sed -i 's/if no_color is not None and no_color:/if no_color:/' src/termcolor/termcolor.py",
        ],
        fix=2,
        hidden_tests={"test_colored.py": (
            "from termcolor import colored\n\n\n"
            "def test_foreground():\n"
            "    assert colored(\"hi\", \"red\", force_color=True) == \"\\x1b[31mhi\\x1b[0m\"\n\n\n"
            "def test_highlight_and_attrs():\n"
            "    got = colored(\"hi\", \"green\", \"on_blue\", [\"bold\"], force_color=True)\n"
            "    assert got == \"\\x1b[1m\\x1b[44m\\x1b[32mhi\\x1b[0m\"\n\n\n"
            "def test_no_color():\n"
            "    assert colored(\"hi\", \"red\", no_color=True) == \"hi\"\n"
        )},
        prompt=("termcolor.colored() emits broken escape sequences: colored('hi', 'red', force_color=True) "
                "returns '\\x1b[31hi\\x1b[0m', which terminals do not render as red text (the '31hi' is "
                "shown or swallowed). The reset at the end is fine, and no_color=True still returns plain text."),
    ),
]

# the quickest to build and grade: one source file each, two different packages
CI_TASKS: list[str] = ["inflection-camelize", "six-ensure-str"]


def task_by_name(name: str) -> TaskDef:
    for td in TASKS:
        if td.name == name:
            return td
    raise KeyError(name)


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _find_sdist(cache_dir: str, package: str, version: str) -> str | None:
    for f in sorted(os.listdir(cache_dir)):
        ext = next((s for s in _SDIST_SUFFIXES if f.endswith(s)), None)
        if ext is None:
            continue
        name, _, ver = f[: -len(ext)].rpartition("-")
        if _canon(name) == _canon(package) and ver == version:
            return os.path.join(cache_dir, f)
    return None


def _safe_name(name: str) -> str:
    norm = posixpath.normpath(name)
    if name.startswith("/") or norm == ".." or norm.startswith("../") or "\\" in name or ":" in name:
        raise ValueError(f"unsafe path in the archive: {name!r}")
    return norm


def _unpack(archive: str, dest: str) -> None:
    """Extract ``archive`` into ``dest``, refusing anything that could land outside it
    (absolute paths, ``..``, links, devices): an sdist is only regular files and dirs."""
    if archive.endswith(".zip"):
        with zipfile.ZipFile(archive) as z:
            for zi in z.infolist():
                _safe_name(zi.filename)
            z.extractall(dest)
        return
    with tarfile.open(archive) as t:
        members = []
        for m in t.getmembers():
            _safe_name(m.name)
            if not (m.isfile() or m.isdir()):
                raise ValueError(f"{archive}: {m.name!r} is not a regular file or directory")
            members.append(m)
        t.extractall(dest, members=members, filter="data")


def fetch_sources(cache_dir: str, tasks: Iterable[TaskDef]) -> dict[str, str]:
    """Download (once) and unpack (once) the sdist of each distinct (package, version) of
    ``tasks`` under ``cache_dir``; package -> the unpacked root (the sdist's top directory).
    The package index is whatever pip is configured with."""
    os.makedirs(cache_dir, exist_ok=True)
    roots: dict[str, str] = {}
    for package, version in sorted({(td.package, td.version) for td in tasks}):
        dest = os.path.join(cache_dir, "src", f"{_canon(package)}-{version}")
        if not os.path.isdir(dest):
            sdist = _find_sdist(cache_dir, package, version)
            if sdist is None:
                subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary",
                                ":all:", f"{package}=={version}", "-d", cache_dir], check=True)
                sdist = _find_sdist(cache_dir, package, version)
                if sdist is None:
                    raise RuntimeError(f"pip download of {package}=={version} left no sdist in {cache_dir}")
            # unpacked next to its final place and renamed into it: a crash midway leaves no
            # half-extracted tree that a later call would take for a complete one
            tmp = f"{dest}.tmp-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
            _unpack(sdist, tmp)
            os.rename(tmp, dest)
        tops = [e for e in os.listdir(dest) if os.path.isdir(os.path.join(dest, e))]
        if len(tops) != 1:
            raise RuntimeError(f"{dest}: expected one top directory in the sdist, found {tops}")
        roots[package] = os.path.join(dest, tops[0])
    return roots


def workspace_files(td: TaskDef, root: str, *, buggy: bool = True) -> dict[str, bytes]:
    """The files of ``td``'s workspace, relative to ``workspace_dir`` (= to the unpacked
    root): the importable modules under ``module_dir``, with the bug injected when ``buggy``."""
    files: dict[str, bytes] = {}
    base = os.path.normpath(os.path.join(root, td.module_dir))
    for mod in td.modules:
        top = os.path.join(base, mod)
        if os.path.isfile(top):
            paths = [top]
        elif os.path.isdir(top):
            paths = []
            for d, dirs, names in os.walk(top):
                dirs[:] = sorted(x for x in dirs if x not in _SKIP_DIRS)
                paths += [os.path.join(d, n) for n in sorted(names) if not n.endswith(_SKIP_SUFFIXES)]
        else:
            raise FileNotFoundError(f"{td.name}: no module {mod!r} in {base}")
        for p in paths:
            with open(p, "rb") as f:
                files[os.path.relpath(p, root).replace(os.sep, "/")] = f.read()
    target = posixpath.normpath(td.file)
    if target not in files:
        raise FileNotFoundError(f"{td.name}: {td.file} is not among the workspace's files")
    if buggy:
        files[target] = td.inject(files[target].decode()).encode()
    return files


def _tar_of(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        for rel, data in sorted(files.items()):
            ti = tarfile.TarInfo(rel)
            ti.size, ti.mode, ti.mtime = len(data), 0o644, 0
            t.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


async def _layer_exists(client: dsec.AsyncClient, ref: str) -> bool:
    try:
        await client.layer(ref)
        return True
    except dsec.NotFound:
        return False


async def _build_one(client: dsec.AsyncClient, td: TaskDef, root: str, ref: str) -> None:
    sb = await client.run_container(dsec.ContainerArgs(image=IMAGE, memory_limit_mb=256, cpu_cores_limit=0.5,
                                                       labels={"dsec.example": "grpo-task-build"}))
    try:
        # one tar upload and one extract: a write_file per source file would be a round
        # trip each (toolz is dozens of files)
        tar = f"/tmp/grpo-{td.name}.tar"
        await sb.write_file(tar, _tar_of(workspace_files(td, root)))
        r = await sb.exec(["sh", "-c", 'mkdir -p "$1" && tar -xf "$2" --no-same-owner -C "$1" && rm -f "$2"',
                           "sh", td.workspace_dir, tar], timeout=120)
        if r.exit_code != 0:
            raise RuntimeError(f"{td.name}: unpacking the workspace failed: {r.stdout}{r.stderr}")
        await sb.pack_diff(ref)
    finally:
        await sb.stop()


async def build_task_layers(client: dsec.AsyncClient, cache_dir: str, tasks: Sequence[TaskDef],
                            tag: str = "v1", concurrency: int = 2) -> dict[str, str]:
    """One workspace layer per task (``ws/grpo-<name>:<tag>``, reused when it exists):
    the package's source with the bug in it under ``/work/<package>``; name -> layer ref."""
    tasks = list(tasks)
    roots = fetch_sources(cache_dir, tasks)
    refs = {td.name: layer_ref(td, tag) for td in tasks}
    sem = asyncio.Semaphore(concurrency)

    async def one(td: TaskDef) -> None:
        async with sem:
            if not await _layer_exists(client, refs[td.name]):
                await _build_one(client, td, roots[td.package], refs[td.name])

    await asyncio.gather(*(one(td) for td in tasks))
    return refs


def to_task(td: TaskDef, layer_ref: str) -> Task:
    """The gradable task: the base image plus the task's workspace layer."""
    prompt = (f"{td.prompt} The source of {td.package} {td.version} is in {td.workspace_dir}: "
              "fix the bug there.")
    return Task(image=IMAGE, layers=[layer_ref], hidden_tests=dict(td.hidden_tests), workspace=WORKSPACE,
                solution_path=td.solution_path, prompt=prompt, max_turns=td.max_turns,
                expected_tests=count_tests(td.hidden_tests), test_timeout_s=60)
