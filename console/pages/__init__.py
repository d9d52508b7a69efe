"""The console's pages: every module in this folder is one page (or a few), found at start-up.

A page module defines `ROUTES` (a list of Starlette routes) and `NAV` (a tuple of `NavEntry`, empty
for pages reached only by links). Adding a page is adding a module here and its templates; no list
elsewhere needs an edit. See docs/console.md, "How to add a page".
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import cache
from types import ModuleType

from starlette.routing import BaseRoute

from ..web import NavEntry


@cache
def page_modules() -> tuple[ModuleType, ...]:
    names = sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))
    return tuple(importlib.import_module(f"{__name__}.{name}") for name in names)


def routes() -> list[BaseRoute]:
    return [route for module in page_modules() for route in module.ROUTES]


def nav() -> list[NavEntry]:
    return sorted(
        (entry for module in page_modules() for entry in module.NAV), key=lambda e: e.order
    )
