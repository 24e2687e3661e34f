"""Reductions of attention states over a ProcessGroup, topology, validation, meter.

Knows nothing about attention beyond "reduce these states over this group"."""

from .collectives import CollectiveError
from .meter import CommMeter, metering
from .strategies import STRATEGIES, LinkModel, auto_model, choose_strategy, reduce_states, strategy_costs
from .topology import Topology

__all__ = [
    "STRATEGIES",
    "CollectiveError",
    "CommMeter",
    "LinkModel",
    "Topology",
    "auto_model",
    "choose_strategy",
    "metering",
    "reduce_states",
    "strategy_costs",
]
