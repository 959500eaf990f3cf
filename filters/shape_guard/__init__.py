"""The ``shape_guard`` filter (``filter``) and the token counting it relies on (``tokens``)."""
