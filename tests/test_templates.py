"""E2B template builds through the official E2B SDK (PyPI ``e2b``, unmodified) against
dsec: steps run in a builder sandbox whose egress is the package registries (pip installs
from the node's configured index), the result published as a layer, its start and ready
commands run at each create; the step cache, failing steps, Dockerfiles as the SDK parses
them, FROM resolution, tags, listing and deleting, and what the apiserver refuses."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator

import httpx
import pytest
from conftest import TOKEN, Platform, own_platform
from e2b import BuildException, Sandbox, Template, TemplateBase
from e2b.template.main import TemplateBuilder

from tests.test_oci import Image, push, registry  # noqa: F401  (registry: a fixture)

CTX = os.path.join(os.path.dirname(__file__), "templates_ctx")
PKG = "six==1.16.0"  # small, pure python, on every index


def _steps(marker: str) -> TemplateBuilder:
    return (Template(file_context_path=CTX).from_image("debian:12")
            .run_cmd(f"pip install --break-system-packages --no-cache-dir {PKG} && echo {marker}")
            .copy("app/", "/app")
            .set_envs({"GREETING": "hi there"})
            .set_workdir("/app")
            .run_cmd("id -un > /app/built-by && pwd > /app/built-in")
            .set_user("user"))


def _template(marker: str) -> TemplateBase:
    return _steps(marker).set_start_cmd("echo started > /tmp/started; sleep 3600", "test -f /tmp/started")


def test_build_then_create(e2b_env: None, platform: Platform) -> None:
    logs: list[str] = []
    t0 = time.monotonic()
    info = Template.build(_template("cold"), "tpl-basic", cpu_count=1, memory_mb=1024,
                          on_build_logs=lambda e: logs.append(e.message))
    cold = time.monotonic() - t0
    text = "\n".join(logs)
    assert "Successfully installed six" in text and "cold" in text, text[-2000:]
    assert info.template_id and info.build_id
    sbx = Sandbox.create("tpl-basic", timeout=120)
    try:
        r = sbx.commands.run("python3 /app/hello.py; cat /app/data.txt /app/built-by /app/built-in; echo $GREETING; "
                             "cat /tmp/started; stat -c %U /app/hello.py", user="user")
        assert r.stdout.splitlines() == ["hello from the template 1.16.0", "context file", "root", "/app",
                                         "hi there", "started", "root"], r.stdout
        got = httpx.get(f"{platform.url}/v1/sandboxes/{sbx.sandbox_id}",
                        headers={"Authorization": f"Bearer {TOKEN}"}).json()
        assert (got["cpu_cores_limit"], got["memory_limit_mb"]) == (1, 1024)  # the build's resources
    finally:
        sbx.kill()
    # the same steps again: every step comes from the cache, no builder runs
    logs.clear()
    t0 = time.monotonic()
    again = Template.build(_template("cold"), "tpl-basic", cpu_count=1, memory_mb=1024,
                           on_build_logs=lambda e: logs.append(e.message))
    warm = time.monotonic() - t0
    assert again.build_id != info.build_id
    assert not any("Starting the builder" in m for m in logs), logs
    assert sum("CACHED" in m for m in logs) >= 6, logs
    assert warm < cold, (warm, cold)
    # more steps after cached ones: the cached build is the base, only the new step runs
    logs.clear()
    changed = _steps("cold").run_cmd("echo extra-step")
    Template.build(changed, "tpl-basic-2", on_build_logs=lambda e: logs.append(e.message))
    text = "\n".join(logs)
    assert "Starting the builder" in text and "extra-step" in text and "Successfully installed six" not in text


def test_failing_step_publishes_nothing(e2b_env: None, platform: Platform) -> None:
    good = Template().from_image("debian:12").run_cmd("echo first > /first")
    Template.build(good, "tpl-fail")
    before = httpx.get(f"{platform.url}/templates/tpl-fail/tags", headers={"X-API-Key": TOKEN}).json()
    logs: list[str] = []
    bad = Template().from_image("debian:12").run_cmd("echo about to fail; exit 3")
    with pytest.raises(BuildException) as e:
        Template.build(bad, "tpl-fail", on_build_logs=lambda x: logs.append(x.message))
    assert "exit status 3" in str(e.value)
    assert "about to fail" in "\n".join(logs)
    after = httpx.get(f"{platform.url}/templates/tpl-fail/tags", headers={"X-API-Key": TOKEN}).json()
    assert after == before  # the default tag still names the good build
    sbx = Sandbox.create("tpl-fail", timeout=60)
    try:
        assert sbx.commands.run("cat /first").stdout == "first\n"
    finally:
        sbx.kill()
    # no builder sandbox is left behind
    listed = httpx.get(f"{platform.url}/v1/sandboxes", headers={"Authorization": f"Bearer {TOKEN}"}).json()
    assert not [s for s in listed if s["labels"].get("dsec-role") == "template-builder" and s["state"] == "running"]


def test_dockerfile_as_the_sdk_parses_it(e2b_env: None) -> None:
    dockerfile = """
FROM debian:12
ARG VERSION=1.16.0
ENV APP_HOME=/srv/app
RUN pip install --break-system-packages --no-cache-dir six==$VERSION
COPY app/hello.py $APP_HOME/
WORKDIR $APP_HOME
RUN echo 'runner:x:1001:1001::/home/runner:/bin/bash' >> /etc/passwd && chown 1001 /srv/app
USER runner
RUN echo "built as $(id -un) in $(pwd)" > /srv/app/note
CMD ["sh", "-c", "echo cmd-ran > /tmp/cmd; sleep 3600"]
"""
    t = Template(file_context_path=CTX).from_dockerfile(dockerfile)
    Template.build(t, "tpl-dockerfile")
    sbx = Sandbox.create("tpl-dockerfile", timeout=120)
    try:
        # the CMD starts with the sandbox and is not waited for (its ready command is only E2B's
        # build-time pause): its file is there a moment after the create, not at once
        r = sbx.commands.run("cat /srv/app/note; python3 /srv/app/hello.py; echo $APP_HOME; "
                             "for i in $(seq 100); do [ -s /tmp/cmd ] && break; sleep 0.1; done; cat /tmp/cmd",
                             user="root")
        assert r.stdout.splitlines() == ["built as runner in /srv/app", "hello from the template 1.16.0",
                                         "/srv/app", "cmd-ran"], r.stdout
    finally:
        sbx.kill()


def test_unknown_image_fails_the_build(e2b_env: None) -> None:
    with pytest.raises(BuildException) as e:
        Template.build(Template().from_image("nosuch/image:1").run_cmd("true"), "tpl-noimage")
    assert "nosuch/image:1" in str(e.value) and "alias" in str(e.value)


def test_templates_listed_tagged_deleted(e2b_env: None, platform: Platform) -> None:
    t = Template().from_image("debian:12").run_cmd("echo v1 > /v")
    Template.build(t, "tpl-tags:v1")
    assert Template.exists("tpl-tags")
    assert not Template.exists("tpl-nosuch")
    assert Template.build(Template().from_image("debian:12").run_cmd("echo v2 > /v"), "tpl-tags:v2")
    tags = {x.tag for x in Template.get_tags("tpl-tags")}
    assert tags == {"v1", "v2"}
    for tag, want in (("v1", "v1"), ("v2", "v2")):
        sbx = Sandbox.create(f"tpl-tags:{tag}", timeout=60)
        try:
            assert sbx.commands.run("cat /v").stdout.strip() == want
        finally:
            sbx.kill()
    Template.assign_tags("tpl-tags:v1", ["stable"])
    assert {x.tag for x in Template.get_tags("tpl-tags")} == {"v1", "v2", "stable"}
    Template.remove_tags("tpl-tags", ["v2"])
    assert {x.tag for x in Template.get_tags("tpl-tags")} == {"v1", "stable"}
    h = {"X-API-Key": TOKEN}
    listed = httpx.get(f"{platform.url}/templates", headers=h).json()
    mine = [x for x in listed if x["names"] == ["tpl-tags"]]
    assert mine and mine[0]["buildStatus"] == "ready" and mine[0]["buildCount"] == 2
    tid = mine[0]["templateID"]
    got = httpx.get(f"{platform.url}/templates/{tid}", headers=h).json()
    assert len(got["builds"]) == 2
    assert httpx.delete(f"{platform.url}/templates/{tid}", headers=h).status_code == 204
    assert not Template.exists("tpl-tags")
    assert httpx.get(f"{platform.url}/templates/{tid}", headers=h).status_code == 404


def test_refusals(platform: Platform) -> None:
    h = {"X-API-Key": TOKEN}
    r = httpx.post(f"{platform.url}/v3/templates", headers=h, json={"name": "Bad Name!"})
    assert r.status_code == 400 and "name" in r.json()["message"]
    r = httpx.post(f"{platform.url}/v3/templates", headers=h, json={"name": "tpl-refusals", "cpuCount": 0})
    assert r.status_code == 400 and "cpuCount" in r.json()["message"]
    req = httpx.post(f"{platform.url}/v3/templates", headers=h, json={"name": "tpl-refusals"}).json()
    tid, bid = req["templateID"], req["buildID"]
    start = f"{platform.url}/v2/templates/{tid}/builds/{bid}"
    r = httpx.post(start, headers=h, json={"steps": []})
    assert r.status_code == 400 and "fromImage" in r.json()["message"]
    r = httpx.post(start, headers=h, json={"fromImage": "debian:12", "steps": [{"type": "COPY", "args": ["a", "/a"],
                                                                               "filesHash": "0" * 64}]})
    assert r.status_code == 400 and "uploaded" in r.json()["message"]
    r = httpx.post(start, headers=h, json={"fromImage": "debian:12", "steps": [{"type": "RUN"}]})
    assert r.status_code == 400 and "RUN" in r.json()["message"]
    up = httpx.get(f"{platform.url}/templates/{tid}/files/{'1' * 64}", headers=h).json()
    assert up["present"] is False and "signature=" in up["url"]
    assert httpx.put(up["url"].split("?")[0], content=b"x").status_code == 401
    assert httpx.put(up["url"] + "0", content=b"x").status_code == 401
    assert httpx.put(up["url"], content=b"x").status_code == 200
    assert httpx.get(f"{platform.url}/templates/{tid}/files/{'1' * 64}", headers=h).json()["present"] is True
    assert httpx.get(f"{platform.url}/templates/{tid}/builds/nosuch/status", headers=h).status_code == 404
    assert httpx.get(f"{platform.url}/templates/aliases/tpl-nosuch", headers=h).status_code == 404
    assert httpx.post(f"{platform.url}/v3/templates", json={"name": "x"}).status_code == 401


@pytest.fixture(scope="module")
def registry_platform(tmp_path_factory: pytest.TempPathFactory, registry: str  # noqa: F811
                      ) -> Iterator[Platform]:
    """A platform that pulls a FROM image it does not have from a registry on loopback
    (Debian's docker-registry, started by test_oci's fixture)."""
    yield from own_platform(tmp_path_factory, "tpl-oci", env={"DSEC_OCI_REGISTRIES": f"http://{registry}",
                                                               "DSEC_IMAGE_ALIASES": "mybase=base/busybox"})


def test_from_an_oci_registry_and_an_alias(registry_platform: Platform, registry: str,  # noqa: F811
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in (("E2B_API_URL", registry_platform.url), ("E2B_SANDBOX_URL", registry_platform.url),
                 ("E2B_API_KEY", TOKEN)):
        monkeypatch.setenv(k, v)
    push(registry, "dsec/app", "v1", Image())
    logs: list[str] = []
    Template.build(Template().from_image("dsec/app:v1").run_cmd("echo built > /etc/built"), "tpl-oci",
                   on_build_logs=lambda e: logs.append(e.message))
    assert any("base/oci-" in m for m in logs), logs  # pulled and imported once, as a base layer
    sbx = Sandbox.create("tpl-oci", timeout=60)
    try:  # a busybox image: no bash for commands, so read files through envd
        assert sbx.files.read("/etc/built", user="root") == "built\n"
        assert sbx.files.read("/etc/base.txt", user="root") == "overridden\n"  # the image's own layers
        assert "user:x:1000" in sbx.files.read("/etc/passwd", user="root")  # E2B's user, provisioned
    finally:
        sbx.kill()
    Template.build(Template().from_image("mybase").run_cmd("echo aliased > /aliased"), "tpl-alias")
    with pytest.raises(BuildException) as e:
        Template.build(Template().from_image("dsec/nosuch:v1").run_cmd("true"), "tpl-oci-missing")
    assert "could not be pulled" in str(e.value) and "dsec/nosuch" in str(e.value)


def test_image_in_metadata_and_long_timeouts(e2b_env: None) -> None:
    """slime's way: no template, the image under a metadata key; and Harbor's 24 h timeouts."""
    sbx = Sandbox.create(metadata={"image": "debian:12"}, timeout=24 * 3600)
    try:
        assert sbx.commands.run("cat /etc/debian_version").stdout.startswith("12.")
        end = Sandbox.get_info(sbx.sandbox_id).end_at.timestamp()
        assert end - time.time() > 23.9 * 3600
    finally:
        sbx.kill()
    with pytest.raises(Exception) as e:
        Sandbox.create(metadata={"image": "nosuch/image:9"}, timeout=60)
    assert "nosuch/image:9" in str(e.value)


@pytest.fixture
def crash_platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    yield from own_platform(tmp_path_factory, "tpl-crash")


def test_build_of_a_dead_apiserver_fails_and_its_builder_stops(crash_platform: Platform) -> None:
    url, h = crash_platform.url, {"X-API-Key": TOKEN}
    req = httpx.post(f"{url}/v3/templates", headers=h, json={"name": "tpl-crash"}).json()
    tid, bid = req["templateID"], req["buildID"]
    r = httpx.post(f"{url}/v2/templates/{tid}/builds/{bid}", headers=h, json={
        "fromImage": "debian:12", "steps": [{"type": "RUN", "args": ["echo started; sleep 600"]}]})
    assert r.status_code == 202, r.text
    status = f"{url}/templates/{tid}/builds/{bid}/status"
    deadline = time.monotonic() + 60
    while "started" not in str(httpx.get(status, headers=h).json()["logEntries"]):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    builders = [s["sandbox_id"] for s in httpx.get(f"{url}/v1/sandboxes", headers=auth).json()
                if s["labels"].get("dsec.template-build") == bid]
    assert len(builders) == 1
    crash_platform.restart(crash=True)
    st = httpx.get(status, headers=h).json()
    assert st["status"] == "error" and "runner" in st["reason"]["message"], st
    assert httpx.get(f"{url}/v1/sandboxes/{builders[0]}", headers=auth).json()["state"] != "running"


def test_js_sdk_builds(platform: Platform) -> None:
    """The E2B JS SDK (npm e2b, in tests/e2b_js) builds a template and starts a sandbox from it."""
    here = os.path.join(os.path.dirname(__file__), "e2b_js")
    env = {**os.environ, "E2B_API_URL": platform.url, "E2B_SANDBOX_URL": platform.url, "E2B_API_KEY": TOKEN,
           "CTX": CTX}
    r = subprocess.run(["node", "template.mjs"], cwd=here, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"built": True, "logged": True, "files": "built-by-js\ncontext file\nyes\n", "exists": True}, out


def test_project_tokens_on_the_e2b_face(platform: Platform) -> None:
    """A project's runner token creates sandboxes through E2B's API, and cannot see, extend
    or kill another project's by id; a runner may not build templates (builders may)."""
    admin = {"Authorization": f"Bearer {TOKEN}"}
    made = {}
    for project, role in (("e2b-a", "runner"), ("e2b-b", "runner"), ("e2b-a", "builder")):
        r = httpx.post(f"{platform.url}/v1/tokens", headers=admin, json={"project": project, "role": role})
        assert r.status_code in (200, 201), r.text
        made[(project, role)] = {"X-API-Key": r.json()["token"]}
    a, b = made[("e2b-a", "runner")], made[("e2b-b", "runner")]
    r = httpx.post(f"{platform.url}/sandboxes", headers=a, json={"templateID": "base", "timeout": 60})
    assert r.status_code == 201, r.text
    sid = r.json()["sandboxID"]
    try:
        assert httpx.get(f"{platform.url}/sandboxes/{sid}", headers=b).status_code == 404
        assert httpx.post(f"{platform.url}/sandboxes/{sid}/timeout", headers=b, json={"timeout": 5}).status_code == 404
        assert httpx.delete(f"{platform.url}/sandboxes/{sid}", headers=b).status_code == 404
        assert httpx.get(f"{platform.url}/sandboxes/{sid}", headers=a).status_code == 200
    finally:
        assert httpx.delete(f"{platform.url}/sandboxes/{sid}", headers=a).status_code == 204
    r = httpx.post(f"{platform.url}/v3/templates", headers=a, json={"name": "tpl-by-a-runner"})
    assert r.status_code == 403
    r = httpx.post(f"{platform.url}/v3/templates", headers=made[("e2b-a", "builder")], json={"name": "tpl-by-a"})
    assert r.status_code == 202, r.text
    tid = r.json()["templateID"]
    assert httpx.get(f"{platform.url}/templates/{tid}", headers=b).status_code == 404  # another project's
    assert httpx.get(f"{platform.url}/templates/{tid}", headers=a).status_code == 200
