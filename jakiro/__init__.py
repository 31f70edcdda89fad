"""jakiro: lossless speculative decoding with Jakiro and EAGLE-2 drafts."""

__version__ = "0.1.0"

from .api import Jakiro, load  # noqa: E402
from .errors import JakiroError  # noqa: E402
from .settings import DecodeSettings, MethodSettings, Runtime, ServeSettings  # noqa: E402

__all__ = ["DecodeSettings", "Jakiro", "JakiroError", "MethodSettings", "Runtime", "ServeSettings", "load",
           "__version__"]
