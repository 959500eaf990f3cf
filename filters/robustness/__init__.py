"""Robustness experiments of the shadow: perturbed copies of mirrored calls judged against clean
ones (``config``, ``perturb``, ``experiment``), and the release verdict that reads them
(``verdict``)."""
