"""Training: optimizer and schedule, precision, data parallelism, exact resume, the training loop."""

from tinylm.training.trainer import TrainResult, train

__all__ = ["TrainResult", "train"]
