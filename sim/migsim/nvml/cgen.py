"""Generates the C of the simulated ``libnvidia-ml.so.1`` from the table in ``migsim.nvml.abi``.

``python -m migsim.nvml.cgen --header nvml.h --out DIR`` writes, at build time (scripts/sim-nvml):

* ``nvml_calls.c``: one function per table entry, with its parameters as nvml.h declares them
  (the entry's parameter count is checked against the prototype), marshalling them with the runtime
  of ``sim/native/nvml_sim.c``; static asserts that every struct of the table has nvml.h's size and
  field offsets; ``nvmlErrorString``'s strings (those of ``migsim.nvml.state``);
* ``nvml_stubs.c``: every other function nvml.h declares, returning NVML_ERROR_NOT_SUPPORTED, so
  that no caller dies of a missing symbol (go-nvml binds lazily: a missing one kills the process).

nvml.h is read where it is (go-nvml's copy in the Go module cache); nothing of it is committed.
"""

from __future__ import annotations

import argparse
import ctypes
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from migsim.nvml import abi
from migsim.nvml.state import ERROR_STRINGS, NOT_SUPPORTED

_DECL = re.compile(r"DECLDIR\s+(\w+)\s*\(([^;{]*?)\)\s*;", re.S)
_COMMENTS = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


def prototypes(header: str) -> dict[str, list[str]]:
    """Function name -> its parameter declarations, for every function nvml.h declares."""
    text = _COMMENTS.sub(" ", header)
    out: dict[str, list[str]] = {}
    for name, params in _DECL.findall(text):
        decls = [" ".join(p.split()) for p in params.split(",")]
        out[name] = [] if decls == ["void"] else decls
    return out


def _param_name(decl: str) -> str:
    return str(re.findall(r"\w+", decl)[-1])


def _structs() -> list[type[abi._Struct]]:
    seen: dict[str, type[abi._Struct]] = {}
    for fn in abi.FUNCTIONS:
        for k in fn.params:
            t = k.ctype if isinstance(k, (abi.Ptr, abi.Array)) else None
            if isinstance(t, type) and issubclass(t, abi._Struct):
                seen.setdefault(t._c_name_, t)
                for field in t._fields_:
                    ft = field[1]
                    if isinstance(ft, type) and issubclass(ft, abi._Struct):
                        seen.setdefault(ft._c_name_, ft)
    return list(seen.values())


def _layout_asserts() -> list[str]:
    lines = []
    for t in _structs():
        c = t._c_name_
        lines.append(f'_Static_assert(sizeof({c}) == {ctypes.sizeof(t)}, "abi.py: size of {c}");')
        for field in t._fields_:
            name = field[0]
            off = getattr(t, name).offset
            lines.append(
                f'_Static_assert(offsetof({c}, {name}) == {off}, "abi.py: offset of {c}.{name}");'
            )
    return lines


def _function(fn: abi.Function, decls: list[str]) -> str:
    if len(decls) != len(fn.params):
        raise SystemExit(
            f"abi.py: {fn.name} has {len(fn.params)} parameter(s), "
            f"nvml.h declares {len(decls)}: {', '.join(decls)}"
        )
    names = [_param_name(d) for d in decls]
    puts: list[str] = []
    gets: list[str] = []
    for i, (kind, p) in enumerate(zip(fn.params, names, strict=True)):
        match kind:
            case abi.Handle():
                puts.append(f"sim_put_handle(&c, {p}.handle);")
            case abi.HandleOut():
                puts.append(f"sim_put_u8(&c, {p} != NULL);")
                gets.append(f"if ({p}) sim_get_handle(&c, (void **)&{p}->handle);")
            case abi.UInt() | abi.Int():
                puts.append(f"sim_put_u32(&c, (uint32_t){p});")
            case abi.Text():
                puts.append(f"sim_put_text(&c, {p});")
            case abi.TextOut(length=n):
                puts.append(f"sim_put_u8(&c, {p} != NULL); sim_put_u32(&c, (uint32_t){names[n]});")
                gets.append(f"if ({p}) sim_get_array(&c, {p}, 1, {names[n]});")
            case abi.Ptr(ctype=t, inout=inout):
                size = ctypes.sizeof(t)
                puts.append(f'_Static_assert(sizeof *{p} == {size}, "abi.py: {fn.name} {p}");')
                handles: tuple[str, ...] = getattr(t, "_handles_", ())
                c_name: str = getattr(t, "_c_name_", "")
                if handles:
                    puts.append(f"size_t off{i} = sim_put_ptr(&c, {p}, sizeof *{p});")
                    puts += [
                        f"if ({p}) sim_tokenize(&c, off{i} + offsetof({c_name}, {f}));"
                        for f in handles
                    ]
                else:
                    puts.append(f"sim_put_ptr(&c, {p}, sizeof *{p});")
                if inout:
                    gets.append(f"if ({p}) sim_get_ptr(&c, {p}, sizeof *{p});")
                    gets += [
                        f"if ({p} && !c.failed) "
                        f"sim_untokenize((char *){p} + offsetof({c_name}, {f}));"
                        for f in handles
                    ]
            case abi.Array(ctype=t, count=k, mode=mode):
                count = names[k]
                nv = f"n{i}"
                if mode == "inout":
                    puts.append(f"uint32_t {nv} = ({p} && {count} > 0) ? (uint32_t){count} : 0;")
                elif mode == "capacity":
                    puts.append(f"uint32_t {nv} = ({p} && {count}) ? *{count} : 0;")
                else:
                    puts.append(f"uint32_t {nv} = {abi.UNBOUNDED_ARRAY};")
                size = 8 if t is None else ctypes.sizeof(t)
                puts.append(f'_Static_assert(sizeof *{p} == {size}, "abi.py: {fn.name} {p}");')
                puts.append(f"sim_put_u8(&c, {p} != NULL); sim_put_u32(&c, {nv});")
                if mode == "inout":
                    puts.append(f"if ({p}) sim_put_bytes(&c, {p}, {nv} * sizeof *{p});")
                if t is None:
                    gets.append(f"if ({p}) sim_get_handles(&c, (void **){p}, {nv});")
                else:
                    gets.append(f"if ({p}) sim_get_array(&c, {p}, sizeof *{p}, {nv});")
    body = "\n    ".join(puts)
    after = "\n        ".join(gets) or "(void)0;"
    return (
        f"nvmlReturn_t {fn.name}({', '.join(decls) or 'void'})\n{{\n"
        f"    sim_call c;\n"
        f'    int rc = sim_start(&c, "{fn.name}");\n'
        f"    if (rc != NVML_SUCCESS) return (nvmlReturn_t)rc;\n"
        f"    {body}\n"
        f"    rc = sim_send(&c);\n"
        f"    if (!c.failed) {{\n        {after}\n    }}\n"
        f"    return (nvmlReturn_t)sim_finish(&c, rc);\n}}\n"
    )


def _c_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def calls_c(protos: dict[str, list[str]]) -> str:
    missing = [f.name for f in abi.FUNCTIONS if f.name not in protos]
    if missing:
        raise SystemExit(f"abi.py: not declared in nvml.h: {', '.join(missing)}")
    cases = "\n".join(
        f"    case {code}: return {_c_string(text)};"
        for code, text in sorted(ERROR_STRINGS.items())
    )
    parts = [
        "/* Generated by migsim.nvml.cgen from migsim/nvml/abi.py; do not edit. */",
        '#include <stddef.h>\n#include <stdint.h>\n#include <nvml.h>\n#include "nvml_sim.h"\n',
        *_layout_asserts(),
        "",
        f"const char *sim_error_string(int code)\n{{\n    switch (code) {{\n{cases}\n"
        f'    default: return "Unknown Error";\n    }}\n}}\n',
        f'const char sim_poll_events[] = "{abi.POLL_EVENTS}";',
        f'const char sim_reset_gpu[] = "{abi.RESET_GPU}";',
        f'const char sim_hold_devices[] = "{abi.HOLD_DEVICES}";',
        f"const uint32_t sim_visible_everything = {abi.VISIBLE_EVERYTHING:#x}u;",
        f"const unsigned int sim_event_poll_ms = {abi.EVENT_POLL_MS};\n",
        *(_function(f, protos[f.name]) for f in abi.FUNCTIONS),
    ]
    return "\n".join(parts)


def stubs_c(protos: dict[str, list[str]]) -> str:
    done = set(abi.BY_NAME) | set(abi.LOCAL_FUNCTIONS)
    lines = [
        "/* Generated by migsim.nvml.cgen: every other function of nvml.h, not simulated. Each",
        " * returns NVML_ERROR_NOT_SUPPORTED whatever its arguments (nvmlReturn_t is an int; on",
        " * the SysV ABI a callee that ignores its arguments is safe). No nvml.h here: the",
        " * definitions do not match its prototypes by design. */",
        f"#define NOT_SUPPORTED {NOT_SUPPORTED}",
        '#define STUB(name) __attribute__((visibility("default"))) int name(void) '
        "{ return NOT_SUPPORTED; }",
    ]
    lines += [f"STUB({name})" for name in sorted(protos) if name not in done]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m migsim.nvml.cgen", description=__doc__)
    p.add_argument("--header", required=True, type=Path, help="nvml.h (go-nvml's)")
    p.add_argument("--out", required=True, type=Path, help="folder for the generated C")
    args = p.parse_args(argv)
    protos = prototypes(args.header.read_text())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "nvml_calls.c").write_text(calls_c(protos))
    (args.out / "nvml_stubs.c").write_text(stubs_c(protos))
    return 0


if __name__ == "__main__":
    sys.exit(main())
