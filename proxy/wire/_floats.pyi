"""Types of the compiled JSON number writer (``_floats.c``)."""

from typing import Any

def join(values: Any, /) -> bytes: ...
