"""Hostile profile configs (issue 15): files built to hurt a parser or a planner - huge, deeply
nested, alias bombs, not UTF-8, tags that construct objects, duplicate keys, absurd counts and
GPU indices, names no label can carry. Each is refused quickly, with a message that names the
file and the problem; none reaches a GPU (the plan-level cases run against a simulated node and
count its mutating NVML calls). The structural corpus of ordinary mistakes is in test_catalog.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from migsim.nvml import library as simlib
from migsim.nvml import open_node

from mig_agent.config.profiles import MAX_COUNT, load_catalog, load_text
from mig_agent.config.yaml_files import MAX_DEPTH, MAX_FILE_BYTES, MAX_NODES
from mig_agent.core.errors import InvalidConfig, PlanError, UnknownLayout
from mig_agent.node.apply import apply_layout

HEAD = "version: v1\nmig-configs:\n"
OK_ENTRY = "    - {devices: all, mig-enabled: false}\n"


def layout(entry: str, name: str = "a") -> str:
    return f"{HEAD}  {name}:\n    - {entry}\n"


def counts(devices: str) -> str:
    return layout(f"{{devices: all, mig-enabled: true, mig-devices: {devices}}}")


def devices(value: str) -> str:
    return layout(f"{{devices: {value}, mig-enabled: false}}")


def bomb(levels: int = 9, fan: int = 10) -> str:
    """Billion laughs: each anchor a list of `fan` aliases of the one before."""
    lines = ["x0: &a0 [" + ",".join(["0"] * fan) + "]"]
    lines += [f"x{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * fan) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def bomb_in(where: Callable[[str], str], levels: int = 9) -> str:
    """A billion laughs defined and used in one value: a list of anchors, each a list of ten
    aliases of the one before (10**9 zeros, were they copied)."""
    anchors = (
        "["
        + ", ".join(
            [f"&a0 [{','.join(['0'] * 10)}]"]
            + [f"&a{i} [" + ",".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, levels)]
        )
        + "]"
    )
    return where(anchors)


def deep_block(levels: int) -> str:
    body = "".join("  " * (i + 2) + "-\n" for i in range(levels))
    return f"{HEAD}  a:\n{body}"


# (id, file content, fragment of the message)
HOSTILE: list[tuple[str, str | bytes, str]] = [
    # -- size ------------------------------------------------------------------------------
    ("huge-comments", "#" * (MAX_FILE_BYTES + 1), "a profile config may be at most"),
    (
        "huge-valid-then-padding",
        layout("{devices: all, mig-enabled: false}") + ("# pad\n" * (MAX_FILE_BYTES // 6 + 1)),
        "a profile config may be at most",
    ),
    (
        "huge-index-list",
        devices("[" + ",".join(str(i % 200) for i in range(400_000)) + "]"),
        "a profile config may be at most",
    ),
    ("huge-binary", b"\x00" * (2 * MAX_FILE_BYTES), "a profile config may be at most"),
    (
        "too-many-nodes",
        devices("[" + ",".join(["0"] * (MAX_NODES + 10)) + "]"),
        f"more than {MAX_NODES} YAML nodes",
    ),
    (
        "too-many-layouts",
        HEAD
        + "".join(
            f"  l{i}: [{{devices: all, mig-enabled: false}}]\n" for i in range(MAX_NODES // 4)
        ),
        f"more than {MAX_NODES} YAML nodes",
    ),
    (
        "long-scalar-version",
        "version: " + "v" * 500_000 + "\nmig-configs: {}\n",
        "(500000 characters)",
    ),
    # -- nesting ---------------------------------------------------------------------------
    (
        "deep-flow-sequences",
        HEAD + "  a: " + "[" * 100_000 + "]" * 100_000 + "\n",
        f"nested deeper than {MAX_DEPTH} levels",
    ),
    (
        "deep-flow-mappings",
        HEAD + "  a: " + "{a: " * 5000 + "1" + "}" * 5000 + "\n",
        f"nested deeper than {MAX_DEPTH} levels",
    ),
    ("deep-unclosed-brackets", HEAD + "  a: " + "[" * 500_000, f"nested deeper than {MAX_DEPTH}"),
    ("deep-block-sequences", deep_block(MAX_DEPTH + 5), f"nested deeper than {MAX_DEPTH} levels"),
    (
        "deep-in-mig-devices",
        counts("{1g.10gb: " + "[" * 50 + "]" * 50 + "}"),
        f"nested deeper than {MAX_DEPTH} levels",
    ),
    # -- aliases ---------------------------------------------------------------------------
    ("billion-laughs-top-level", HEAD + "  a:\n" + OK_ENTRY + bomb(), "unknown key"),
    (
        "bomb-as-devices",
        bomb_in(lambda a: devices(a)),
        "GPU index must be an integer >= 0, got a list",
    ),
    (
        "bomb-as-count",
        bomb_in(lambda a: counts("{1g.10gb: " + a + "}")),
        "count for '1g.10gb' must be an integer >= 0, got a list",
    ),
    ("bomb-as-entries", bomb_in(lambda a: HEAD + f"  a: {a}\n"), "each entry must be a mapping"),
    (
        "layout-name-huge",
        HEAD + "  ? " + "a" * 500_000 + "\n  : [{devices: all, mig-enabled: false}]\n",
        "(500000 characters)",
    ),
    (
        "layout-name-implicit-huge",
        layout("{devices: all, mig-enabled: false}", name="a" * 5000),
        "mapping values are not allowed here",
    ),
    (
        "bomb-as-device-filter",
        bomb_in(lambda a: layout(f"{{device-filter: {a}, devices: all, mig-enabled: false}}")),
        "each filter must be a PCI id string",
    ),
    ("recursive-alias", devices("&r [*r]"), "GPU index must be an integer >= 0, got a list"),
    ("undefined-alias", devices("*nowhere"), "found undefined alias"),
    (
        "alias-as-key",
        HEAD + "  a:\n    - {devices: all, mig-enabled: false, *k : 1}\n",
        "invalid YAML",
    ),
    # -- encoding --------------------------------------------------------------------------
    (
        "latin-1",
        layout("{devices: all, mig-enabled: false}").encode() + "# caf\xe9\n".encode("latin-1"),
        "not UTF-8 text",
    ),
    ("utf-16", layout("{devices: all, mig-enabled: false}").encode("utf-16"), "not UTF-8 text"),
    ("utf-32", layout("{devices: all, mig-enabled: false}").encode("utf-32"), "not UTF-8 text"),
    ("surrogate-bytes", HEAD.encode() + b"  a\xed\xa0\x80: []\n", "not UTF-8 text"),
    ("truncated-multibyte", HEAD.encode() + b"  \xe2\x82: []\n", "not UTF-8 text"),
    ("nul-byte", "version: v1\x00\nmig-configs: {}\n", "unacceptable character #x0000"),
    ("bell-control-char", "version: v1\x07\nmig-configs: {}\n", "unacceptable character #x0007"),
    (
        "escape-sequence-in-name",
        layout("{devices: all, mig-enabled: false}", name='"a\\e[31mred"'),
        "not a valid Kubernetes label",
    ),
    # -- tags ------------------------------------------------------------------------------
    (
        "python-object-apply",
        HEAD + "  a: !!python/object/apply:os.system ['true']\n",
        "could not determine a constructor",
    ),
    (
        "python-name",
        "version: !!python/name:os.system ''\nmig-configs: {}\n",
        "could not determine a constructor",
    ),
    (
        "python-module",
        "version: !!python/module:os ''\nmig-configs: {}\n",
        "could not determine a constructor",
    ),
    ("local-tag", devices("!evil [0]"), "could not determine a constructor for the tag '!evil'"),
    ("binary-version", "version: !!binary djE=\nmig-configs: {}\n", "must be the string 'v1'"),
    (
        "set-as-mig-devices",
        counts("!!set {1g.10gb}"),
        "must be a mapping of MIG profile name to count",
    ),
    (
        "timestamp-count",
        counts("{1g.10gb: 2001-12-14}"),
        "count for '1g.10gb' must be an integer >= 0",
    ),
    (
        "two-documents",
        layout("{devices: all, mig-enabled: false}") + "---\nversion: v1\n",
        "expected a single document",
    ),
    # -- duplicate keys --------------------------------------------------------------------
    (
        "duplicate-layout-quoted",
        HEAD + "  a:\n" + OK_ENTRY + '  "a":\n' + OK_ENTRY,
        "defined twice in this file",
    ),
    (
        "duplicate-entry-key-flow",
        layout("{devices: all, mig-enabled: false, mig-enabled: true}"),
        "appears twice",
    ),
    (
        "duplicate-profile-quoted",
        counts('{1g.10gb: 1, "1g.10gb": 1}'),
        "profile '1g.10gb' appears twice",
    ),
    ("duplicate-version", "version: v1\nversion: v1\nmig-configs: {}\n", "appears twice"),
    # -- absurd numbers --------------------------------------------------------------------
    (
        "count-googol",
        counts("{1g.10gb: " + "1" + "0" * 100 + "}"),
        f"no GPU holds more than {MAX_COUNT} MIG devices",
    ),
    (
        "count-2-64",
        counts("{1g.10gb: 18446744073709551616}"),
        f"no GPU holds more than {MAX_COUNT}",
    ),
    (
        "count-just-over",
        counts(f"{{1g.10gb: {MAX_COUNT + 1}}}"),
        f"count for '1g.10gb' is {MAX_COUNT + 1}",
    ),
    ("count-infinity", counts("{1g.10gb: .inf}"), "got inf (a number)"),
    ("count-nan", counts("{1g.10gb: .nan}"), "got nan (a number)"),
    ("count-exponent-string", counts("{1g.10gb: 1e3}"), "got '1e3' (a string)"),
    ("count-sexagesimal", counts("{1g.10gb: 1:30}"), "count for '1g.10gb' is 90"),
    ("index-googol", devices("[1" + "0" * 100 + "]"), "is beyond any node"),
    ("index-256", devices("[256]"), "GPU index 256 is beyond any node"),
    ("index-float", devices("[1.0]"), "got 1.0 (a number)"),
    ("index-string", devices('["0"]'), "got '0' (a string)"),
    ("index-hex-duplicate", devices("[1, 0x1]"), "GPU index 1 is listed twice"),
    ("index-octal-duplicate", devices("[8, 010]"), "GPU index 8 is listed twice"),
    # -- names -----------------------------------------------------------------------------
    (
        "layout-name-unicode",
        layout("{devices: all, mig-enabled: false}", name="all-1g.10gb-ü"),
        "not a valid Kubernetes label value",
    ),
    (
        "layout-name-fullwidth",
        layout("{devices: all, mig-enabled: false}", name="ａｌｌ"),
        "not a valid Kubernetes label value",
    ),
    (
        "layout-name-newline",
        layout("{devices: all, mig-enabled: false}", name='"a\\nb"'),
        "not a valid Kubernetes label value",
    ),
    (
        "layout-name-path",
        layout("{devices: all, mig-enabled: false}", name="../../etc/passwd"),
        "not a valid Kubernetes label value",
    ),
    (
        "layout-name-64",
        layout("{devices: all, mig-enabled: false}", name="a" * 64),
        "at most 63 characters",
    ),
    (
        "layout-name-null",
        layout("{devices: all, mig-enabled: false}", name="~"),
        "layout names must be strings, got null",
    ),
    (
        "layout-name-bool",
        layout("{devices: all, mig-enabled: false}", name="yes"),
        "layout names must be strings, got true",
    ),
    ("profile-fullwidth-digit", counts("{１g.10gb: 1}"), "is not a MIG profile name"),
    ("profile-me-twice", counts("{1g.10gb+me+me: 1}"), "is not a MIG profile name"),
    ("profile-huge-name", counts("{? " + "1g." * 2000 + "10gb : 1}"), "is not a MIG profile name"),
    (
        "device-filter-injection",
        layout('{device-filter: "0x233010DE; rm -rf /", devices: all, mig-enabled: false}'),
        "is not a PCI id",
    ),
    ("scalar-document", "just a string\n", "expected a mapping"),
    ("null-document", "~\n", "the file is empty"),
]


def _write(tmp_path: Path, content: str | bytes) -> Path:
    path = tmp_path / "hostile.yaml"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("content", "fragment"), [c[1:] for c in HOSTILE], ids=[c[0] for c in HOSTILE]
)
def test_hostile_config_is_refused_quickly_naming_the_problem(
    tmp_path: Path, content: str | bytes, fragment: str
) -> None:
    path = _write(tmp_path, content)
    started = time.monotonic()
    with pytest.raises(InvalidConfig) as info:
        load_catalog([path])
    took = time.monotonic() - started
    message = str(info.value)
    assert fragment in message
    assert message.startswith(str(path))
    assert info.value.context["file"] == str(path)
    assert len(message) < 2000, message[:200]  # a megabyte of input is not echoed back
    assert took < 10.0, f"{took:.1f} s"  # pure-Python YAML, on a shared machine


def test_the_hostile_corpus_is_large_and_distinct() -> None:
    assert len(HOSTILE) >= 50
    assert len({c[0] for c in HOSTILE}) == len(HOSTILE)


def test_limits_leave_every_real_config_well_inside(tmp_path: Path) -> None:
    repo = Path(__file__).resolve().parents[2]
    for path in [
        *sorted((repo / "profiles").glob("*.yaml")),
        *sorted((repo / "tests" / "data" / "compat").glob("*.yaml")),
    ]:
        assert path.stat().st_size < MAX_FILE_BYTES // 10, path
        load_catalog([path])


def test_a_utf8_bom_and_crlf_lines_are_no_problem() -> None:
    text = "\ufeff" + layout("{devices: all, mig-enabled: false}").replace("\n", "\r\n")
    assert [lay.name for lay in load_text(text, "x.yaml")] == ["a"]


def test_the_text_limit_holds_for_stdin_and_direct_text_too() -> None:
    with pytest.raises(InvalidConfig, match="a profile config may be at most"):
        load_text("#" * (MAX_FILE_BYTES + 1), "<stdin>")


# -- layouts that parse, but cannot be for this node: refused by the plan, no NVML call ----------


NODE_CASES = [
    (
        "index-beyond-the-node",
        devices("[0, 5]"),
        "layout 'a', entry 1: GPU index(es) 5 not on this node (it has GPU 0 only)",
    ),
    ("only-indices-beyond", devices("[3]"), "GPU index(es) 3 not on this node"),
    ("count-beyond-the-gpu", counts("{1g.10gb: 8}"), "8 x 1g.10gb requested"),
    ("count-at-the-limit", counts(f"{{1g.10gb: {MAX_COUNT}}}"), f"{MAX_COUNT} x 1g.10gb"),
    ("profile-of-another-model", counts("{1g.5gb: 7}"), "no MIG profile 1g.5gb"),
    (
        "filter-of-another-model",
        layout('{device-filter: "0x20B010DE", devices: all, mig-enabled: false}'),
        "selects none of this node's",
    ),
]


@pytest.mark.parametrize(
    ("text", "fragment"), [c[1:] for c in NODE_CASES], ids=[c[0] for c in NODE_CASES]
)
def test_a_layout_that_cannot_be_for_this_node_touches_no_gpu(
    tmp_path: Path, text: str, fragment: str
) -> None:
    state = tmp_path / "node.json"
    simlib.create_node(state, gpus="1xH100-80GB", name="n")
    (lay,) = load_text(text, "x.yaml")
    gpus = open_node(str(state))
    try:
        simlib.reset_call_counts(str(state))
        with pytest.raises(PlanError) as info:
            apply_layout(lay, gpus)
        assert fragment in str(info.value)
        assert simlib.call_counts(str(state)).total == 0  # not one mutating NVML call
    finally:
        gpus.close()


# -- label values ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        "",
        " ",
        "a" * 64,
        "all-1g.10gb\u00fc",
        "ａｌｌ-1g.10gb",
        "all-1g.10gb\n",
        "ALL-1G.10GB",
        "all-1g.10gb ",
        "${LAYOUT}",
    ],
)
def test_a_label_value_naming_no_layout_is_refused_by_name(value: str) -> None:
    catalog = load_catalog([Path(__file__).resolve().parents[2] / "profiles"])
    with pytest.raises(UnknownLayout) as info:
        catalog.get(value)
    assert f"unknown layout {value!r}" in str(info.value)
    assert "known layouts" in str(info.value)


def test_a_layout_only_in_another_file_is_unknown_here(tmp_path: Path) -> None:
    (tmp_path / "mounted").mkdir()
    (tmp_path / "mounted" / "a.yaml").write_text(layout("{devices: all, mig-enabled: false}"))
    (tmp_path / "elsewhere.yaml").write_text(layout("{devices: all, mig-enabled: false}", name="b"))
    catalog = load_catalog([tmp_path / "mounted"])
    with pytest.raises(UnknownLayout, match=r"unknown layout 'b'.*known layouts: a\)"):
        catalog.get("b")
