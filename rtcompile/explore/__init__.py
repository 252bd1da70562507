"""``rtcompile explore``: order and width trade-offs side by side -- state bytes, prefill and
decode speed, and (with ``recall``) multi-query associative recall -- with the Pareto front.

:mod:`.points` the options and the grid, :mod:`.sweep` the figures and the Optuna study that
runs, resumes and distributes the points, :mod:`.report` the table, JSON, CSV and plots;
:mod:`.mqar` the recall task, :mod:`.trainer` the model trained on it.
"""

from .mqar import MQARTask, make_batch, query_accuracy, split_seeds
from .points import MATCH_MODES, MATCH_TOLERANCE, Point, RecallOptions, SweepOptions, make_points
from .report import pareto_front, write_report
from .sweep import SpeedMode, SweepResult, run_sweep, speed_mode
from .trainer import RecallResult, TrainSettings, train_recall

__all__ = ["MATCH_MODES", "MATCH_TOLERANCE", "MQARTask", "Point", "RecallOptions", "RecallResult", "SpeedMode",
           "SweepOptions", "SweepResult", "TrainSettings", "make_batch", "make_points", "pareto_front",
           "query_accuracy", "run_sweep", "speed_mode", "split_seeds", "train_recall", "write_report"]
