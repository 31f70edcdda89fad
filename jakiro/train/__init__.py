"""Training drafts: dataset building, losses, the trainer."""
