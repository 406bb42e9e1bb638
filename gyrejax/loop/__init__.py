"""The RL loop (`Runtime`): dispatch, training steps, role transitions, publication and
outputs, driven by a scheduling policy on the real cells. See runtime.py."""

from gyrejax.loop.engines import CellEngines, PublishedWeights
from gyrejax.loop.runtime import Runtime

__all__ = ["CellEngines", "PublishedWeights", "Runtime"]
