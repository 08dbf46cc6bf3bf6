"""YAML read strictly, and the files it comes from: the only module of mig_agent that imports
yaml. A key repeated in one mapping is refused (plain YAML keeps the last one), as is a document
nested deeper, or of more nodes, than any config needs; a file larger than one ConfigMap holds is
not read past that size. Errors are InvalidConfig naming the file, line and column."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from mig_agent.core.errors import InvalidConfig

# Bounds on what a file may make the agent do before any GPU is touched: a file larger than one
# ConfigMap can hold, YAML nested deeper than any config needs (the YAML composer recurses), more
# YAML nodes than the biggest real config by far (parsing is pure Python).
MAX_FILE_BYTES = 1 << 20  # what one ConfigMap holds
MAX_DEPTH = 32
MAX_NODES = 10_000  # the GPU Operator's default config has 1,123


class DuplicateKey(Exception):
    """A key repeated in one mapping: where (the keys and indices down to it) and on which lines."""

    def __init__(self, path: tuple[object, ...], key: str, first: int, again: int) -> None:
        super().__init__(key)
        self.path, self.key, self.first, self.again = path, key, first, again

    @property
    def lines(self) -> str:
        return (
            f"line {self.first}"
            if self.first == self.again
            else f"lines {self.first} and {self.again}"
        )


def _duplicate(source: str, dup: DuplicateKey) -> InvalidConfig:
    return InvalidConfig(
        f"{source}: key {dup.key!r} appears twice ({dup.lines})", file=source, line=dup.again
    )


class _TooBig(Exception):
    def __init__(self, message: str, mark: Any) -> None:
        super().__init__(message)
        self.mark = mark


class _StrictLoader(yaml.SafeLoader):
    """safe_load that refuses a key repeated in one mapping (plain YAML keeps the last one), and
    a document nested deeper than MAX_DEPTH or of more than MAX_NODES nodes. Aliases are
    references to one node, never copies: an alias "bomb" builds no more than its text says."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._nodes = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._nodes += 1
        mark = self.peek_event().start_mark  # type: ignore[no-untyped-call]
        if self._nodes > MAX_NODES:
            raise _TooBig(
                f"more than {MAX_NODES} YAML nodes; no profile config needs as many", mark
            )
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _TooBig(f"nested deeper than {MAX_DEPTH} levels", mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def fetch_flow_sequence_start(self) -> None:
        self._flow_level_check()
        super().fetch_flow_sequence_start()

    def fetch_flow_mapping_start(self) -> None:
        self._flow_level_check()
        super().fetch_flow_mapping_start()

    def _flow_level_check(self) -> None:
        # before the composer sees them: the scanner's own work grows with the square of the
        # number of open brackets
        if self.flow_level >= MAX_DEPTH:
            raise _TooBig(f"nested deeper than {MAX_DEPTH} levels", self.get_mark())

    def construct_document(self, node: yaml.Node) -> Any:
        _refuse_duplicate_keys(node, (), set())
        return super().construct_document(node)


def _refuse_duplicate_keys(node: yaml.Node, path: tuple[object, ...], seen: set[int]) -> None:
    if id(node) in seen:  # an alias: already checked, and may be recursive
        return
    seen.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _refuse_duplicate_keys(item, (*path, i), seen)
    elif isinstance(node, yaml.MappingNode):
        lines: dict[tuple[str, str], int] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                continue
            key = str(key_node.value)
            if key_node.tag != "tag:yaml.org,2002:merge":  # '<<' may override on purpose
                line = key_node.start_mark.line + 1
                if (key_node.tag, key) in lines:
                    raise DuplicateKey(path, key, lines[(key_node.tag, key)], line)
                lines[(key_node.tag, key)] = line
            _refuse_duplicate_keys(value_node, (*path, key), seen)


def parse(
    text: str,
    source: str,
    *,
    on_duplicate: Callable[[str, DuplicateKey], InvalidConfig] = _duplicate,
) -> object:
    """The plain data of one YAML document; ``on_duplicate`` words the error of a repeated
    key for the kind of file (the profile configs name the layout and entry)."""
    if len(text) > MAX_FILE_BYTES:
        raise too_large(source, len(text))
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # a SafeLoader: plain data only
    except DuplicateKey as dup:
        raise on_duplicate(source, dup) from None
    except _TooBig as big:
        line, column = big.mark.line + 1, big.mark.column + 1
        raise InvalidConfig(
            f"{source}:{line}:{column}: {big}", file=source, line=line, column=column
        ) from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        what = e.problem or "syntax error"
        if e.context:  # e.g. "while parsing a flow mapping", where that began
            began = f" at line {e.context_mark.line + 1}" if e.context_mark else ""
            what = f"{e.context}{began}: {what}"
        if mark is None:
            raise InvalidConfig(f"{source}: invalid YAML: {what}", file=source) from None
        line, column = mark.line + 1, mark.column + 1
        raise InvalidConfig(
            f"{source}:{line}:{column}: invalid YAML: {what}", file=source, line=line, column=column
        ) from None
    except yaml.YAMLError as e:
        raise InvalidConfig(f"{source}: invalid YAML: {e}", file=source) from None
    return data


def too_large(source: str, size: int) -> InvalidConfig:
    return InvalidConfig(
        f"{source}: {size} bytes; a profile config may be at most "
        f"{MAX_FILE_BYTES} (what one ConfigMap holds)",
        file=source,
        size=size,
    )


def read(path: Path) -> str:
    """A file's text, at most MAX_FILE_BYTES of it; InvalidConfig naming it otherwise."""
    try:
        with path.open("rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)  # never all of a huge file
        if len(data) > MAX_FILE_BYTES:
            raise too_large(str(path), max(path.stat().st_size, len(data)))
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidConfig(
            f"{path}: not UTF-8 text ({e.reason} at byte {e.start})", file=str(path)
        ) from None
    except OSError as e:
        raise InvalidConfig(f"{path}: cannot read: {e.strerror or e}", file=str(path)) from None


def dump_yaml(data: object) -> str:
    """``data`` as YAML, keys in their order (for output; this module is the yaml boundary)."""
    return str(yaml.safe_dump(data, sort_keys=False))


def load_yaml(path: str | Path) -> object:
    """The plain data of one YAML file (other files the agent reads: hooks, GPU clients);
    InvalidConfig naming the file and line if it cannot be read or parsed."""
    return parse(read(Path(path)), str(path))


def only_keys(
    data: Mapping[object, object], allowed: tuple[str, ...], where: str, source: str
) -> None:
    """InvalidConfig for a key of ``data`` not in ``allowed`` (at ``where`` in ``source``), with
    the closest allowed key."""
    for key in data:
        if key not in allowed:
            near = difflib.get_close_matches(str(key), allowed, n=1)
            raise InvalidConfig(
                f"{where}: unknown key {key!r} (keys: {', '.join(allowed)})"
                + (f"; did you mean {near[0]}?" if near else ""),
                file=source,
                key=str(key),
            )
