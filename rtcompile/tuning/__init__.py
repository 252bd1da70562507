"""Autotuning (Optuna studies over the kernels' variant spaces, the tuned-config store).

Not built yet: see the tracker's autotuner issue. Nothing here is imported by the rest.
"""
