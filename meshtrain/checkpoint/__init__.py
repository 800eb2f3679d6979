"""Checkpoints: Orbax async sharded saves, a checksum manifest per step, retention, and restore onto
any plan (another recipe, mesh or device count reshards on load)::

    from meshtrain.checkpoint import Checkpointer
    ckpt = Checkpointer(run_dir / "checkpoints", save_every=100, keep_last=3, keep_every=1000)
    ckpt.maybe_save(step, state, data_state={"index": 4096}, metadata={"recipe": plan.recipe.to_dict()})
    r = ckpt.restore(plan)          # Restored(step, state, data_state, metadata)
    ckpt.require_resumable()        # latest valid step, None for an empty folder, or NoValidCheckpoint

Nothing here deletes a step that has not been verified: a damaged step is moved aside
(``<step>.corrupt``) when its step is saved again, and retention removes only verified old steps.

See :mod:`meshtrain.checkpoint.integrity` for the on-disk layout and how steps are verified.

One module per job: ``manager`` (the :class:`Checkpointer` facade), ``saving`` (the save path),
``donation`` (the CPU donation worker of ``background_start``), ``restoring`` (reading a step onto a
plan), ``retention`` (which steps to delete: a pure function), ``integrity`` (manifests, checks),
``housekeeping`` (writer lock, background deletes), ``layout`` and ``inspection`` (the saved tree).
"""

from meshtrain.lazy_exports import lazy_exports

# Loaded on first use (PEP 562): `meshtrain.checkpoint.peer_folders` and the types load without JAX.
_EXPORTS = {
    **{name: "meshtrain.checkpoint.inspection" for name in ("inspect_checkpoint", "list_checkpoints",
                                                            "resolve_directory")},
    "Checkpointer": "meshtrain.checkpoint.manager",
    **{name: "meshtrain.checkpoint.types" for name in ("CheckpointError", "CheckpointWarning", "Compression",
                                                       "NoValidCheckpoint", "Restored", "SaveResult", "StepCheck",
                                                       "StepStatus", "Verify")},
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
