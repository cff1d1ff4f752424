"""Named training recipes: which format, block, scale rule and rounding each operand of each
of a linear layer's three GEMMs uses.

| GEMM  | computes     | operands (reduction dim)             |
| fprop | Y  = X W^T   | X (in_features),  W (in_features)    |
| dgrad | dX = dY W    | dY (out_features), W (out_features)  |
| wgrad | dW = dY^T X  | dY (tokens),       X (tokens)        |

A recipe is a named function returning a validated `Recipe`: a catalogue, each entry saying
what it is, the paper it comes from, and the results file with this project's evidence for it
(docs/results/). `get_recipe(name)` looks one up; `register_recipe(name)` adds one.

The configs live in _config, the registry in _registry, the built-in recipes in _builtin
(imported here, so `import lowbit.recipes` registers them).
"""

from lowbit.recipes._config import Gemm, LinearRecipe, Recipe
from lowbit.recipes._registry import RECIPES, get_recipe, quantizes, recipe_names, register_recipe
from lowbit.recipes._builtin import bf16, mxfp4, nvfp4, stable_fp4   # registers every built-in recipe

__all__ = ["Gemm", "LinearRecipe", "Recipe", "RECIPES", "register_recipe", "get_recipe", "recipe_names",
           "quantizes",
           "bf16", "mxfp4", "nvfp4", "stable_fp4"]
