"""A dataclass's fields checked against its type hints: what makes a message decoded from
untrusted bytes (common/protocol.py) one of its declared types, field by field. The checks are
made once per class, since decoding runs for every message (32 KV chunks to a 64 MB transfer)
and reading type hints is slow."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass

from common.errors import short_repr as _short


def holds(check: Callable[[object], bool], value) -> bool:
    return check(value)


@dataclass(frozen=True)
class Field:
    name: str
    required: bool
    hint: object
    check: Callable[[object], bool]


_SCHEMAS: dict[type, tuple[frozenset, tuple[Field, ...]]] = {}


def schema(cls) -> tuple[frozenset, tuple[Field, ...]]:
    """A dataclass's field names and fields, each with its type check, made once."""
    made = _SCHEMAS.get(cls)
    if made is None:
        hints = typing.get_type_hints(cls)
        fields = tuple(Field(f.name, f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
                             hints[f.name], _checker(hints[f.name])) for f in dataclasses.fields(cls))
        made = _SCHEMAS[cls] = (frozenset(f.name for f in fields), fields)
    return made


def build(cls, body: dict, error: type[Exception]):
    """cls(**body), or error naming the field that is unknown, missing or of the wrong type."""
    names, fields = schema(cls)
    if not names.issuperset(body):
        unknown = set(body) - names
        raise error(f"{cls.__name__}: unknown fields {sorted(map(str, unknown))}; allowed: {sorted(names)}")
    for f in fields:
        if f.name not in body:
            if f.required:
                raise error(f"{cls.__name__}: missing field {f.name!r}")
        elif not f.check(body[f.name]):
            raise error(f"{cls.__name__}.{f.name}={_short(body[f.name])} has the wrong type; "
                        f"allowed: {_type_name(f.hint)}")
    return cls(**body)


_INT = {int}


def _checker(hint) -> Callable[[object], bool]:
    """A test of whether a decoded value is of this type (msgpack gives exact ints, lists and dicts)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if len(args) == 2 and type(None) in args:  # X | None, most of them: no generator per value
            check = _checker(next(h for h in args if h is not type(None)))
            return lambda v: v is None or check(v)
        checks = [_checker(h) for h in args]
        return lambda v: any(c(v) for c in checks)
    if hint is type(None):
        return lambda v: v is None
    if origin is list:
        (item,) = typing.get_args(hint) or (typing.Any,)
        if item is int:  # token ids: the long lists, checked in C (a generator costs 1.7x)
            return lambda v: isinstance(v, list) and set(map(type, v)) <= _INT
        check = _checker(item)
        return lambda v: isinstance(v, list) and all(check(x) for x in v)
    if origin is dict or hint is dict:
        return lambda v: isinstance(v, dict)
    if hint is typing.Any:
        return lambda v: True
    if hint is int:
        return lambda v: type(v) is int  # msgpack's ints are exact; a bool is not one
    if hint is float:
        return lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    return lambda v: isinstance(v, hint)


def _type_name(hint) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")
