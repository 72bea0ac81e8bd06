"""What the catalog says, for people: ``ckptflow status`` (:mod:`.status`), the bill (:mod:`.cost`),
the drill's quality gates (:mod:`.quality_gates`) and the drill history (:mod:`.drill_history`)."""
