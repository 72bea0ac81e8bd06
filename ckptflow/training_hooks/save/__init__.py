"""Stage 1 of a checkpoint's life, a save: the copy into reused host buffers (:mod:`.staging`, with
the CUDA ordering in :mod:`.stream_ops`), the node-local plan (:mod:`.planner`), this rank's files
written with a CRC per file and per item (:mod:`.writer`), and the background job that runs the
write and hands over to the commit (:mod:`.job`).
"""
