"""Prefect tasks: thin wrappers over the plain functions of :mod:`ckptflow.pipeline`.

Every task takes a config path and names (never live clients: Prefect would try to hash them), works
on a batch of files (never one file per task), and uses ``cache_policy=NO_CACHE``: checkpoint data
changes underneath, so a cached result would be a lie.
"""
