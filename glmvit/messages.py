"""How a value appears in a one-line error message. Standard library only: argument parsing uses it before any
heavy import."""
from __future__ import annotations

from typing import Any


def shown(value: Any, limit: int = 60) -> str:
    """``repr(value)`` for an error message, cut in the middle past ``limit`` characters (one line, readable)."""
    try:
        text = str(value) if isinstance(value, BaseException) else repr(value)
    except (ValueError, RecursionError):  # an int past Python's 4300-digit limit, a structure nested too deeply
        text = f"<a {type(value).__name__} too large to show>"
    text = text.replace("\n", " ")
    length = len(value) if isinstance(value, str) else len(text)
    return text if len(text) <= limit else f"{text[: limit // 2]}…{text[-limit // 4:]} ({length:,} characters)"
