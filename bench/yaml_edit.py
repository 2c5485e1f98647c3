"""Write ``replicas.max_concurrency`` back into a deployment YAML, keeping everything else.

ruamel.yaml (round-trip mode) parses the file and says where things sit; the edit is then made on
the text, so comments, blank lines, quoting and indentation stay byte for byte:

- the key exists: only its value's characters are replaced;
- ``replicas:`` is a block mapping without the key: one line is inserted right under
  ``replicas:``, indented like the block's other keys;
- there is no ``replicas:`` (or it is empty): a ``replicas:`` block is added (or filled).

Only a flow-style mapping (``replicas: {...}`` or a ``{...}`` document) goes through a ruamel
round-trip dump, which keeps comments but may re-flow other lines. The new text is parsed again
and must hold the value before the file is replaced (atomically, keeping its mode).
"""

from __future__ import annotations

import io
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap
from ruamel.yaml.error import YAMLError

KEY = "max_concurrency"
_SCALAR = re.compile(r"[^\s#,}\]]+")


class YamlEditError(ValueError):
    """The file cannot be edited safely; the message is for a person."""


def _load(text: str, path: Path) -> Any:
    try:
        return YAML(typ="rt").load(text)
    except YAMLError as exc:
        raise YamlEditError(f"{path}: not valid YAML: {exc}") from exc


def _block_indent(data: CommentedMap) -> int:
    """The indentation the file uses for nested keys (2 when it shows none)."""
    for value in data.values():
        if isinstance(value, CommentedMap) and value and not value.fa.flow_style():
            return int(value.lc.key(next(iter(value)))[1])
    return 2


def _replace_value(text: str, replicas: CommentedMap, value: int, path: Path) -> tuple[str, str]:
    line, col = replicas.lc.value(KEY)
    lines = text.splitlines(keepends=True)
    match = _SCALAR.match(lines[line], col)
    if match is None:
        raise YamlEditError(f"{path}:{line + 1}: cannot find the value of replicas.{KEY}")
    lines[line] = lines[line][: match.start()] + str(value) + lines[line][match.end() :]
    return "".join(lines), match.group(0)


def _insert_lines(text: str, after_line: int | None, new: list[str]) -> str:
    """``new`` lines after line ``after_line`` (0-based), or at the end when it is None."""
    lines = text.splitlines(keepends=True)
    newline = "\r\n" if lines and lines[0].endswith("\r\n") else "\n"
    if lines and not lines[-1].endswith(("\n", "\r")):
        lines[-1] += newline
    at = len(lines) if after_line is None else after_line + 1
    return "".join(lines[:at] + [s + newline for s in new] + lines[at:])


def _round_trip(data: CommentedMap, value: int) -> str:
    replicas = data.get("replicas")
    if not isinstance(replicas, CommentedMap):
        data["replicas"] = replicas = CommentedMap()
    replicas[KEY] = value
    out = io.StringIO()
    yaml = YAML(typ="rt")
    yaml.indent(mapping=2, sequence=4, offset=2)
    yaml.dump(data, out)
    return out.getvalue()


def _edit(text: str, value: int, path: Path) -> tuple[str, str]:
    """The new text and the old value ("" when the key was missing)."""
    data = _load(text, path)
    if data is None:
        return _insert_lines(text, None, ["replicas:", f"  {KEY}: {value}"]), ""
    if not isinstance(data, CommentedMap):
        raise YamlEditError(f"{path}: the top level is not a mapping")
    replicas = data.get("replicas")
    if replicas is not None and not isinstance(replicas, CommentedMap):
        raise YamlEditError(f"{path}: replicas is not a mapping")
    if isinstance(replicas, CommentedMap) and KEY in replicas:
        return _replace_value(text, replicas, value, path)
    if data.fa.flow_style() or (isinstance(replicas, CommentedMap) and replicas.fa.flow_style()):
        return _round_trip(data, value), ""
    indent = " " * _block_indent(data)
    if "replicas" not in data:
        return _insert_lines(text, None, ["replicas:", f"{indent}{KEY}: {value}"]), ""
    key_line, key_col = data.lc.key("replicas")
    if replicas:  # a block mapping: indent like its first key
        indent = " " * replicas.lc.key(next(iter(replicas)))[1]
    else:  # "replicas:" with nothing under it
        indent = " " * (key_col + len(indent))
    return _insert_lines(text, key_line, [f"{indent}{KEY}: {value}"]), ""


def _write_atomically(path: Path, text: str) -> None:
    target = path.resolve()
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", newline="") as f:
            f.write(text)
        shutil.copymode(target, tmp)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def set_max_concurrency(path: Path, value: int) -> str:
    """Set ``replicas.max_concurrency`` to ``value`` in ``path``; returns the old value text."""
    if value < 1:
        raise YamlEditError(f"max_concurrency must be >= 1, got {value}")
    with path.open(newline="") as f:  # keep \r\n as it is
        text = f.read()
    new, old = _edit(text, value, path)
    try:
        check = _load(new, path)
    except YamlEditError:
        check = None
    replicas = check.get("replicas") if isinstance(check, dict) else None
    written = replicas.get(KEY) if isinstance(replicas, dict) else None
    if written != value or isinstance(written, bool):
        raise YamlEditError(f"{path}: could not place replicas.{KEY} safely; set it by hand")
    _write_atomically(path, new)
    return old
