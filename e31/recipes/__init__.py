"""Built-in recipes: training scripts the network ships, chosen by name instead of uploaded.

This module only describes them (their settings, with defaults, help and limits) and checks a
configuration; it imports neither torch nor Django, so the web app can build its forms from it.
The recipes themselves run as `python -m e31.recipes.classifier` or `python -m e31.recipes.charlm`
inside a job (see common.py for the environment they read and the files they write).
"""

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["RECIPES", "Param", "Recipe", "validate"]

KINDS = ("int", "float", "choice", "bool")


@dataclass(frozen=True)
class Param:
    """One setting of a recipe: kind is "int", "float", "choice" or "bool"."""

    name: str
    kind: str
    default: object
    help: str
    choices: tuple[str, ...] | None = None
    min: float | None = None
    max: float | None = None


@dataclass(frozen=True)
class Recipe:
    name: str
    title: str
    description: str
    params: tuple[Param, ...]

    def param(self, name: str) -> Param | None:
        return next((p for p in self.params if p.name == name), None)

    def defaults(self) -> dict[str, Any]:
        return {p.name: p.default for p in self.params}


def _shared(lr: float, batch_size: int, max_steps: int, eval_every: int, checkpoint_every: int) -> tuple[Param, ...]:
    return (
        Param("mode", "choice", "train", "train a model, or evaluate the models staged in $E31_MODEL_DIR", choices=("train", "evaluate")),
        Param("adaptation", "choice", "full", "train every weight, or only low-rank adapters (LoRA) on the linear layers", choices=("full", "lora")),
        Param("lora_rank", "int", 8, "rank of the LoRA adapters", min=1, max=1024),
        Param("lora_alpha", "float", 16.0, "LoRA scale numerator: adapters are scaled by alpha / rank", min=1e-6, max=1e6),
        Param("smoke", "bool", False, "a smoke test: a few steps on 1% of the data"),
        Param("seed", "int", 0, "random seed (initial weights and batch order)", min=0, max=2**31 - 1),
        Param("lr", "float", lr, "learning rate (AdamW)", min=1e-8, max=10.0),
        Param("batch_size", "int", batch_size, "examples per step", min=1, max=65536),
        Param("max_steps", "int", max_steps, "optimizer steps to run", min=1, max=10_000_000),
        Param("eval_every", "int", eval_every, "evaluate on the validation set every this many steps", min=1, max=10_000_000),
        Param("patience", "int", 0, "evaluations without improvement of val_loss before stopping early; 0 = off", min=0, max=100_000),
        Param("checkpoint_every", "int", checkpoint_every, "checkpoint every this many steps; 0 = only when asked to stop", min=0, max=10_000_000),
    )


RECIPES = {
    "classifier": Recipe(
        name="classifier",
        title="Tabular / image classifier",
        description=(
            "An MLP trained on CSV files (numeric columns plus a 'label' column, or the last column) "
            "or NPZ files (arrays x and y; images are flattened) in train/ and heldout/. "
            "Features are standardised with the training set's mean and standard deviation."
        ),
        params=(
            *_shared(lr=0.003, batch_size=64, max_steps=300, eval_every=50, checkpoint_every=100),
            Param("hidden", "int", 128, "width of each hidden layer", min=1, max=65536),
            Param("layers", "int", 2, "number of hidden layers", min=1, max=64),
        ),
    ),
    "charlm": Recipe(
        name="charlm",
        title="Byte-level language model",
        description=(
            "A small causal transformer over bytes (vocabulary 256) trained on the *.txt files in train/; "
            "validated on heldout/*.txt, or on the last 10% of the training text."
        ),
        params=(
            *_shared(lr=0.001, batch_size=32, max_steps=500, eval_every=100, checkpoint_every=100),
            Param("context", "int", 64, "bytes of context the model sees", min=2, max=8192),
            Param("d_model", "int", 64, "width of the transformer", min=4, max=8192),
            Param("n_layers", "int", 2, "transformer blocks", min=1, max=96),
            Param("n_heads", "int", 4, "attention heads (must divide d_model)", min=1, max=128),
            Param("eval_windows", "int", 128, "at most this many fixed validation windows", min=1, max=1000000),
            Param(
                "parallel",
                "choice",
                "ddp",
                "how several processes share the work: data parallel (ddp) keeps a whole copy of the model in each; "
                "fully sharded data parallel (fsdp) shards parameters, gradients and optimizer state across the processes, "
                "for models that do not fit one device",
                choices=("ddp", "fsdp"),
            ),
        ),
    ),
}

TRUE_WORDS = {"true", "yes", "on", "1"}
FALSE_WORDS = {"false", "no", "off", "0"}


def _coerce(param: Param, value: object) -> tuple[object, str | None]:
    """(value, None) or (None, error message) for one raw value."""
    kind = param.kind
    if kind == "bool":
        if isinstance(value, bool):
            return value, None
        if isinstance(value, (int, float)) and value in (0, 1):
            return bool(value), None
        if isinstance(value, str) and value.strip().lower() in TRUE_WORDS | FALSE_WORDS:
            return value.strip().lower() in TRUE_WORDS, None
        return None, f"expected true or false, got {value!r}"
    if kind == "choice":
        choices = param.choices or ()  # every choice setting names its choices
        if isinstance(value, str) and value in choices:
            return value, None
        return None, f"{value!r} is not one of: {', '.join(choices)}"
    if isinstance(value, bool):
        return None, f"expected a number, got {value!r}"
    if kind == "int":
        number = value
        if isinstance(value, str):
            try:
                number = float(value.strip())
            except ValueError:
                return None, f"expected a whole number, got {value!r}"
        if not isinstance(number, (int, float)) or not math.isfinite(number) or number != int(number):
            return None, f"expected a whole number, got {value!r}"
        number = int(number)
    else:
        try:
            # Not a string nor a number (a list, None): float() raises TypeError, answered below.
            number = float(value.strip() if isinstance(value, str) else value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return None, f"expected a number, got {value!r}"
        if not math.isfinite(number):
            return None, f"expected a finite number, got {value!r}"
    if param.min is not None and number < param.min:
        return None, f"must be at least {param.min:g}, got {number:g}"
    if param.max is not None and number > param.max:
        return None, f"must be at most {param.max:g}, got {number:g}"
    return number, None


def validate(recipe_name: str, config: object) -> tuple[dict[str, Any], dict[str, str]]:
    """Check a configuration for a recipe: (clean, errors).

    clean has every setting of the recipe: the defaults filled in and the given values coerced to
    their kind ("3" -> 3, "true" -> True). errors maps a setting's name (or "recipe", "config")
    to a message a person can act on; the configuration is usable only when errors is empty.
    """
    recipe = RECIPES.get(recipe_name)
    if recipe is None:
        return {}, {"recipe": f"unknown recipe {recipe_name!r}; choose from: {', '.join(sorted(RECIPES))}"}
    if config is None:
        config = {}
    if not isinstance(config, dict):
        return recipe.defaults(), {"config": f"the configuration must be a JSON object, got {type(config).__name__}"}
    clean, errors = recipe.defaults(), {}
    for key, value in config.items():
        param = recipe.param(key)
        if param is None:
            known = ", ".join(p.name for p in recipe.params)
            errors[str(key)] = f"unknown setting {key!r} for recipe {recipe.name}; known settings: {known}"
            continue
        coerced, error = _coerce(param, value)
        if error:
            errors[key] = f"{key}: {error}"
        else:
            clean[key] = coerced
    if recipe.name == "charlm" and not errors and clean["d_model"] % clean["n_heads"]:
        errors["n_heads"] = f"n_heads: must divide d_model ({clean['d_model']}), got {clean['n_heads']}"
    return clean, errors
