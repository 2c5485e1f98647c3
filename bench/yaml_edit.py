"""Write ``replicas.max_concurrency`` back into a deployment YAML, keeping everything else.

ruamel.yaml (round-trip mode) parses the file and says where the value sits; when the key exists
only that scalar's characters are replaced, so comments, blank lines, quoting and indentation stay
byte for byte. When the key (or ``replicas:``) is missing it is added through a ruamel round-trip
dump, which also keeps comments.
"""

from __future__ import annotations

import io
import re
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


def set_max_concurrency(path: Path, value: int) -> str:
    """Set ``replicas.max_concurrency`` to ``value`` in ``path``; returns the old value."""
    if value < 1:
        raise YamlEditError(f"max_concurrency must be >= 1, got {value}")
    text = path.read_text()
    data = _load(text, path)
    if data is None:
        data = CommentedMap()
    if not isinstance(data, CommentedMap):
        raise YamlEditError(f"{path}: the top level is not a mapping")
    replicas = data.get("replicas")
    if isinstance(replicas, CommentedMap) and KEY in replicas:
        line, col = replicas.lc.value(KEY)
        lines = text.splitlines(keepends=True)
        match = _SCALAR.match(lines[line], col)
        if match is None:
            raise YamlEditError(f"{path}:{line + 1}: cannot find the value of replicas.{KEY}")
        old = match.group(0)
        lines[line] = lines[line][: match.start()] + str(value) + lines[line][match.end() :]
        path.write_text("".join(lines))
        return old
    if replicas is None:
        data["replicas"] = CommentedMap()
        replicas = data["replicas"]
    if not isinstance(replicas, CommentedMap):
        raise YamlEditError(f"{path}: replicas is not a mapping")
    replicas[KEY] = value
    out = io.StringIO()
    yaml = YAML(typ="rt")
    yaml.indent(mapping=2, sequence=4, offset=2)
    yaml.dump(data, out)
    path.write_text(out.getvalue())
    return ""
