"""ckptflow: checkpoints that survive the failures that scale makes certain.

The training-side API lives in :mod:`ckptflow.training_hooks`; the checkpoint format (manifest,
checksums, atomic commit) in :mod:`ckptflow.storage`; the SQL catalog in :mod:`ckptflow.catalog`.
"""

__version__ = "0.1.0"
