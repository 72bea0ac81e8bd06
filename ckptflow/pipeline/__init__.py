"""The pipeline's plain logic, one module per stage of a checkpoint's life after its commit, with no
Prefect in it: a node's part to warm (:mod:`.part`, :mod:`.part_job`, :mod:`.part_catch_up`), its
replicas on peers (:mod:`.replicate`), the central promotion hop by hop (:mod:`.promote`, :mod:`.admission`),
retention (:mod:`.retention`, :mod:`.node_retention`), reconcile, scrub and recovery drills
(:mod:`.reconcile`, :mod:`.scrub`, :mod:`.drill`, :mod:`.drill_body`), and what they share: leases
(:mod:`.leases`, :mod:`.lease_cleanup`), the tiers of a config (:mod:`.tiers`), progress and data-time
accounting (:mod:`.progress`, :mod:`.data_time`). :mod:`.report` turns the catalog into what people
read (status, cost, quality gates, drill history).

``ckptflow.tasks`` wraps these in Prefect tasks and ``ckptflow.flows`` arranges the tasks; tests call
these functions directly, without a Prefect server.
"""
