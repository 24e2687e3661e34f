"""``treeattn simulate``: the cost model (:mod:`treeattn.cost`) of one decode step at cluster scale.

Where things are:

- the formulas, the decode-step model, the presets and profiles: :mod:`treeattn.cost`
  (``formulas``, ``model``, ``presets``, ``profile``), shared with ``auto``;
- :mod:`.calibrate`: fit a cluster's constants to ``treeattn bench latency`` rows;
- :mod:`.report`: the markdown tables, the paper's headline case, the CSV/JSON files;
- :mod:`.plots`: the PNG plots;
- :mod:`.cli`: the ``treeattn simulate`` flags and handler.

This module re-exports the names earlier versions had here.
"""

from ...cost.formulas import (
    allgather_recursive_doubling,
    allgather_ring,
    allreduce_ring,
    allreduce_tree,
    attention_time,
    hierarchical_allgather,
    ring_p2p_time,
)
from ...cost.model import DTYPE_BYTES, PREDICTED, STATE_BYTES, TREE_STRATEGIES, Cluster, breakdown, predict
from ...cost.presets import PRESET_GRID, PRESETS
from .calibrate import Calibration, calibrate, holdout_report
from .cli import add_parser, run
from .report import PAPER_CASE
from .report import headline as _headline

__all__ = [
    "DTYPE_BYTES",
    "PAPER_CASE",
    "PRESETS",
    "PRESET_GRID",
    "STATE_BYTES",
    "PREDICTED",
    "TREE_STRATEGIES",
    "Calibration",
    "Cluster",
    "add_parser",
    "allgather_recursive_doubling",
    "allgather_ring",
    "allreduce_ring",
    "allreduce_tree",
    "attention_time",
    "breakdown",
    "calibrate",
    "hierarchical_allgather",
    "holdout_report",
    "predict",
    "ring_p2p_time",
    "run",
    "_headline",
]
