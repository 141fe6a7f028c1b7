"""The shared core, below serving and the trainer: what both use (model loading, devices, the
draft vocabulary, errors, artifact formats of datastores, knowledge bases, past sessions and the
router). Installed as ``specops.core``; it imports nothing from ``specops.serving``,
``specops.trainer`` or ``specops.specops`` commands."""
