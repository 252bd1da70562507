"""Print the ten best timed trials of every study in an Optuna store: python3 benchmarks/study_top.py URL."""
import sys

import optuna

optuna.logging.set_verbosity(optuna.logging.WARNING)
url = sys.argv[1]
for s in optuna.get_all_study_summaries(url):
    st = optuna.load_study(study_name=s.study_name, storage=url)
    done = sorted((t for t in st.trials if t.value is not None), key=lambda t: t.value)
    print(s.study_name.split(":src")[0], len(done), "timed of", len(st.trials))
    for t in done[:10]:
        print("  %.2f us" % (t.value * 1e6), t.params)
