"""Drafters: propose a TokenTree of continuations each step."""

from .base import Drafter
from .model_tree import ModelTreeDrafter

__all__ = ["Drafter", "ModelTreeDrafter"]
