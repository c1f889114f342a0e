"""SWE-ReX's ``upload``: one file, or a directory the client zipped, into a sandbox.

The archive is unpacked here, in the apiserver, and each entry written through the
edge's file operations: a sandbox image need not have unzip (or Python), and
unpacking in the apiserver lets every entry be checked before anything is written
(names that climb out of ``target_path``, entry counts and sizes past the limits).
Sizes come from the archive's own headers, which bound what zipfile will inflate, so
a zip bomb costs what it declares, and that is checked first."""

from __future__ import annotations

import asyncio
import posixpath
import stat as statmod
import zipfile
from typing import IO

from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import Request

from dsec.node.edge.api import EdgeAPI
from dsec.shared.errors import InvalidRequest, NotFound, PayloadTooLarge

MAX_ENTRIES = 20_000
MAX_UNZIPPED_BYTES = 1 << 30
WRITES_IN_FLIGHT = 8
TRUE, FALSE = {"true", "1", "yes", "on"}, {"false", "0", "no", "off", ""}


async def upload(edge: EdgeAPI, sid: str, request: Request, max_file_bytes: int) -> None:
    try:
        form = await request.form(max_files=1, max_fields=8)
    except HTTPException as e:  # malformed multipart, too many parts
        raise InvalidRequest(f"file: {e.detail}", field="file") from None
    try:
        file, target, unzip = form.get("file"), form.get("target_path"), form.get("unzip", "false")
        if not isinstance(file, UploadFile):
            raise InvalidRequest("file: a multipart file part named 'file' is required", field="file")
        if not isinstance(target, str) or not target:
            raise InvalidRequest("target_path: required", field="target_path")
        if "\0" in target:
            raise InvalidRequest("target_path: must not contain NUL characters", field="target_path")
        target = posixpath.join("/", target)  # relative: from /, as the face's file calls take it
        if not isinstance(unzip, str) or unzip.lower() not in TRUE | FALSE:
            raise InvalidRequest("unzip: must be true or false", field="unzip")
        if unzip.lower() in TRUE:
            await _unzip(edge, sid, file.file, target, max_file_bytes)
        else:
            data = await file.read()
            if len(data) > max_file_bytes:
                raise PayloadTooLarge(f"file: over the {max_file_bytes}-byte file limit", field="file")
            await edge.write_file(sid, await _into_dir(edge, sid, target, file.filename), data)
    finally:
        await form.close()


async def _into_dir(edge: EdgeAPI, sid: str, target: str, filename: str | None) -> str:
    """As a move would: onto an existing directory means into it, under the file's name."""
    try:
        st = await edge.stat(sid, target)
    except NotFound:
        return target
    name = posixpath.basename(filename or "") or "upload"
    return posixpath.join(target, name) if st.type == "dir" and name not in (".", "..") else target


def _plan(zf: zipfile.ZipFile, target: str, max_file_bytes: int) -> tuple[list[str], list[tuple[zipfile.ZipInfo,
                                                                                                 str, int]]]:
    infos = zf.infolist()
    if len(infos) > MAX_ENTRIES:
        raise PayloadTooLarge(f"file: the archive has {len(infos)} entries, over the limit of {MAX_ENTRIES}",
                              field="file")
    if sum(i.file_size for i in infos) > MAX_UNZIPPED_BYTES:
        raise PayloadTooLarge(f"file: the archive unpacks to over {MAX_UNZIPPED_BYTES} bytes", field="file")
    dirs, files = [target], []
    for info in infos:
        parts = [p for p in info.filename.replace("\\", "/").split("/") if p not in ("", ".")]
        if info.filename.startswith("/") or ".." in parts or any("\0" in p for p in parts):
            raise InvalidRequest(f"file: archive entry {info.filename!r} would land outside target_path",
                                 field="file")
        if not parts:
            continue
        dest = posixpath.join(target, *parts)
        if info.is_dir():
            dirs.append(dest)
            continue
        if info.file_size > max_file_bytes:
            raise PayloadTooLarge(f"file: archive entry {info.filename!r} is over the {max_file_bytes}-byte "
                                  "file limit", field="file")
        attr = info.external_attr >> 16
        # keep the executable bits a tool bundle relies on; anything but a plain file
        # (a symlink stored as its target's path) lands as an ordinary file
        mode = attr & 0o777 if statmod.S_ISREG(attr) and attr & 0o777 else 0o644
        files.append((info, dest, mode | 0o200))
    return dirs, files


async def _unzip(edge: EdgeAPI, sid: str, raw: IO[bytes], target: str, max_file_bytes: int) -> None:
    try:
        zf = zipfile.ZipFile(raw)
    except (zipfile.BadZipFile, OSError) as e:
        raise InvalidRequest(f"file: not a zip archive ({e})", field="file") from None
    with zf:
        dirs, files = _plan(zf, target, max_file_bytes)
        for d in dirs:
            await edge.make_dir(sid, d)
        gate = asyncio.Semaphore(WRITES_IN_FLIGHT)
        pending: set[asyncio.Task[None]] = set()

        async def write(dest: str, data: bytes, mode: int) -> None:
            try:
                await edge.write_file(sid, dest, data, mode)
            finally:
                gate.release()

        try:
            for info, dest, mode in files:
                await gate.acquire()
                try:  # one reader at a time: a ZipFile is not safe to read from two threads
                    data = await asyncio.to_thread(zf.read, info)
                except (zipfile.BadZipFile, OSError, EOFError) as e:
                    gate.release()
                    raise InvalidRequest(f"file: archive entry {info.filename!r} is corrupt ({e})",
                                         field="file") from None
                pending.add(asyncio.create_task(write(dest, data, mode)))
                for t in [t for t in pending if t.done()]:
                    pending.discard(t)
                    t.result()  # the first failed write ends the upload
            await asyncio.gather(*pending)
            pending.clear()
        finally:
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
