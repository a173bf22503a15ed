"""Write docs/api.md, the API reference of distgrad's public modules, from the docstrings.

    python scripts/gen_api_docs.py           # rewrite docs/api.md
    python scripts/gen_api_docs.py --check   # exit 1 if docs/api.md is out of date

For each public module (``distgrad.rpc``, ``distgrad.autograd``, ``distgrad.optim``,
``distgrad.nn``, ``distgrad.testing``, and ``distgrad.profiler`` when it exists) every name in
``__all__`` is listed with its signature and docstring; classes also list their public methods
and properties (those defined by distgrad, not the ones inherited from torch or ``object``);
submodules in ``__all__`` (``rpc.api``, ``rpc.constants``, ``rpc.functions``) get their own
section.
tests/unit/test_api_docs.py fails when the file is out of date.
"""

from __future__ import annotations

import argparse
import enum
import importlib
import inspect
import re
import sys
import textwrap
import types
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
OUTPUT = REPO / "docs" / "api.md"
MODULES = [
    "distgrad.rpc",
    "distgrad.autograd",
    "distgrad.optim",
    "distgrad.nn",
    "distgrad.profiler",
    "distgrad.testing",
]
PAGES = {  # hand-written pages that say more about a module
    "distgrad.optim": "optim.md",
    "distgrad.nn": "nn.md",
    "distgrad.testing": "testing-fault-tolerance.md",
}

HEADER = """\
# API reference

Generated from the docstrings by `scripts/gen_api_docs.py` -- do not edit by hand; run
`python scripts/gen_api_docs.py` after changing a public docstring or signature
(`tests/unit/test_api_docs.py` fails while this page is out of date).

Only the names in each module's `__all__` are listed. The torch-compatible private names a
drop-in needs (`rpc._set_rpc_timeout`, `rpc._wait_all`, `autograd._new_context`, ...) exist
as well; see [migration.md](migration.md).
"""


def _doc(obj: Any) -> str:
    doc = inspect.getdoc(obj)
    return _markdown(doc.strip()) if doc else "*(no docstring)*"


_SECTION = re.compile(r"(Args|Returns|Yields|Raises|Example|Examples|Attributes):")
_ENTRY = re.compile(r"(\*{0,2}[\w.]+(?:, \*{0,2}[\w.]+)*)(?: \(([^)]*)\))?: (.*)")


def _markdown(doc: str) -> str:
    """A docstring with Google-style sections as Markdown: ``Args:`` / ``Raises:`` /
    ``Attributes:`` entries become bullet lists (``name (type): text``), ``Returns:`` a
    paragraph, ``Example:`` a fenced Python block; everything else stays as written."""
    lines = doc.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        match = _SECTION.fullmatch(lines[i])
        i += 1
        if match is None:
            out.append(lines[i - 1])
            continue
        block: list[str] = []
        while i < len(lines) and (not lines[i].strip() or lines[i].startswith(" ")):
            block.append(lines[i])
            i += 1
        while block and not block[-1].strip():
            block.pop()
        body = textwrap.dedent("\n".join(block))
        title = match.group(1)
        out += [f"**{title}:**", ""]
        if title in ("Example", "Examples"):
            out += ["```python", body, "```"]
        elif title in ("Returns", "Yields"):
            out += [" ".join(body.split())]
        else:
            out += _entries(body)
        if i < len(lines):
            out.append("")
    return "\n".join(out)


def _entries(body: str) -> list[str]:
    """``name (type): text`` entries (continued on more-indented lines) as bullets."""
    items: list[list[str]] = []
    for line in body.splitlines():
        if line and not line.startswith(" "):
            items.append([line])
        elif items and line.strip():
            items[-1].append(line.strip())
    bullets = []
    for item in items:
        text = " ".join(item)
        entry = _ENTRY.fullmatch(text)
        if entry is None:
            bullets.append(f"- {text}")
            continue
        name, kind, rest = entry.groups()
        kind_text = f" ({kind})" if kind else ""
        names = ", ".join(f"`{n}`" for n in name.split(", "))
        bullets.append(f"- {names}{kind_text}: {rest}")
    return bullets


def _signature(obj: Any) -> str:
    """``(a: int = 1, *, b: str) -> None``, annotations as written in the source."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return "(...)"
    params = []
    for param in sig.parameters.values():
        text = str(param.replace(annotation=inspect.Parameter.empty))
        if param.annotation is not inspect.Parameter.empty:
            name, _, default = text.partition("=")
            text = f"{name}: {_annotation(param.annotation)}" + (f" = {default}" if default else "")
        params.append(text)
    # re-insert the markers str(Signature) would write for positional-only / keyword-only
    kinds = [p.kind for p in sig.parameters.values()]
    out: list[str] = []
    for i, (text, kind) in enumerate(zip(params, kinds, strict=True)):
        first_keyword_only = kind == inspect.Parameter.KEYWORD_ONLY and (
            i == 0 or kinds[i - 1] != inspect.Parameter.KEYWORD_ONLY
        )
        if first_keyword_only and inspect.Parameter.VAR_POSITIONAL not in kinds:
            out.append("*")
        out.append(text)
        if kind == inspect.Parameter.POSITIONAL_ONLY and (
            i + 1 == len(kinds) or kinds[i + 1] != inspect.Parameter.POSITIONAL_ONLY
        ):
            out.append("/")
    result = f"({', '.join(out)})"
    if sig.return_annotation is not inspect.Signature.empty:
        result += f" -> {_annotation(sig.return_annotation)}"
    return result


def _annotation(annotation: Any) -> str:
    if isinstance(annotation, str):
        return annotation
    return inspect.formatannotation(annotation)


def _own_members(cls: type) -> list[tuple[str, Any]]:
    """Public methods and properties defined by ``cls`` or its distgrad base classes."""
    found: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        if not klass.__module__.startswith("distgrad"):
            continue
        for name, value in vars(klass).items():
            if name.startswith("_") and name != "__init__":
                continue
            found[name] = value
    return sorted(found.items(), key=lambda item: (item[0] != "__init__", item[0]))


def _render_class(lines: list[str], qualname: str, cls: type) -> None:
    bases = [b.__module__ + "." + b.__qualname__ for b in cls.__bases__ if b is not object]
    plain = issubclass(cls, (BaseException, enum.Enum)) and "__init__" not in vars(cls)
    signature = "" if plain else _signature(cls)
    lines.append(f"### class `{qualname}{signature}`\n")
    if bases:
        lines.append("Bases: " + ", ".join(f"`{b}`" for b in bases) + "\n")
    lines.append(_doc(cls) + "\n")
    if issubclass(cls, enum.Enum):
        lines.append("Members: " + ", ".join(f"`{m.name}`" for m in cls) + "\n")
        return
    same_doc: dict[str, list[str]] = {}  # methods that share one docstring: listed together
    for name, value in _own_members(cls):
        if inspect.isfunction(value):
            same_doc.setdefault(_doc(value), []).append(name)
    grouped = {doc: names for doc, names in same_doc.items() if len(names) > 2}
    for doc, names in grouped.items():
        lines.append(f"#### {', '.join(f'`{n}`' for n in names)}\n")
        lines.append(doc + "\n")
    for name, value in _own_members(cls):
        if name == "__init__" or (inspect.isfunction(value) and _doc(value) in grouped):
            continue
        if isinstance(value, property):
            lines.append(f"#### property `{qualname}.{name}`\n")
            lines.append(_doc(value) + "\n")
        elif isinstance(value, (staticmethod, classmethod)):
            kind = "staticmethod" if isinstance(value, staticmethod) else "classmethod"
            func = value.__func__
            lines.append(f"#### {kind} `{qualname}.{name}{_signature(getattr(cls, name))}`\n")
            lines.append(_doc(func) + "\n")
        elif inspect.isfunction(value):
            lines.append(f"#### method `{qualname}.{name}{_signature(value)}`\n")
            lines.append(_doc(value) + "\n")


def _render_module(
    lines: list[str], module: types.ModuleType, level: int, seen: dict[int, str]
) -> None:
    lines.append(f"{'#' * level} `{module.__name__}`\n")
    lines.append(_doc(module) + "\n")
    page = PAGES.get(module.__name__)
    if page:
        lines.append(f"More, with examples and the differences from torch: [{page}]({page}).\n")
    submodules = []
    for name in module.__all__:
        obj = getattr(module, name)
        qualname = f"{module.__name__}.{name}"
        if (inspect.isclass(obj) or inspect.isfunction(obj)) and id(obj) in seen:
            lines.append(f"### `{qualname}`\n")
            lines.append(f"The same object as `{seen[id(obj)]}`.\n")
            continue
        seen.setdefault(id(obj), qualname)
        if isinstance(obj, types.ModuleType):
            submodules.append(obj)
        elif inspect.isclass(obj):
            _render_class(lines, qualname, obj)
        elif callable(obj):
            lines.append(f"### `{qualname}{_signature(obj)}`\n")
            lines.append(_doc(obj) + "\n")
        else:
            lines.append(f"### `{qualname} = {obj!r}`\n")
    for sub in submodules:
        _render_module(lines, sub, level + 1, seen)


def render() -> str:
    """The whole page."""
    # torch's _testing registers FAULTY_TENSORPIPE; list it always, not only when a test or a
    # program happened to import it first
    importlib.import_module("distgrad.rpc._testing")
    lines = [HEADER]
    seen: dict[int, str] = {}
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # an optional module this tree does not have
                continue
            raise
        _render_module(lines, module, 2, seen)
    return "\n".join(lines).rstrip() + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only check docs/api.md")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO / "src"))
    text = render()
    if args.check:
        if OUTPUT.read_text() != text:
            print(f"{OUTPUT} is out of date: run python scripts/gen_api_docs.py", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
