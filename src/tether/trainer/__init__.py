"""The trainer: the loop, its phases, checkpoints, guards and logging."""

from tether.signals import TrainingInterrupted
from tether.trainer.guards import TrainingStopped
from tether.trainer.trainer import Trainer

__all__ = ["Trainer", "TrainingInterrupted", "TrainingStopped"]
