"""Fronts: wire protocol in, ``Call`` to the data plane, wire protocol out."""
