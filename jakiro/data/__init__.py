"""Datasets and question files read from installed packages or user paths (never copied)."""
