"""The answer to exercise 4, through the project's own code: model/positions.py's
Sinusoidal (its embed hook adds the table to √d·x; given zeros, it is the table)."""
import torch

from model.config import ModelConfig
from model.positions import Sinusoidal


def sinusoidal_positions(T, d, start=0):
    encoding = Sinusoidal(ModelConfig(n_embd=d, n_head=1)).double()
    return encoding.embed(torch.zeros(1, T, d, dtype=torch.float64), start)[0]
