"""Checkpoint storage: checksums, the manifest contract, atomic commit and the on-disk layout.

Nothing here imports torch, SQL or Prefect: these modules are shared by the training process, the
catalog, the CLI and the pipeline.
"""
