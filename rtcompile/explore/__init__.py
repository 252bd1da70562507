"""Order and width exploration: the MQAR recall task and its trainer (issue 23)."""

from .mqar import MQARTask, make_batch, query_accuracy, split_seeds

__all__ = ["MQARTask", "make_batch", "query_accuracy", "split_seeds"]
