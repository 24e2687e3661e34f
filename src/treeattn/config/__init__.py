"""Typed settings, the leaf every layer may import: frozen dataclasses checked when made, their
command-line options generated from the fields, agreed across ranks by a digest of every field."""

from .fields import add_arguments, encode, flatten, from_args, setting
from .settings import ATTENTIONS, PLACEMENTS, PREFILLS, SPECULATE, STRATEGIES, Layout, Sampling, Serving, Speculation

__all__ = ["ATTENTIONS", "PLACEMENTS", "PREFILLS", "SPECULATE", "STRATEGIES", "Layout", "Sampling", "Serving",
           "Speculation", "add_arguments", "encode", "flatten", "from_args", "setting"]  # fmt: skip
