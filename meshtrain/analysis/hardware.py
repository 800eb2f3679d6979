"""The hardware profiles live in :mod:`meshtrain.hardware` (the Trainer reads peaks from them too);
re-exported here for the planner and existing imports."""

from meshtrain.hardware import *  # noqa: F401,F403
from meshtrain.hardware import PROFILES, Hardware, get_hardware, hardware_names, measure_cpu  # noqa: F401
