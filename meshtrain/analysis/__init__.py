"""Seeing a run before it runs: collectives from compiled HLO, memory, hardware, the planner."""

from meshtrain.analysis.collectives import Collective, hlo_collectives, summarize

__all__ = ["Collective", "hlo_collectives", "summarize"]
