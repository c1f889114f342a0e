"""The edge contract as wire operations, read from the :mod:`dsec.node.edge.api` Protocol.

Each method of the Protocol is one operation with a pydantic model of its arguments:

- a unary operation is ``POST /v1/call/{name}``: the arguments as JSON, except a
  ``bytes`` argument, which follows the other arguments' JSON line in the body (no header
  limit applies to them); the result is JSON, raw bytes, or nothing (204);
- a stream (a method returning ``AsyncIterator[T]``) is a WebSocket at
  ``/v1/stream/{name}``: the client sends the arguments, the server sends items; an
  ``AsyncIterator`` parameter (the TTY's input) makes the client send items too.

Unary operations without a raw body or result also travel multiplexed over one
WebSocket per caller (``/v1/calls``), which saves HTTP's per-request cost on the hot path
(exec): a request frame is ``<id> <name> <arguments JSON>``, a cancel ``<id> !``, and the
answer ``<id> +<result JSON>`` or ``<id> -<error JSON>``.

Stream frames are text: ``i`` + an item's JSON, ``.`` for the end, ``e`` + an error's JSON.
Errors carry their dsec type (``error`` code), message, field, sandbox and operation, so a
caller of a remote edge catches the same exceptions as one of the in-process edge.
"""

from __future__ import annotations

import collections.abc
import inspect
import typing
from dataclasses import dataclass
from functools import cache
from typing import Any

from pydantic import BaseModel, ConfigDict, TypeAdapter, create_model

from dsec.node.edge import api
from dsec.shared.errors import ERRORS_BY_CODE, DsecError

ITEM, END, ERROR = "i", ".", "e"
OK, FAILED, CANCEL = "+", "-", "!"


@dataclass(frozen=True)
class Op:
    name: str
    signature: inspect.Signature
    args: type[BaseModel]  # every argument but the raw body and the input stream
    body: str | None  # the bytes argument sent as the raw body (unary only)
    input: str | None  # the AsyncIterator argument (streams only)
    input_item: TypeAdapter[Any] | None
    result: TypeAdapter[Any] | None  # a unary result (None: returns nothing)
    raw_result: bool  # a unary result that is bytes
    item: TypeAdapter[Any] | None  # a stream's item

    @property
    def stream(self) -> bool:
        return self.item is not None

    @property
    def multiplexed(self) -> bool:
        """Small enough to share a connection: JSON in, JSON (or nothing) out."""
        return self.item is None and self.body is None and not self.raw_result

    def encode_result(self, result: Any) -> bytes:
        return b"" if self.result is None else self.result.dump_json(result)

    def decode_result(self, body: bytes | str) -> Any:
        return None if self.result is None else self.result.validate_json(body)

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """A call's arguments by name, defaults filled in."""
        bound = self.signature.bind(None, *args, **kwargs)
        bound.apply_defaults()
        out = dict(bound.arguments)
        out.pop("self")
        return out

    def encode_args(self, arguments: dict[str, Any]) -> bytes:
        skip = {self.body, self.input}
        return self.args(**{k: v for k, v in arguments.items() if k not in skip}).model_dump_json().encode()

    def decode_args(self, raw: bytes | str) -> dict[str, Any]:
        """Keyword arguments for the method (models stay models); pydantic's errors name the field."""
        m = self.args.model_validate_json(raw or b"{}")
        return {k: getattr(m, k) for k in type(m).model_fields}


def _async_iter_item(hint: Any) -> Any | None:
    if typing.get_origin(hint) in (collections.abc.AsyncIterator, collections.abc.AsyncGenerator):
        return typing.get_args(hint)[0]
    return None


def _op(name: str, fn: Any) -> Op:
    hints = typing.get_type_hints(fn)
    sig = inspect.signature(fn)
    ret = hints.get("return", type(None))
    item = _async_iter_item(ret)
    fields: dict[str, Any] = {}
    body = input_ = None
    input_item = None
    for p in list(sig.parameters.values())[1:]:
        hint = hints[p.name]
        if (it := _async_iter_item(hint)) is not None:
            input_, input_item = p.name, TypeAdapter(it)
            continue
        if hint is bytes and item is None:
            body = p.name
            continue
        fields[p.name] = (hint, ... if p.default is inspect.Parameter.empty else p.default)
    model = create_model(f"{name}_args", __config__=ConfigDict(ser_json_bytes="base64", val_json_bytes="base64",
                                                               extra="forbid"), **fields)
    unary_result = None if item is not None or ret is type(None) or ret is bytes else TypeAdapter(ret)
    return Op(name=name, signature=sig, args=model, body=body, input=input_, input_item=input_item,
              result=unary_result, raw_result=item is None and ret is bytes,
              item=TypeAdapter(item) if item is not None else None)


@cache
def ops() -> dict[str, Op]:
    """Every operation of the contract, by name."""
    out: dict[str, Op] = {}
    for group in api.GROUPS:
        for name, fn in vars(group).items():
            if not name.startswith("_") and inspect.isfunction(fn):
                out[name] = _op(name, fn)
    return out


def error_json(e: DsecError) -> dict[str, Any]:
    return {"error": e.code, "message": e.message, "field": e.field, "sandbox_id": e.sandbox_id,
            "operation": e.operation}


def error_from(body: dict[str, Any], fallback: str) -> DsecError:
    cls = ERRORS_BY_CODE.get(str(body.get("error")), DsecError)
    return cls(str(body.get("message") or fallback), body.get("field"), sandbox_id=body.get("sandbox_id"),
               operation=body.get("operation"))
