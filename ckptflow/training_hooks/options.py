"""The Checkpointer's settings, where the training side and its users import them:
``from ckptflow.training_hooks import CheckpointOptions``.

The class is declared in :mod:`ckptflow.policy.checkpoint_options` (one validated, keyword-only
dataclass; every default and rule written there once) and re-exported here unchanged, because
``ckptflow.yaml``'s ``checkpoint:`` section (:class:`ckptflow.policy.config.CheckpointConfig`) is
generated from it and ``policy`` may not import the training side. The file maps onto it one to one:
every option is ``checkpoint.<name>`` (same name, meaning, default and rule), except
``event_timeout_s``, which is ``prefect.emit_timeout_s`` beside the Prefect API it bounds::

    checkpoint:
      deadline_s: 300
      on_busy: skip
      store: auto
"""

from ckptflow.policy.checkpoint_options import CheckpointOptions

__all__ = ["CheckpointOptions"]
