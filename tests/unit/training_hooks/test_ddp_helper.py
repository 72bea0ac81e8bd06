"""ddp_for_exact_resume refuses the DDP options that make a resume inexact (its exactness at 4 ranks:
tests/integration/training_hooks/test_exact_resume_4_ranks.py)."""

from __future__ import annotations

import pytest
import torch

from ckptflow.training_hooks import ddp_for_exact_resume


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"find_unused_parameters": False}, "find_unused_parameters"), ({"static_graph": True}, "static_graph")],
)
def test_ddp_for_exact_resume_refuses_options_that_change_the_reduction(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ddp_for_exact_resume(torch.nn.Linear(2, 2), **kwargs)
