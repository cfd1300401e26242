"""Module replacement from outside the model: a copy of a module tree in which some modules are
replaced by others (kernels/, inference/recording.py's attention recording), sharing every parameter
and buffer under the same names, so state_dict keys and values stay as they are and the original tree
is left untouched."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from torch import nn

M = TypeVar("M", bound=nn.Module)


def replaced(module: M, replace: Callable[[nn.Module], nn.Module | None]) -> M:
    """The tree of `module` with replace(m) in place of each module m for which it gives one (its
    children replaced in turn), and a shallow copy of every other module."""
    new = replace(module)
    new = shallow_copy(module) if new is None else new
    for name, child in list(new.named_children()):
        new._modules[name] = replaced(child, replace)
    return new


def shallow_copy(module: nn.Module, cls: type[M] | None = None, **attributes: object) -> M:
    """A new module of `cls` (default: the module's own class, or a subclass that adds behaviour, not
    state) holding the same parameters, buffers and children, with `attributes` set on it."""
    cls = type(module) if cls is None else cls
    new = cls.__new__(cls)
    new.__dict__.update(module.__dict__)
    # its own dictionaries: registering on the copy never changes the original
    new._parameters, new._buffers, new._modules = (
        dict(module._parameters),
        dict(module._buffers),
        dict(module._modules),
    )
    for name, value in attributes.items():
        setattr(new, name, value)
    return new
