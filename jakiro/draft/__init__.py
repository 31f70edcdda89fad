"""Draft models (EAGLE core and Jakiro MoE heads) and their checkpoint format."""

from .config import DraftConfig
from .model import DraftModel, DraftOutput
from .checkpoint import load_draft, save_draft

__all__ = ["DraftConfig", "DraftModel", "DraftOutput", "load_draft", "save_draft"]
