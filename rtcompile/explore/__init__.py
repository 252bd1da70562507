"""Order and width exploration: the MQAR recall task and its trainer (issue 23)."""

from .mqar import MQARTask, make_batch, query_accuracy, split_seeds
from .trainer import RecallResult, TrainSettings, train_recall

__all__ = ["MQARTask", "RecallResult", "TrainSettings", "make_batch", "query_accuracy", "split_seeds", "train_recall"]
