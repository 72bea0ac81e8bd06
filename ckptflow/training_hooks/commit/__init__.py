"""Stage 2 of a checkpoint's life, the commit: the two-level commit's messages over the coordination
store (:mod:`.protocol`), what it writes (:mod:`.files`: rank reports, ``.metadata``, the manifest,
``PART.json``), the catalog record of a committed checkpoint (:mod:`.record`, written through
:mod:`.catalog_handle`) and the staged event that starts the pipeline (:mod:`.announce`).
"""
