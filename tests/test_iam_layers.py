"""Layer visibility end to end on the real platform (dsec.control.iam.visibility): a builder's
pack_diff belongs to its sandbox's project, visible by default to that project's subtree;
another project gets the same 404 as for a layer that does not exist (GET, fork, create,
a batch) and does not see it listed; "private" hides it from sub-projects but not from
admins above; "public" opens it to all; only the owner's builders and admins remove it or
change it; base layers (no owner) stay everyone's and only the cluster's admin may
remove them."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator

import httpx
import pytest

import dsec
from tests.conftest import TOKEN, Platform

SMALL = dict(image="base/busybox", memory_limit_mb=64, cpu_cores_limit=0.25)


class Tree:
    """Two top-level projects A and B, A/sub, and tokens of each."""

    def __init__(self, platform: Platform) -> None:
        self.url = platform.url
        u = uuid.uuid4().hex[:6]
        self.a, self.b = f"lva{u}", f"lvb{u}"
        self.sub = f"{self.a}/sub"
        self.admin = dsec.Client(url=self.url, token=TOKEN)
        for p in (self.a, self.b, self.sub):
            self.admin.projects.create(p)
        self.clients = [self.admin]
        self.sandboxes: list[dsec.Sandbox] = []

    def client(self, project: str, role: str) -> dsec.Client:
        t = self.admin.create_token(project, role).token
        assert t is not None
        c = dsec.Client(url=self.url, token=t)
        self.clients.append(c)
        return c

    def run(self, c: dsec.Client, layers: list[str] | None = None) -> dsec.Sandbox:
        sb = c.run_container(dsec.ContainerArgs(**SMALL, layers=layers or []))  # type: ignore[arg-type]
        self.sandboxes.append(sb)
        return sb

    def fork(self, c: dsec.Client, ref: str) -> dsec.Sandbox:
        (sb,) = c.fork(ref, n=1, args=dsec.ContainerArgs(memory_limit_mb=64, cpu_cores_limit=0.25))
        self.sandboxes.append(sb)
        return sb

    def publish(self, builder: dsec.Client, name: str, **kw: str) -> dsec.Layer:
        sb = self.run(builder)
        assert sb.exec(["sh", "-c", f"mkdir -p /work && echo {name} > /work/marker"]).exit_code == 0
        return sb.pack_diff(f"ws/{name}:v1", **kw)  # type: ignore[arg-type]

    def close(self) -> None:
        for sb in self.sandboxes:
            try:
                sb.stop()
            except dsec.DsecError:
                pass
        for c in self.clients:
            c.close()


@pytest.fixture
def tree(platform: Platform) -> Iterator[Tree]:
    t = Tree(platform)
    try:
        yield t
    finally:
        t.close()


def _unknown(c: dsec.Client, ref: str) -> dsec.NotFound:
    """The error of a layer that does not exist, for comparison with a hidden one."""
    with pytest.raises(dsec.NotFound) as e:
        c.layer(ref)
    return e.value


def test_a_project_layer_is_its_subtrees_and_hidden_from_others(tree: Tree) -> None:
    a_builder, a_runner = tree.client(tree.a, "builder"), tree.client(tree.a, "runner")
    sub_runner = tree.client(tree.sub, "runner")
    b_builder, b_runner = tree.client(tree.b, "builder"), tree.client(tree.b, "runner")
    name = f"lv-{uuid.uuid4().hex[:8]}"
    layer = tree.publish(a_builder, name)
    ref = layer.ref
    assert (layer.owner, layer.visibility) == (tree.a, "project")

    # the owner project runs it, forks it, lists it
    assert a_runner.layer(ref).owner == tree.a
    assert ref in {x.ref for x in a_runner.layers()}
    assert tree.run(a_runner, [ref]).exec(["cat", "/work/marker"]).stdout == f"{name}\n"
    assert tree.fork(a_runner, ref).exec(["cat", "/work/marker"]).stdout == f"{name}\n"
    # its sub-project too
    assert sub_runner.layer(ref).visibility == "project"
    assert tree.run(sub_runner, [ref]).exec(["cat", "/work/marker"]).stdout == f"{name}\n"

    # another project: exactly what a layer that does not exist gets
    missing = f"ws/{name}-never:v1"
    want = _unknown(b_runner, missing)
    for c in (b_runner, b_builder):
        with pytest.raises(dsec.NotFound) as e:
            c.layer(ref)
        assert (e.value.field, e.value.message) == (want.field, want.message.replace(missing, ref))
        assert ref not in {x.ref for x in c.layers()}
    with pytest.raises(dsec.NotFound) as e:
        b_runner.fork(ref, n=1)
    assert e.value.field == "snapshot" and ref in e.value.message
    with pytest.raises(dsec.NotFound) as e:
        b_runner.run_container(dsec.ContainerArgs(**SMALL, layers=[ref]))  # type: ignore[arg-type]
    assert e.value.field == "layers[0]" and e.value.message == f"unknown layer {ref!r}"
    # an FnCall names layers too: through dsec's route and SandboxFusion's face alike
    with pytest.raises(dsec.NotFound) as e:
        b_runner.fncall(dsec.FnCallArgs(language="python", code="print(1)", layers=[ref]))
    assert e.value.field == "layers[0]"
    r = httpx.post(f"{tree.url}/sandboxfusion/{b_runner.token}/run_code", timeout=120,
                   json={"code": "print(open('/work/marker').read())", "language": "python", "layers": [ref]})
    # (the face puts the language's own layers first: python's scientific set)
    assert r.status_code == 404, r.text
    assert (r.json()["field"], r.json()["message"]) == ("layers[1]", f"unknown layer {ref!r}")
    with pytest.raises(dsec.NotFound) as e:  # a batch is checked when it is submitted
        b_runner.create_many(dsec.ContainerArgs(**SMALL, layers=[ref]), 2, None)  # type: ignore[arg-type]
    assert e.value.field == "layers[0]"
    # nor may it remove or change it: it does not exist for B
    with pytest.raises(dsec.NotFound):
        b_builder.remove_layer(ref)
    with pytest.raises(dsec.NotFound):
        b_builder.set_layer_visibility(ref, "public")
    # the sub-project sees it but does not own it
    sub_builder = tree.client(tree.sub, "builder")
    with pytest.raises(dsec.Forbidden):
        sub_builder.set_layer_visibility(ref, "public")
    with pytest.raises(dsec.Forbidden):
        sub_builder.remove_layer(ref)
    # a runner never changes layers, not even its own project's
    with pytest.raises(dsec.Forbidden):
        a_runner.set_layer_visibility(ref, "public")

    # the cluster's admin sees everything
    assert tree.admin.layer(ref).owner == tree.a
    assert ref in {x.ref for x in tree.admin.layers()}

    # private: the sub-project loses it, the owner and admins above keep it
    a_admin = tree.client(tree.a, "admin")
    assert a_builder.set_layer_visibility(ref, "private").visibility == "private"
    with pytest.raises(dsec.NotFound):
        sub_runner.layer(ref)
    with pytest.raises(dsec.NotFound):
        tree.run(sub_runner, [ref])
    assert ref not in {x.ref for x in sub_runner.layers()}
    assert a_runner.layer(ref).visibility == "private"
    assert a_admin.layer(ref).visibility == "private"

    # public: B runs and forks it, but still cannot change or remove it
    assert a_admin.set_layer_visibility(ref, "public").visibility == "public"
    assert tree.run(b_runner, [ref]).exec(["cat", "/work/marker"]).stdout == f"{name}\n"
    assert tree.fork(b_runner, ref).exec(["cat", "/work/marker"]).stdout == f"{name}\n"
    assert b_runner.layer(ref).owner == tree.a
    with pytest.raises(dsec.Forbidden):
        b_builder.remove_layer(ref)
    with pytest.raises(dsec.Forbidden):
        b_builder.set_layer_visibility(ref, "private")

    # every change is an IAM event, naming who made it
    events = [e for e in tree.admin.iam_events() if e.action == "layer.visibility" and e.target == ref]
    assert [e.detail["visibility"] for e in events] == ["private", "public"]
    assert all(e.project == tree.a for e in events)

    # the owner removes it once nothing runs on it; then it is gone for everyone
    for sb in tree.sandboxes:
        sb.stop()
    tree.sandboxes.clear()
    assert a_builder.remove_layer(ref).ref == ref
    for c in (tree.admin, a_runner):
        with pytest.raises(dsec.NotFound):
            c.layer(ref)


def test_private_at_publish_and_a_new_owner_for_the_same_name(tree: Tree) -> None:
    a_builder, a_runner = tree.client(tree.a, "builder"), tree.client(tree.a, "runner")
    sub_runner = tree.client(tree.sub, "runner")
    a_admin = tree.client(tree.a, "admin")
    b_builder = tree.client(tree.b, "builder")
    name = f"lv-{uuid.uuid4().hex[:8]}"
    layer = tree.publish(a_builder, name, visibility="private")
    assert (layer.owner, layer.visibility) == (tree.a, "private")
    assert tree.run(a_runner, [layer.ref]).exec(["cat", "/work/marker"]).stdout == f"{name}\n"
    assert a_admin.layer(layer.ref).owner == tree.a
    with pytest.raises(dsec.NotFound):
        sub_runner.layer(layer.ref)
    with pytest.raises(dsec.NotFound) as e:
        sub_runner.fork(layer.ref, n=1)
    assert e.value.field == "snapshot"
    # a pack_diff to a name another project published is refused; the owner stays
    with pytest.raises(dsec.DsecError):
        tree.publish(b_builder, name)
    assert tree.admin.layer(layer.ref).owner == tree.a
    # removed, the name is free again: its next publisher owns it
    for sb in tree.sandboxes:
        sb.stop()
    tree.sandboxes.clear()
    a_builder.remove_layer(layer.ref)
    again = tree.publish(b_builder, name, visibility="public")
    assert (again.owner, again.visibility) == (tree.b, "public")
    assert a_runner.layer(again.ref).owner == tree.b


def test_base_layers_are_everyones_and_only_the_admins_to_change(tree: Tree) -> None:
    b_builder, b_runner = tree.client(tree.b, "builder"), tree.client(tree.b, "runner")
    base = b_runner.layer("base/busybox")
    assert (base.owner, base.visibility) == (None, "public")
    assert "base/busybox:latest" in {x.ref for x in b_runner.layers()}
    assert tree.run(b_runner).exec(["true"]).exit_code == 0
    with pytest.raises(dsec.Forbidden):
        b_builder.remove_layer("base/busybox")
    with pytest.raises(dsec.Forbidden):
        b_builder.set_layer_visibility("base/busybox", "private")
    with pytest.raises(dsec.InvalidRequest):
        tree.admin.set_layer_visibility("base/busybox", "secret")


def test_cli_changes_visibility(tree: Tree, platform: Platform) -> None:
    a_builder = tree.client(tree.a, "builder")
    b_runner = tree.client(tree.b, "runner")
    ref = tree.publish(a_builder, f"lv-{uuid.uuid4().hex[:8]}").ref
    base = [sys.executable, "-m", "dsec.client.cli.main", "layer", "visibility"]
    r = subprocess.run([*base, ref, "public", "--url", platform.url, "--token", a_builder.token or ""],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert f"{ref} public (project {tree.a})" in r.stdout
    assert b_runner.layer(ref).visibility == "public"
    r = subprocess.run([*base, ref, "private", "--url", platform.url, "--token", b_runner.token or ""],
                       capture_output=True, text=True)
    assert r.returncode != 0  # a runner changes no layer
    assert b_runner.layer(ref).visibility == "public"
