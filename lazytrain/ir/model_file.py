"""The user's model file (`lazytrain compile model.py`, `lazytrain train --model model.py`): imported
with its folder on the path, its `build_model` and `example_batch` with their exceptions turned into
one `TraceError` naming the user's file and line, and its model built on the meta device."""

from __future__ import annotations

import functools
import importlib.util
import sys
import traceback
from pathlib import Path
from typing import Callable

import torch

from lazytrain.errors import LazytrainError, TraceError, one_line


def load_model_file(path: str | Path) -> tuple[Callable[[], torch.nn.Module], Callable[[], dict]]:
    """Import a model file and return its `build_model` and `example_batch` functions.

    The file's directory is on `sys.path` while it is imported, as for a script, so it can import
    helper modules beside it. An exception raised by the file (at import, or later inside the two
    functions) becomes one `TraceError` naming the user's file and line.
    """
    path = Path(path)
    convention = "pass a .py file defining build_model() and example_batch()"
    if not path.is_file():
        raise TraceError(f"model file {path} does not exist; {convention}")
    if path.suffix != ".py":
        raise TraceError(f"model file {path} is not a Python file (.py); {convention}, or a Hugging Face model "
                         "directory")
    spec = importlib.util.spec_from_file_location(f"lazytrain_user_model_{abs(hash(str(path.resolve())))}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    folder = str(path.resolve().parent)
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except SystemExit as exc:  # the file ended the process as a script would: it is no model file
        raise TraceError(f"importing {path} called sys.exit({exc.code!r}){_user_line(exc, path)}; a model file is "
                         "imported, not run: put script code under `if __name__ == '__main__':`") from None
    except Exception as exc:  # the user's file failed at import: show where
        raise TraceError(f"importing {path} failed{_user_line(exc, path)}: {one_line(exc)}; fix the file, "
                         "or import its helpers from modules beside it") from None
    finally:
        if folder in sys.path:
            sys.path.remove(folder)
    missing = [f for f in ("build_model", "example_batch") if not callable(getattr(module, f, None))]
    if missing:
        raise TraceError(
            f"{path} must define {' and '.join(f + '()' for f in missing)}: build_model() returns an "
            "nn.Module, example_batch() returns a dict of tensors (the batch shape to compile for)"
        )
    return _reported(module.build_model, path), _reported(module.example_batch, path)


def _reported(fn: Callable, path: Path) -> Callable:
    """`fn` with its exceptions turned into one `TraceError` naming the user's file and line."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except LazytrainError:
            raise
        except (Exception, SystemExit) as exc:  # SystemExit: sys.exit() in model code is no model's answer
            meta = " (at compile time it runs under torch.device('meta'): no tensor holds values)" \
                if fn.__name__ == "build_model" and torch.get_default_device().type == "meta" else ""
            raise TraceError(f"{fn.__name__}() in {path} raised{_user_line(exc, path)}: {one_line(exc)}; "
                             f"fix {fn.__name__}(){meta}") from None
    return call


def _user_line(exc: BaseException, path: Path) -> str:
    """" at model.py:7 `line`": the innermost frame in the user's file or a module beside it."""
    folder = path.resolve().parent
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if Path(f.filename).is_file() and Path(f.filename).resolve().parent == folder]
    if not frames and isinstance(exc, SyntaxError) and exc.filename and exc.lineno:
        return f" at {Path(exc.filename).name}:{exc.lineno}"
    if not frames:
        return ""
    f = frames[-1]
    return f" at {path.with_name(Path(f.filename).name)}:{f.lineno} `{(f.line or '').strip()}`"


def build_on_meta(build_model: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    with torch.device("meta"):
        model = build_model()
    if not isinstance(model, torch.nn.Module):
        raise TraceError(f"build_model() returned {type(model).__name__}, expected a torch.nn.Module")
    return model
