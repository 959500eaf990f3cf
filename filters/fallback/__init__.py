"""The ``fallback`` filter (``filter``): breakers (``breaker``) per level, lighter routes, the
answer cache; its admin routes (``admin``)."""
