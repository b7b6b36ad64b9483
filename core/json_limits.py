"""JSON read with limits: NaN and Infinity refused (they are not JSON), nesting counted without
recursion. Plain Python, so a process that reads specs (a node agent) need not load DRF
(core.parsers wraps this for the API)."""

import json

MAX_DEPTH = 64  # no body of this API nests more than a spec's 32 levels and a wrapper or two


class TooDeep(ValueError):
    pass


def depth(value, limit):
    """How deep lists and mappings are inside each other (counted without recursion, to limit+1)."""
    deepest, stack = 0, [(value, 1)]
    while stack and deepest <= limit:
        item, level = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, level)
            stack.extend((v, level + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


def _no_constant(name):
    raise ValueError(f"{name} is not a JSON number")


def read_json(text, max_depth=MAX_DEPTH):
    """JSON text as values; raises ValueError (json's own, or TooDeep) with a reason."""
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except RecursionError:  # deeper than the stack: found by the parser before our count
        raise TooDeep(f"nested too deeply (more than {max_depth} levels)") from None
    if depth(value, max_depth) > max_depth:
        raise TooDeep(f"nested too deeply (more than {max_depth} levels)")
    return value
