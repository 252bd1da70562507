"""Autotuning: Optuna studies over the kernels' variant spaces, and the tuned-config store.

``tune_bucket`` runs (or resumes, or skips) the study of one kernel and shape bucket with
worker processes; each trial is checked against the float64 reference and timed in a child
process. Winners go to the tuned-config table that the launchers read
(:mod:`rtcompile.kernels.tuned`). Loading a model or a bundle never runs a study.
"""

from .keys import Bucket, Machine, study_name
from .space import device_refusal_of_space, refusal
from .store import StoreError, default_url, open_storage
from .study import BucketResult, TuneOptions, list_studies, search_space, tune_bucket

__all__ = ["Bucket", "BucketResult", "Machine", "StoreError", "TuneOptions", "default_url", "device_refusal_of_space",
           "list_studies", "open_storage", "refusal", "search_space", "study_name", "tune_bucket"]
