"""ckptd: checkpoint retention for ML training volumes, outside the training process."""

__version__ = "0.1.0"
