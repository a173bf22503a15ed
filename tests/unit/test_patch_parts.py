"""The switch's parts on their own, in this process and on made-up module names (torch is
never patched here): the rebinding table and the import hook's aliases and after-import
callbacks."""

from __future__ import annotations

import importlib
import json
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from distgrad._patch import _hooks
from distgrad._patch._rebind import Table


@pytest.fixture
def clean_hooks() -> Iterator[None]:
    """Leave the import machinery as it was (the finder out of sys.meta_path, no entries)."""
    yield
    finder = _hooks._finder
    while finder in sys.meta_path:
        sys.meta_path.remove(finder)
    finder.exact.clear()
    finder.prefixes.clear()
    finder.after.clear()
    for name in [n for n in sys.modules if n.startswith("lib20fake")]:
        del sys.modules[name]


def test_table_rebinds_only_what_it_holds() -> None:
    """The sweep replaces the globals bound to a table's objects, in every module but the
    skipped ones and distgrad's, and leaves other values (equal constants included) alone."""
    old_cls = type("Old", (), {})
    new_cls = type("New", (), {})
    user = types.ModuleType("lib20fake_user")
    user.Cls, user.Alias, user.number, user.other = old_cls, old_cls, 60.0, json
    skipped = types.ModuleType("lib20fake_skipped")
    skipped.Cls = old_cls
    table = Table()
    table.add(old_cls, new_cls)
    table.add(None, new_cls)  # nothing to replace: ignored
    sys.modules["lib20fake_user"] = user
    sys.modules["lib20fake_skipped"] = skipped
    try:
        rebound = table.sweep({id(skipped)})
    finally:
        del sys.modules["lib20fake_user"], sys.modules["lib20fake_skipped"]
    assert rebound == 2 and len(table) == 1
    assert user.Cls is new_cls and user.Alias is new_cls
    assert user.number == 60.0 and user.other is json
    assert skipped.Cls is old_cls


def test_add_module_maps_rpc_objects_by_name() -> None:
    """A module's functions and classes of torch's RPC map to the new module's of the same
    name; names the new module lacks, and constants, are not mapped."""
    old = types.ModuleType("torch.distributed.rpc.lib20fake")
    new = types.ModuleType("distgrad.rpc.lib20fake")

    def f() -> None: ...

    def g() -> None: ...

    f.__module__ = g.__module__ = "torch.distributed.rpc.lib20fake"
    old.f, old.g, old.TIMEOUT = f, g, 60.0
    new.f, new.TIMEOUT = json.dumps, 60.0
    table = Table()
    table.add_module(old, new)
    assert table.lookup(old) is new and table.lookup(f) is json.dumps
    assert table.lookup(g) is None and table.lookup(60.0) is None


def test_alias_gives_the_same_module_under_another_name(clean_hooks: None) -> None:
    """An aliased name (exact or under a prefix) imports as the target module itself, which
    keeps its own spec; a name with no target fails naming the switch."""
    _hooks.alias({"lib20fake_json": "json"}, {"lib20fake_pkg.": "email."})
    import lib20fake_json  # type: ignore[import-not-found]

    assert lib20fake_json is json and json.__spec__ is not None
    assert json.__spec__.name == "json"
    parent = types.ModuleType("lib20fake_pkg")
    parent.__path__ = []
    sys.modules["lib20fake_pkg"] = parent
    charset = importlib.import_module("lib20fake_pkg.charset")
    assert charset is importlib.import_module("email.charset")
    assert parent.charset is charset  # the import system bound it on the parent
    with pytest.raises(ModuleNotFoundError, match="distgrad stands in for torch's RPC"):
        importlib.import_module("lib20fake_pkg.no_such_module")


def test_after_import_runs_once_when_the_module_loads(
    clean_hooks: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A callback registered before a module is imported runs once, with the loaded module;
    one registered after runs at once."""
    (tmp_path / "lib20fake_late.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[int] = []
    _hooks.after_import("lib20fake_late", lambda m: seen.append(m.VALUE))
    assert seen == []
    import lib20fake_late  # type: ignore[import-not-found]

    assert seen == [1]
    importlib.reload(lib20fake_late)
    assert seen == [1]
    _hooks.after_import("lib20fake_late", lambda m: seen.append(m.VALUE + 1))
    assert seen == [1, 2]
