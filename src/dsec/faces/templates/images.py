"""Where a build's ``FROM`` comes from: a dsec layer ref used as is, an image alias the
operator configured (``debian:12`` -> ``base/debian:12``), or an OCI image pulled once
from a configured registry through dsec's OCI import and kept as a base layer. Anything
else fails the build with a message that says what would have worked.

Configuration (read by the apiserver at start): ``$DSEC_IMAGE_ALIASES`` (``name=ref,...``,
added to the built-in aliases) and ``$DSEC_OCI_REGISTRIES`` (``[http://]host[:port],...``,
tried in order for an image that is neither a layer nor an alias)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
from dataclasses import dataclass, field

from dsec.faces.e2b.template import BASE_IMAGE, USER_LAYER
from dsec.node.layers.store import LayerStore
from dsec.shared.errors import DsecError, InvalidRequest, NotFound

# E2B's base images and the Debian 12 names all mean dsec's Debian 12 base with E2B's user
BUILTIN_ALIASES = {
    "debian:12": BASE_IMAGE, "debian:bookworm": BASE_IMAGE, "debian:12-slim": BASE_IMAGE,
    "debian:bookworm-slim": BASE_IMAGE, "e2bdev/base": BASE_IMAGE, "e2bdev/base:latest": BASE_IMAGE,
    "docker.io/library/debian:12": BASE_IMAGE, "docker.io/library/debian:bookworm": BASE_IMAGE,
}
_IMAGE_RE = re.compile(r"^[a-z0-9][a-z0-9._/:@-]{0,255}$")


class ImageUnavailable(InvalidRequest):
    pass


@dataclass(frozen=True)
class Base:
    """A resolved FROM: the stack to build on, and whether E2B's ``user`` is in it."""

    image: str
    layers: list[str] = field(default_factory=list)
    has_user: bool = False


def _parse_aliases(text: str) -> dict[str, str]:
    out = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, sep, ref = item.partition("=")
        if not sep or not name.strip() or not ref.strip():
            raise ValueError(f"$DSEC_IMAGE_ALIASES: {item!r} is not name=layer-ref")
        out[name.strip()] = ref.strip()
    return out


class Images:
    def __init__(self, store: LayerStore, aliases: dict[str, str] | None = None,
                 registries: list[str] | None = None) -> None:
        self.store = store
        self.aliases = {**BUILTIN_ALIASES, **(aliases or {})}
        self.registries = list(registries or [])
        self._pulls: dict[str, asyncio.Lock] = {}

    @classmethod
    def from_env(cls, store: LayerStore) -> Images:
        regs = [r.strip().rstrip("/") for r in os.environ.get("DSEC_OCI_REGISTRIES", "").split(",") if r.strip()]
        return cls(store, _parse_aliases(os.environ.get("DSEC_IMAGE_ALIASES", "")), regs)

    async def resolve(self, image: str) -> Base:
        if not _IMAGE_RE.match(image):
            raise ImageUnavailable(f"fromImage {image!r} is not an image name", field="fromImage")
        ref = self.aliases.get(image, image)
        if await asyncio.to_thread(self.store.has, ref):
            layer = await asyncio.to_thread(self.store.get, ref)
            if layer.parent_image:
                img, layers = layer.stack()
                return Base(img, layers, has_user=USER_LAYER in layers)
            if ref == BASE_IMAGE:  # E2B's images all have the unprivileged ``user``
                return Base(ref, [USER_LAYER], has_user=True)
            return Base(ref)
        if image in self.aliases:
            raise ImageUnavailable(f"fromImage {image!r} is an alias of layer {ref!r}, which this store does not "
                                   "have (run dsec setup, or import it)", field="fromImage")
        if not self.registries:
            raise ImageUnavailable(
                f"fromImage {image!r} is not a dsec layer, not an image alias ({', '.join(sorted(self.aliases))}), "
                "and no OCI registry is configured to pull it from ($DSEC_OCI_REGISTRIES)", field="fromImage")
        return Base(await self._pull(image))

    async def _pull(self, image: str) -> str:
        """The image from the first registry that has it, imported once as base/oci-<hash>."""
        from dsec.node.layers.oci import import_oci

        name = image.removeprefix("docker.io/")
        if "/" not in name.split(":")[0]:
            name = f"library/{name}"  # Docker Hub's convention, which registry mirrors follow
        if ":" not in name.rsplit("/", 1)[-1] and "@" not in name:
            name += ":latest"
        ref = f"base/oci-{hashlib.sha256(name.encode()).hexdigest()[:16]}:1"
        lock = self._pulls.setdefault(ref, asyncio.Lock())
        async with lock:
            if await asyncio.to_thread(self.store.has, ref):
                return ref
            errors = []
            for reg in self.registries:
                try:
                    await asyncio.to_thread(import_oci, self.store, f"{reg}/{name}", ref)
                    return ref
                except NotFound:
                    errors.append(f"{reg}: no {name}")
                except DsecError as e:
                    errors.append(f"{reg}: {e.message}")
            raise ImageUnavailable(f"fromImage {image!r} could not be pulled: {'; '.join(errors)}",
                                   field="fromImage")
