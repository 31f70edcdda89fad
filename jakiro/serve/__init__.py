"""OpenAI-compatible HTTP serving: request parsing, a one-at-a-time scheduler, metrics, the app."""
