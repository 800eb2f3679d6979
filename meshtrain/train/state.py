"""Moved to :mod:`meshtrain.state` (the state sits below the Trainer and the checkpoints, so neither
imports the other's package); this name stays for existing imports."""

from meshtrain.state import TrainState, abstract_train_state, init_state, state_shardings  # noqa: F401
