"""One line per configuration mistake: where the value came from, what is wrong, and the fix.

A run's config is merged from a YAML file, the files of its ``base:`` chain and ``--set``
overrides. :class:`Sources` remembers which of them gave each key, so an error names the
place the user has to edit (``--set training.epoch=3``, or ``configs/digits/base.yaml (the
base: of configs/digits/redsync.yaml)``), and an unknown key is answered with the valid keys
of its section and the closest one (``difflib``).
"""
from __future__ import annotations

import difflib
import os
from typing import Iterable

from pydantic import BaseModel, ValidationError

DEFAULTS = "the defaults"


def shown(path) -> str:
    """``path`` as the user would type it: relative to the working directory when inside it."""
    text = str(path)
    try:
        rel = os.path.relpath(text)
    except ValueError:   # another drive (Windows)
        return text
    return text if rel.startswith("..") else rel


class Sources:
    """Where each key of a merged config came from (a dotted path -> a label)."""

    def __init__(self):
        self._by_path: dict = {}

    def record(self, tree, origin: str, prefix: tuple = ()) -> None:
        """Every key of ``tree`` (nested mappings too) came from ``origin``."""
        if not isinstance(tree, dict):
            return
        for key, value in tree.items():
            path = prefix + (str(key),)
            self._by_path[path] = origin
            self.record(value, origin, path)

    def set(self, path: Iterable, value, origin: str) -> None:
        """One ``--set`` override: its key, and anything under it when the value is a mapping."""
        path = tuple(str(p) for p in path)
        self._by_path[path] = origin
        self.record(value, origin, path)

    def origin(self, path: Iterable) -> str:
        """The label of the longest recorded prefix of ``path``, and of the keys under it that came
        from elsewhere (a section's own check is about all of them), joined by "and"."""
        path = tuple(str(p) for p in path)
        found = [DEFAULTS]
        for end in range(len(path), 0, -1):
            if path[:end] in self._by_path:
                found = [self._by_path[path[:end]]]
                break
        found += [o for p, o in self._by_path.items() if len(p) > len(path) and p[:len(path)] == path]
        found = [o for o in dict.fromkeys(found) if o != DEFAULTS] or [DEFAULTS]
        return " and ".join(found)


def closest(key: str, valid: Iterable[str]) -> str | None:
    matches = difflib.get_close_matches(str(key), [str(v) for v in valid], n=1, cutoff=0.6)
    return matches[0] if matches else None


def dotted(parts: Iterable) -> str:
    """("compression", "policy", "layers", 0, "x") -> "compression.policy.layers[0].x"."""
    out = ""
    for part in parts:
        part = str(part)
        out += f"[{part}]" if part.isdigit() else f".{part}" if out else part
    return out


def unknown_key(where: str, key: str, valid: Iterable[str], what: str = "key", owner: str | None = None) -> str:
    """``<where>.<key>: unknown key; did you mean <where>.<close>? Valid keys of <where>: a, b, c``
    (``owner`` names the section in the last part instead of ``where``)."""
    valid = sorted(str(v) for v in valid)
    prefix = f"{where}." if where else ""
    guess = closest(key, valid)
    hint = f"; did you mean {prefix}{guess}?" if guess else "."
    return (f"{prefix}{key}: unknown {what}{hint} Valid {what}s of {owner or where or 'the config'}: "
            f"{', '.join(valid) or 'none'}")


def plain(message: str) -> str:
    """A validator's message without pydantic's "Value error, " in front."""
    return message.removeprefix("Value error, ")


def section_fields(model: type, loc: tuple) -> list | None:
    """The field names of the (nested) section at ``loc`` of ``model``, or None if it is no section."""
    for part in loc:
        if isinstance(part, int) or str(part).isdigit():
            continue
        field = model.model_fields.get(str(part)) if _is_model(model) else None
        if field is None:
            return None
        model = _model_of(field.annotation)
    return sorted(model.model_fields) if _is_model(model) else None


def _is_model(cls) -> bool:
    return isinstance(cls, type) and issubclass(cls, BaseModel)


def _model_of(annotation):
    """The model inside an annotation such as ``Optional[X]`` or ``list[X]``, else the annotation."""
    if _is_model(annotation):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_of(arg)
        if _is_model(found):
            return found
    return annotation


def describe(exc: ValidationError, model: type, sources: Sources | None, source: str) -> str:
    """One line for every error of ``exc`` (``model``'s validation), each under the place its
    value came from: ``invalid configuration in <place>: <key>: <problem>[; <key>: ...]``."""
    by_origin: dict = {}
    for err, loc in relevant(exc.errors()):
        text, paths = _one(err, loc, model)
        origin = sources.origin(paths[0]) if sources is not None and paths else source
        if origin == DEFAULTS:
            origin = source
        by_origin.setdefault(origin, []).append(text)
    return "; ".join(f"invalid configuration in {origin}: {'; '.join(texts)}" for origin, texts in by_origin.items())


def relevant(errors: list) -> list:
    """(error, its location) with unknown keys first, and without "X is required" where an unknown
    key beside it is a misspelt X (the unknown key's message names X already)."""
    located = [(e, tuple(p for p in e["loc"] if not str(p).startswith("function-"))) for e in errors]
    missing = [loc for e, loc in located if e["type"] == "missing"]
    misspelt = set()
    for e, loc in located:
        if e["type"] == "extra_forbidden":
            guess = closest(str(loc[-1]), [str(m[-1]) for m in missing if m[:-1] == loc[:-1]])
            if guess:
                misspelt.add(loc[:-1] + (guess,))
    kept = [(e, loc) for e, loc in located if not (e["type"] == "missing" and loc in misspelt)]
    return sorted(kept, key=lambda item: item[0]["type"] != "extra_forbidden")


def _one(err: dict, loc: tuple, model: type) -> tuple:
    """(the problem's text, the dotted paths it is about)."""
    name = dotted(loc)
    if err["type"] == "extra_forbidden":
        valid = section_fields(model, loc[:-1]) or []
        return unknown_key(dotted(loc[:-1]), str(loc[-1]), valid), [loc]
    if err["type"] == "value_error":   # a validator's own message (parse_compression's names its keys)
        cause = err.get("ctx", {}).get("error")
        paths = [tuple(p.split(".")) for p in getattr(cause, "paths", ())] or [loc]
        return plain(str(cause if cause is not None else err["msg"])), paths
    if err["type"] == "literal_error":
        choices = err["ctx"]["expected"].replace("'", "").replace(" or ", ", ")
        return f"{name}: {err.get('input')!r} is not one of: {choices}", [loc]
    if err["type"] == "missing":
        return f"{name}: required, and not given", [loc[:-1] or loc]
    return f"{name}: {plain(err['msg'])} (got {err.get('input')!r})", [loc]
