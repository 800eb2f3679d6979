"""``meshtrain recipes``: the built-in recipes, one line each (``--yaml NAME`` prints one as a file)."""

from __future__ import annotations

from meshtrain.recipes import BUILTIN_RECIPES, get_recipe


def add_parser(sub):
    p = sub.add_parser("recipes", help="list built-in recipes")
    p.add_argument("--yaml", metavar="NAME", help="print this recipe as YAML (a starting point for your own)")
    p.set_defaults(run=run, setup_devices=False)


def run(args) -> int:
    if args.yaml:
        print(get_recipe(args.yaml).to_yaml(), end="")
        return 0
    width = max(len(n) for n in BUILTIN_RECIPES)
    for name, recipe in BUILTIN_RECIPES.items():
        mesh = ",".join(f"{a}={s}" for a, s in recipe.mesh.ici)
        print(f"{name.ljust(width)}  {recipe.description}  [mesh {mesh}; strategies {'+'.join(str(s) for s in recipe.strategies)}]")
    return 0
