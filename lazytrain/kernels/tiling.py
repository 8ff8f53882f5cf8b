"""What the tiled operators share: how many tiles, the tiles themselves, and recognising the module
code they stand in for (NOTE: [Tiled MLP] in tiled_mlp.py, [Tiled RMSNorm] in tiled_norm.py)."""

import ast
import functools
import inspect
import textwrap

import torch

BUDGET = 256 << 20  # bytes of one tile's widest intermediate (`tiles_for`)


def tiles_for(tokens: int, width: int, itemsize: int, budget_bytes: int = BUDGET) -> int:
    """The fewest tiles whose largest, ceil(tokens / tiles) rows of [.., width] itemsize-byte
    elements, fits in budget_bytes: at least 1, at most tokens (one row a tile, even over budget)."""
    rows = budget_bytes // max(1, width * itemsize)  # rows a tile may have
    if rows < 1:
        return max(1, tokens)
    return max(1, min(tokens, -(-tokens // rows)))


def split(t: torch.Tensor, tiles: int):
    """t's rows in `tiles` nearly equal contiguous tiles (views)."""
    return torch.tensor_split(t, tiles) if tiles > 1 else (t,)


def body_of(function) -> str | None:
    """A function's body as code, without its docstring, comments or whitespace (to compare a
    module's forward with a known one); None when it has no source to read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return None
    defs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    if not defs:
        return None
    body = defs[0].body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    return "".join("".join(ast.unparse(stmt).split()) for stmt in body)


def swapped(module: torch.nn.Module, tiled_forward) -> bool:
    """Whether `module`'s forward is set, on the instance, to `tiled_forward` (`swap_forward`)."""
    forward = vars(module).get("forward")
    return isinstance(forward, functools.partial) and forward.func is tiled_forward


def swap_forward(module: torch.nn.Module, tiled_forward, *args) -> None:
    """Make `module` compute tiled_forward(module, *args, input): set on the instance, so that its
    parameters and their names stay as they are, and `restore` undoes it."""
    module.forward = functools.partial(tiled_forward, module, *args)


def restore(model: torch.nn.Module, tiled_forward) -> int:
    """Give the modules `swap_forward` set to `tiled_forward` their class's forward back; how many."""
    restored = 0
    for module in model.modules():
        if swapped(module, tiled_forward):
            del module.forward
            restored += 1
    return restored
