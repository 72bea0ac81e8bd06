"""The last stage of a checkpoint's life, its restore at every start: what every node holds
(:mod:`.inventory`), where a missing part can come from (:mod:`.sources`: peer replicas), the fetch
onto this node's disk (:mod:`.fetch`), the verified single-pass read (:mod:`.reader`) and the
collective loop over candidate steps (:mod:`.attempts`).
"""
