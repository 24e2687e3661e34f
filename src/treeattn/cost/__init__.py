"""One cost model of decode: collective formulas, the decode-step model, built-in clusters
and calibrated profiles. Used by ``auto`` (:mod:`treeattn.comm.strategies`) and by
``treeattn simulate``; imports only torch-free stdlib code, below ``comm`` and ``parallel``."""

from .model import PREDICTED, TREE_STRATEGIES, Cluster, breakdown, choose, predict, reduction_costs
from .presets import PRESETS, default_cluster
from .profile import ENV_VAR, Profile, ProfileError, load_profile, resolve, save_profile

__all__ = [
    "ENV_VAR",
    "PRESETS",
    "PREDICTED",
    "TREE_STRATEGIES",
    "Cluster",
    "Profile",
    "ProfileError",
    "breakdown",
    "choose",
    "default_cluster",
    "load_profile",
    "predict",
    "reduction_costs",
    "resolve",
    "save_profile",
]
