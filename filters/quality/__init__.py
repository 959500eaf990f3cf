"""The ``quality`` filter (``filter``) and its helpers: image ``signals``, ``text`` signals,
image-text ``align``ment, input ``drift``, ``graded`` degradation, the per-input ``report``."""
