"""A tuning worker process: ``python -m rtcompile.tuning.worker INDEX`` with a JSON job on stdin.

Several run at once on one study (and may run on other hosts against the same storage URL).
Stopped by SIGTERM (the coordinator's ``processes.stop_workers``) or Ctrl-C, a worker kills its trial
process and exits quietly (130): the coordinator says the one line.
"""

from __future__ import annotations

import json
import sys

from .keys import Bucket
from .processes import stop_on_signal
from .study import STUDY_DELETED_EXIT, TuneOptions, run_worker, study_exists


def main() -> int:
    try:
        with stop_on_signal():
            return _work()
    except KeyboardInterrupt:  # its trial process was killed on the way out (TrialRunner's close)
        return 130


def _work() -> int:
    index = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    job = json.loads(sys.stdin.read())
    b = job["bucket"]
    bucket = Bucket(**{**b, "key_widths": tuple(b["key_widths"])})
    opts = TuneOptions(**job["options"])
    try:
        run_worker(job["storage"], job["study"], bucket, opts, index, job.get("deadline"))
    except Exception:
        if not study_exists(job["storage"], job["study"]):
            return STUDY_DELETED_EXIT  # deleted under us (--retune elsewhere): the coordinator says so
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
