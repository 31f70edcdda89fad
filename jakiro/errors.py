"""User-facing error type: anything raised as JakiroError is printed as one line by the CLI."""


class JakiroError(Exception):
    """A problem with the user's input or environment, reported without a traceback."""
