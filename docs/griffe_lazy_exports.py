"""Griffe extension for the docs: read ``fxprof_lightning`` as its users import it.

- ``fxprof_lightning`` lists ``FXProfilerCallback`` in ``__all__`` but imports it in a module ``__getattr__`` (so that
  Lightning is imported only when the callback is used), which static analysis does not follow. For each exported
  name the package does not define or import at top level, the submodule that defines it is found and an alias
  added, so that ``::: fxprof_lightning.FXProfilerCallback`` works wherever the class lives.
- Our docstrings head their doctests ``Example:``, which griffe's Google parser reads as an admonition of Markdown
  (``>>>`` becomes nested quotes); ``Examples:`` is its doctest section, so the heading is read as that.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)


def _definitions(module: griffe.Module, name: str) -> list[str]:
    found = []
    for member in module.members.values():
        if member.is_alias:
            continue
        if member.is_module:
            found += _definitions(member, name)
        elif member.name == name and (member.is_class or member.is_function):
            found.append(member.path)
    return found


class LazyExports(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        for export in pkg.exports or ():
            name = export if isinstance(export, str) else export.name
            if name in pkg.members:
                continue
            paths = _definitions(pkg, name)
            if len(paths) != 1:
                raise griffe.GriffeError(f"{pkg.path}.__all__ names {name!r}, defined in {len(paths)} places: {paths}")
            pkg.set_member(name, griffe.Alias(name, paths[0], parent=pkg))
