"""Training: optimizer and schedule, checkpoints, the training loop."""
from tinylm.training.checkpoint import load_checkpoint, save_checkpoint
from tinylm.training.trainer import TrainResult, train

__all__ = ["load_checkpoint", "save_checkpoint", "TrainResult", "train"]
