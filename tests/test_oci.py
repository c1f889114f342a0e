"""OCI import against real sources: Debian's docker-registry started here on loopback
(the test pushes an image into it over the registry API), an OCI layout directory and a
docker-archive tar; gzip, zstd and plain layers; whiteouts and opaque dirs; collapse;
and the failures (registry down, corrupt blob, unknown tag) publishing nothing."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import socket
import subprocess
import tarfile
import time
from collections.abc import Iterator

import httpx
import pytest
import zstandard

import dsec
from dsec.node.layers.oci import ImportFailed, import_oci
from dsec.node.layers.store import LayerStore
from tests.conftest import TOKEN, Platform


def _tar(entries: list[tuple[str, bytes | None, int]]) -> bytes:
    """(name, data or None for a dir, mode) -> an uncompressed layer tar."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        for name, data, mode in entries:
            info = tarfile.TarInfo(name)
            info.mode = mode
            info.mtime = int(time.time())
            if data is None:
                info.type = tarfile.DIRTYPE
                t.addfile(info)
            else:
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _busybox_layer() -> bytes:
    busybox = open(shutil.which("busybox") or "/bin/busybox", "rb").read()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        for d in ("bin", "etc", "root", "tmp", "data", "data/old", "proc", "sys", "dev"):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            t.addfile(info)
        info = tarfile.TarInfo("bin/busybox")
        info.size, info.mode = len(busybox), 0o755
        t.addfile(info, io.BytesIO(busybox))
        for applet in ("sh", "ls", "cat", "test", "echo"):
            link = tarfile.TarInfo(f"bin/{applet}")
            link.type, link.linkname = tarfile.SYMTYPE, "busybox"
            t.addfile(link)
        for name, data in (("etc/base.txt", b"base\n"), ("etc/gone.txt", b"gone\n"),
                           ("data/old/a", b"a\n"), ("data/old/b", b"b\n")):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            t.addfile(info, io.BytesIO(data))
    return buf.getvalue()


class Image:
    """A three-layer image: busybox base (gzip), a zstd layer with a whiteout and an
    opaque dir, a plain tar layer."""

    def __init__(self, salt: str = "") -> None:
        l1 = gzip.compress(_busybox_layer())
        l2 = zstandard.ZstdCompressor().compress(_tar([
            ("etc/.wh.gone.txt", b"", 0o644), ("data/old/.wh..wh..opq", b"", 0o644),
            ("data/old/c", b"c\n", 0o644), ("etc/added.txt", b"added\n", 0o600)]))
        l3 = _tar([("etc/base.txt", b"overridden\n", 0o644)] + ([("etc/salt", salt.encode(), 0o644)] if salt else []))
        self.layers = [(l1, "application/vnd.oci.image.layer.v1.tar+gzip"),
                       (l2, "application/vnd.oci.image.layer.v1.tar+zstd"),
                       (l3, "application/vnd.oci.image.layer.v1.tar")]
        self.config = json.dumps({"architecture": "amd64", "os": "linux",
                                  "rootfs": {"type": "layers", "diff_ids": []}}).encode()
        self.manifest = json.dumps({
            "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": _d(self.config),
                       "size": len(self.config)},
            "layers": [{"mediaType": mt, "digest": _d(b), "size": len(b)} for b, mt in self.layers]}).encode()

    def blobs(self) -> list[bytes]:
        return [self.config, *[b for b, _ in self.layers]]

    def write_layout(self, path: str, tag: str = "v1") -> None:
        os.makedirs(os.path.join(path, "blobs", "sha256"), exist_ok=True)
        for blob in [*self.blobs(), self.manifest]:
            with open(os.path.join(path, "blobs", "sha256", _d(blob)[7:]), "wb") as f:
                f.write(blob)
        with open(os.path.join(path, "oci-layout"), "w") as f:
            f.write('{"imageLayoutVersion": "1.0.0"}')
        with open(os.path.join(path, "index.json"), "w") as f:
            json.dump({"schemaVersion": 2, "manifests": [{
                "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": _d(self.manifest),
                "size": len(self.manifest), "annotations": {"org.opencontainers.image.ref.name": tag}}]}, f)

    def write_docker_archive(self, path: str) -> None:
        plain = [_busybox_layer(), zstandard.ZstdDecompressor().decompress(self.layers[1][0]), self.layers[2][0]]
        with tarfile.open(path, "w") as t:
            names = []
            for i, data in enumerate(plain):
                info = tarfile.TarInfo(f"l{i}/layer.tar")
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
                names.append(info.name)
            man = json.dumps([{"Config": "config.json", "RepoTags": ["x:v1"], "Layers": names}]).encode()
            for name, data in (("manifest.json", man), ("config.json", self.config)):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))


def _d(b: bytes) -> str:
    return "sha256:" + hashlib.sha256(b).hexdigest()


@pytest.fixture(scope="module")
def image() -> Image:
    return Image()


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Debian's docker-registry (distribution 2.x) on a free loopback port."""
    root = tmp_path_factory.mktemp("registry")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = root / "config.yml"
    cfg.write_text(f"version: 0.1\nstorage:\n  filesystem:\n    rootdirectory: {root}/data\n"
                   f"  delete:\n    enabled: true\nhttp:\n  addr: 127.0.0.1:{port}\nlog:\n  level: warn\n")
    proc = subprocess.Popen(["docker-registry", "serve", str(cfg)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"127.0.0.1:{port}"
    for _ in range(100):
        try:
            if httpx.get(f"http://{url}/v2/", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.1)
    else:
        proc.kill()
        raise RuntimeError("docker-registry did not start")
    yield url
    proc.terminate()
    proc.wait(timeout=10)


def push(registry: str, name: str, tag: str, image: Image) -> None:
    """Push over the distribution API: monolithic blob uploads, then the manifest."""
    base = f"http://{registry}/v2/{name}"
    for blob in image.blobs():
        r = httpx.post(f"{base}/blobs/uploads/")
        assert r.status_code == 202, r.text
        loc = r.headers["location"]
        loc = loc if loc.startswith("http") else f"http://{registry}{loc}"
        loc += ("&" if "?" in loc else "?") + f"digest={_d(blob)}"  # keep the upload's _state query
        r = httpx.put(loc, content=blob,
                      headers={"Content-Type": "application/octet-stream"})
        assert r.status_code == 201, r.text
    r = httpx.put(f"{base}/manifests/{tag}", content=image.manifest,
                  headers={"Content-Type": "application/vnd.oci.image.manifest.v1+json"})
    assert r.status_code == 201, r.text
    # and a multi-platform index naming it, as most public images are published
    index = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": [
        {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": _d(image.manifest),
         "size": len(image.manifest), "platform": {"architecture": "amd64", "os": "linux"}}]}).encode()
    r = httpx.put(f"{base}/manifests/{tag}-index", content=index,
                  headers={"Content-Type": "application/vnd.oci.image.index.v1+json"})
    assert r.status_code == 201, r.text


@pytest.fixture(scope="module")
def store(platform: Platform) -> LayerStore:
    return LayerStore(os.path.join(platform.data_dir, "layers"))


def _check_view(platform: Platform, ref: str) -> None:
    with dsec.Client(url=platform.url, token=TOKEN) as c:
        sb = c.run_container(dsec.ContainerArgs(image=ref))
        try:
            r = sb.exec("cat /etc/base.txt /etc/added.txt; ls /etc; ls /data/old")
            assert r.exit_code == 0, r.stderr
            assert r.stdout.split() == ["overridden", "added", "added.txt", "base.txt", "c"]
            assert sb.stat("/etc/added.txt").mode == 0o600
        finally:
            sb.stop()


def test_import_from_registry(platform: Platform, registry: str, image: Image, store: LayerStore) -> None:
    push(registry, "dsec/test", "v1", image)
    layer = import_oci(store, f"http://{registry}/dsec/test:v1", "base/oci-reg:v1")
    assert layer.kind == "base" and len(layer.all_blobs) == 1  # three small layers collapsed into one
    _check_view(platform, layer.ref)
    by_digest = import_oci(store, f"http://{registry}/dsec/test@{_d(image.manifest)}", "base/oci-reg:v2",
                           collapse_bytes=1)  # every layer its own EROFS image, whiteouts across images
    assert len(by_digest.all_blobs) == 3
    _check_view(platform, by_digest.ref)
    via_index = import_oci(store, f"http://{registry}/dsec/test:v1-index", "base/oci-index:v1")
    assert via_index.all_blobs == layer.all_blobs  # same content, same blob: stored once
    _check_view(platform, via_index.ref)


def test_import_from_layout_and_docker_archive(platform: Platform, image: Image, store: LayerStore,
                                               tmp_path_factory: pytest.TempPathFactory) -> None:
    d = tmp_path_factory.mktemp("oci")
    image.write_layout(str(d / "layout"))
    _check_view(platform, import_oci(store, f"oci:{d}/layout:v1", "base/oci-layout:v1").ref)
    image.write_docker_archive(str(d / "img.tar"))
    _check_view(platform, import_oci(store, f"docker-archive:{d}/img.tar", "base/oci-archive:v1").ref)


def test_import_failures_publish_nothing(registry: str, image: Image, store: LayerStore,
                                         tmp_path_factory: pytest.TempPathFactory) -> None:
    before = set(os.listdir(store.blob_dir))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    with pytest.raises(ImportFailed, match="unreachable"):
        import_oci(store, f"http://127.0.0.1:{dead}/x/y:v1", "base/down:v1")
    with pytest.raises(dsec.NotFound):
        import_oci(store, f"http://{registry}/dsec/test:no-such-tag", "base/notag:v1")
    d = tmp_path_factory.mktemp("bad")
    image = Image(salt="never converted before")  # so no cached conversion stands in for the bad blob
    image.write_layout(str(d))
    victim = os.path.join(d, "blobs", "sha256", _d(image.layers[1][0])[7:])
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) // 2)
    with pytest.raises(ImportFailed, match="truncated or corrupt|not a valid layer"):
        import_oci(store, f"oci:{d}:v1", "base/truncated:v1")
    for ref in ("base/down:v1", "base/notag:v1", "base/truncated:v1"):
        assert not store.has(ref)
    leftover = set(os.listdir(store.blob_dir)) - before
    assert not [b for b in leftover if b.endswith(".tmp")]
