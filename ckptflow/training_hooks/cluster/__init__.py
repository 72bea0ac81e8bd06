"""Who the job is: ranks and their collectives (:mod:`.ranks`), the nodes that share a hot root
(:mod:`.nodes`), and the coordination store the background commit talks through (:mod:`.coord_store`).

Every stage of a checkpoint's life (save, commit, restore) uses these; none of them is a stage.
"""
