"""OCI image import: fetch an image (registry HTTP API v2, OCI layout dir, or
docker-archive tar), convert it once to EROFS layers, publish it under one ref.

Conversion applies the OCI layer tars in order into staging trees, turning OCI
whiteouts into overlayfs ones (``.wh.NAME`` -> a 0/0 character device ``NAME``;
``.wh..wh..opq`` -> the ``trusted.overlay.opaque`` xattr), so the EROFS images delete
what the OCI layers delete when stacked. Consecutive layers under a size threshold are
collapsed into one EROFS image; a large layer stays an image of its own, so images
that share it share its blob. Every blob is checked against its digest.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import re
import shutil
import stat
import tarfile
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, Any

from dsec.node.layers.store import ImportOptions, Layer, LayerStore
from dsec.shared.errors import InvalidRequest, NotFound

INDEX_TYPES = {"application/vnd.oci.image.index.v1+json",
               "application/vnd.docker.distribution.manifest.list.v2+json"}
MANIFEST_TYPES = {"application/vnd.oci.image.manifest.v1+json",
                  "application/vnd.docker.distribution.manifest.v2+json"}
ACCEPT = ", ".join(sorted(INDEX_TYPES | MANIFEST_TYPES))
COLLAPSE_BYTES = 64 * 1024 * 1024
Progress = Callable[[str, int, int], None]


class ImportFailed(InvalidRequest):
    """The image could not be fetched or converted; nothing was published."""


@dataclass
class LayerBlob:
    digest: str
    media_type: str
    size: int


class Source:
    """Where manifests and blobs come from."""

    def manifest(self) -> dict[str, Any]:
        raise NotImplementedError

    def blob(self, digest: str) -> IO[bytes]:
        raise NotImplementedError

    def select(self, index: dict[str, Any]) -> dict[str, Any]:
        for m in index.get("manifests", []):
            plat = m.get("platform", {})
            if plat.get("os", "linux") == "linux" and plat.get("architecture", "amd64") == "amd64":
                return self.manifest_by_digest(m["digest"])
        raise ImportFailed("the image index has no linux/amd64 manifest", field="source")

    def manifest_by_digest(self, digest: str) -> dict[str, Any]:
        with self.blob(digest) as f:
            data = f.read()
        _check_digest(data, digest)
        return json.loads(data)  # type: ignore[no-any-return]

    def image_manifest(self) -> dict[str, Any]:
        m = self.manifest()
        if m.get("mediaType") in INDEX_TYPES or "manifests" in m:
            m = self.select(m)
        if "layers" not in m:
            raise ImportFailed("not an image manifest (no layers)", field="source")
        return m


class LayoutSource(Source):
    """An OCI image layout directory (index.json + blobs/sha256/...)."""

    def __init__(self, path: str, tag: str | None) -> None:
        self.path, self.tag = path, tag
        if not os.path.isfile(os.path.join(path, "index.json")):
            raise ImportFailed(f"{path} is not an OCI layout (no index.json)", field="source")

    def manifest(self) -> dict[str, Any]:
        with open(os.path.join(self.path, "index.json")) as f:
            index = json.load(f)
        entries = index.get("manifests", [])
        if self.tag:
            entries = [m for m in entries
                       if m.get("annotations", {}).get("org.opencontainers.image.ref.name") == self.tag]
        if not entries:
            raise ImportFailed(f"no manifest tagged {self.tag!r} in {self.path}", field="source")
        desc = entries[0]
        m = self.manifest_by_digest(desc["digest"])
        return m

    def blob(self, digest: str) -> IO[bytes]:
        algo, _, hexd = digest.partition(":")
        try:
            return open(os.path.join(self.path, "blobs", algo, hexd), "rb")
        except FileNotFoundError:
            raise ImportFailed(f"blob {digest} missing from {self.path}", field="source") from None


class DockerArchiveSource(Source):
    """A ``docker save`` tar: manifest.json naming config and layer tar paths."""

    def __init__(self, path: str) -> None:
        try:
            self.tar = tarfile.open(path)
            with self._member("manifest.json") as f:
                self.entries = json.load(f)
        except (OSError, tarfile.TarError, ValueError) as e:
            raise ImportFailed(f"{path} is not a docker-archive tar: {e}", field="source") from None

    def _member(self, name: str) -> IO[bytes]:
        f = self.tar.extractfile(name)
        if f is None:
            raise ImportFailed(f"docker archive lacks {name}", field="source")
        return f

    def manifest(self) -> dict[str, Any]:
        entry = self.entries[0]
        return {"layers": [{"digest": f"path:{p}", "mediaType": "application/vnd.docker.image.rootfs.diff.tar",
                            "size": self.tar.getmember(p).size} for p in entry["Layers"]]}

    def blob(self, digest: str) -> IO[bytes]:
        return self._member(digest.removeprefix("path:"))


class RegistrySource(Source):
    """The distribution (registry) HTTP API v2, with anonymous bearer-token auth."""

    def __init__(self, ref: str, timeout: float = 60.0) -> None:
        scheme = "https"
        if "://" in ref:
            scheme, ref = ref.split("://", 1)
        host, _, rest = ref.partition("/")
        if not rest:
            raise ImportFailed(f"registry reference {ref!r} needs host/name[:tag|@digest]", field="source")
        if "@" in rest:
            self.name, self.reference = rest.split("@", 1)
        else:
            name, _, tag = rest.rpartition(":") if ":" in rest.rsplit("/", 1)[-1] else (rest, "", "latest")
            self.name, self.reference = name, tag
        self.base = f"{scheme}://{host}/v2/{self.name}"
        self.timeout = timeout
        self.token: str | None = None

    def _open(self, url: str, accept: str | None = None) -> IO[bytes]:
        for _ in range(2):
            req = urllib.request.Request(url)
            if accept:
                req.add_header("Accept", accept)
            if self.token:
                req.add_header("Authorization", f"Bearer {self.token}")
            try:
                return urllib.request.urlopen(req, timeout=self.timeout)  # type: ignore[no-any-return]
            except urllib.error.HTTPError as e:
                if e.code == 401 and self.token is None and "bearer" in e.headers.get("WWW-Authenticate", "").lower():
                    self.token = self._fetch_token(e.headers["WWW-Authenticate"])
                    continue
                if e.code == 404:
                    raise NotFound(f"registry has no {url.rsplit('/v2/', 1)[-1]}", field="source") from None
                raise ImportFailed(f"registry answered {e.code} for {url}", field="source") from None
            except (urllib.error.URLError, OSError) as e:
                why = getattr(e, "reason", e)
                raise ImportFailed(f"registry unreachable at {url}: {why}", field="source") from None
        raise ImportFailed(f"registry refused credentials for {url}", field="source")

    def _fetch_token(self, challenge: str) -> str:
        params = dict(re.findall(r'(\w+)="([^"]*)"', challenge))
        realm = params.pop("realm", "")
        with self._open_plain(f"{realm}?{urllib.parse.urlencode(params)}") as f:
            body = json.load(f)
        return str(body.get("token") or body.get("access_token") or "")

    def _open_plain(self, url: str) -> IO[bytes]:
        try:
            return urllib.request.urlopen(url, timeout=self.timeout)  # type: ignore[no-any-return]
        except (urllib.error.URLError, OSError) as e:
            raise ImportFailed(f"token service unreachable: {e}", field="source") from None

    def manifest(self) -> dict[str, Any]:
        with self._open(f"{self.base}/manifests/{self.reference}", ACCEPT) as f:
            data = f.read()
        if self.reference.startswith("sha256:"):
            _check_digest(data, self.reference)
        return json.loads(data)  # type: ignore[no-any-return]

    def manifest_by_digest(self, digest: str) -> dict[str, Any]:
        with self._open(f"{self.base}/manifests/{digest}", ACCEPT) as f:
            data = f.read()
        _check_digest(data, digest)
        return json.loads(data)  # type: ignore[no-any-return]

    def blob(self, digest: str) -> IO[bytes]:
        return self._open(f"{self.base}/blobs/{digest}")


def open_source(source: str) -> Source:
    """``oci:DIR[:tag]``, ``docker-archive:FILE``, a directory or a tar file path, or a
    registry reference ``[http://]host[:port]/name[:tag|@digest]``."""
    if source.startswith("oci:"):
        path, _, tag = source[4:].partition(":") if not os.path.isdir(source[4:]) else (source[4:], "", "")
        return LayoutSource(path, tag or None)
    if source.startswith("docker-archive:"):
        return DockerArchiveSource(source.split(":", 1)[1])
    if os.path.isdir(source):
        return LayoutSource(source, None)
    if os.path.isfile(source):
        return DockerArchiveSource(source)
    return RegistrySource(source)


def _check_digest(data: bytes, digest: str) -> None:
    if digest.startswith("sha256:") and hashlib.sha256(data).hexdigest() != digest[7:]:
        raise ImportFailed(f"content does not match its digest {digest}", field="source")


class _Verified(io.RawIOBase):
    """Reads a blob while hashing it; at EOF the digest must match."""

    def __init__(self, raw: IO[bytes], digest: str) -> None:
        self.raw, self.digest, self.h = raw, digest, hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        data = self.raw.read(len(b))
        if not data:
            if self.digest.startswith("sha256:") and self.h.hexdigest() != self.digest[7:]:
                raise ImportFailed(f"blob {self.digest} is truncated or corrupt (digest mismatch)", field="source")
            return 0
        self.h.update(data)
        b[:len(data)] = data
        return len(data)


def _decompressed(raw: IO[bytes], media_type: str) -> IO[bytes]:
    if "zstd" in media_type:
        import zstandard

        return zstandard.ZstdDecompressor().stream_reader(raw)  # type: ignore[no-any-return]
    if "gzip" in media_type or media_type.endswith(".tar.gzip"):
        return gzip.GzipFile(fileobj=raw)  # type: ignore[return-value]
    return raw


def _safe(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo:
    """Refuse paths and links that leave the staging tree; keep modes and owners as the
    image has them (setuid bits included: they belong to the image)."""
    checked = tarfile.tar_filter(member, dest)
    return checked.replace(mode=member.mode, uid=member.uid, gid=member.gid, deep=False)


def apply_layer(stream: IO[bytes], dest: str) -> None:
    """Apply one OCI layer tar onto ``dest``, OCI whiteouts becoming overlay ones."""
    with tarfile.open(fileobj=stream, mode="r|") as tar:
        for member in tar:
            name = os.path.normpath(member.name.lstrip("/"))
            if name.startswith(".."):
                raise ImportFailed(f"layer entry {member.name!r} leaves the image root", field="source")
            parent, base = os.path.split(name)
            if base == ".wh..wh..opq":
                d = os.path.join(dest, parent)
                if os.path.isdir(d):
                    for entry in os.listdir(d):
                        _remove(os.path.join(d, entry))
                else:
                    os.makedirs(d, exist_ok=True)
                os.setxattr(d, "trusted.overlay.opaque", b"y")
                continue
            if base.startswith(".wh."):
                target = os.path.join(dest, parent, base[4:])
                _remove(target)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                os.mknod(target, stat.S_IFCHR | 0o000, os.makedev(0, 0))
                continue
            target = os.path.join(dest, name)
            if os.path.lexists(target) and not (member.isdir() and os.path.isdir(target)):
                _remove(target)
            member.name = name
            tar.extract(member, dest, set_attrs=True, numeric_owner=True, filter=_safe)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def groups(layers: list[LayerBlob], threshold: int) -> Iterator[list[LayerBlob]]:
    """Consecutive runs of small layers, each large layer on its own."""
    run: list[LayerBlob] = []
    for blob in layers:
        if blob.size >= threshold:
            if run:
                yield run
                run = []
            yield [blob]
        else:
            run.append(blob)
    if run:
        yield run


def import_oci(store: LayerStore, source: str, ref: str, collapse_bytes: int = COLLAPSE_BYTES,
               progress: Progress | None = None, work_dir: str | None = None) -> Layer:
    """Fetch ``source`` and publish it as ``ref`` (one catalog entry, one or more EROFS
    blobs bottom to top). Nothing is published unless every step succeeds."""
    src = open_source(source)
    manifest = src.image_manifest()
    blobs = [LayerBlob(d["digest"], d.get("mediaType", ""), int(d.get("size", 0))) for d in manifest["layers"]]
    if not blobs:
        raise ImportFailed("the image has no layers", field="source")
    total = sum(b.size for b in blobs)
    done = 0
    erofs: list[str] = []
    with tempfile.TemporaryDirectory(prefix="dsec-oci-", dir=work_dir) as tmp:
        for i, group in enumerate(groups(blobs, collapse_bytes)):
            key = "oci-group:" + ",".join(b.digest for b in group)
            if cached := store.built_blob(key):  # these very layers were converted before
                erofs.append(cached)
                done += sum(b.size for b in group)
                continue
            stage = os.path.join(tmp, f"g{i}")
            os.makedirs(stage)
            for blob in group:
                with src.blob(blob.digest) as raw:
                    verified = io.BufferedReader(_Verified(raw, blob.digest), 1 << 20)
                    try:
                        apply_layer(_decompressed(verified, blob.media_type), stage)  # type: ignore[arg-type]
                    except (tarfile.TarError, EOFError, OSError, ValueError) as e:
                        raise ImportFailed(f"layer {blob.digest} is not a valid layer tar: {e}",
                                           field="source") from None
                    verified.read()  # drain padding so the digest covers the whole blob
                done += blob.size
                if progress:
                    progress("layers", done, total)
            erofs.append(store.build_blob(stage, ImportOptions(content_key=key)))
            shutil.rmtree(stage)
    return store.publish_blobs(ref, erofs, source=f"oci {source}")
