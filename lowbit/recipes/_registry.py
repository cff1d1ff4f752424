"""The registry of named recipes: `register_recipe(name)` adds a recipe function, `get_recipe(name)`
calls it. The built-in recipes register themselves in _builtin, which lowbit.recipes imports."""

from __future__ import annotations

from collections.abc import Callable

from lowbit.recipes._config import Recipe

__all__ = ["RECIPES", "register_recipe", "get_recipe", "recipe_names", "quantizes"]


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


def quantizes(name: str | Recipe) -> bool:
    """Whether the recipe (by name, or itself) quantizes any layer: the one test of "no recipe"
    (bf16). An unknown name is refused as get_recipe refuses it."""
    return get_recipe(name).quantizes


def get_recipe(name: str | Recipe) -> Recipe:
    if isinstance(name, Recipe):
        return name
    try:
        return RECIPES[name]()
    except KeyError:
        raise ValueError(f"unknown recipe {name!r}; known recipes: {', '.join(RECIPES)}") from None
