"""Argument checks shared by the public entry points."""
from torch import nn


def module(value, name: str = "model") -> None:
    """A TypeError naming the argument where an nn.Module is expected (None or a string otherwise failed deep
    inside, with an AttributeError naming neither)."""
    if not isinstance(value, nn.Module):
        raise TypeError(f"{name}: expected an nn.Module, got {type(value).__name__}")
