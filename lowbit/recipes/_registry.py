"""The registry of named recipes: `register_recipe(name)` adds a recipe function, `get_recipe(name)`
calls it. The built-in recipes register themselves in _builtin, which lowbit.recipes imports."""

from __future__ import annotations

from collections.abc import Callable

from lowbit.recipes._config import Recipe

__all__ = ["RECIPES", "register_recipe", "get_recipe", "recipe_names"]


RECIPES: dict[str, Callable[[], Recipe]] = {}


def register_recipe(name: str):
    def wrap(fn: Callable[[], Recipe]):
        if name in RECIPES:
            raise ValueError(f"recipe {name!r} is already registered")
        RECIPES[name] = fn
        return fn
    return wrap


def recipe_names() -> list[str]:
    return list(RECIPES)


def get_recipe(name: str | Recipe) -> Recipe:
    if isinstance(name, Recipe):
        return name
    try:
        return RECIPES[name]()
    except KeyError:
        raise ValueError(f"unknown recipe {name!r}; known recipes: {', '.join(RECIPES)}") from None
