"""``rtcompile explore``: order and width trade-offs side by side -- state bytes, prefill and
decode speed, and (with ``recall``) multi-query associative recall -- with the Pareto front.

:mod:`.points` the options and the grid, :mod:`.sweep` the figures and the Optuna study that
runs, resumes and distributes the points, :mod:`.report` the table, JSON, CSV and plots.
"""

from .points import MATCH_MODES, MATCH_TOLERANCE, Point, RecallOptions, SweepOptions, make_points
from .report import pareto_front, write_report
from .sweep import SpeedMode, SweepResult, run_sweep, speed_mode

__all__ = ["MATCH_MODES", "MATCH_TOLERANCE", "Point", "RecallOptions", "SpeedMode", "SweepOptions", "SweepResult",
           "make_points", "pareto_front", "run_sweep", "speed_mode", "write_report"]
