"""Batch tasks' path lists skip Prefect's walk over their elements (flows/runners.py)."""

from __future__ import annotations

from prefect.utilities.annotations import quote

from ckptflow.flows.runners import quoted_if_plain


def test_a_flat_list_of_plain_values_is_quoted_and_unwraps_to_the_same_list() -> None:
    paths = [f"__{i}_0.distcp" for i in range(512)]
    quoted = quoted_if_plain(paths)
    assert isinstance(quoted, quote)
    assert quoted.unquote() is paths  # the task receives the list itself
    assert isinstance(quoted_if_plain(("a", 1, 2.0, True, None)), quote)


def test_anything_that_could_hold_a_future_or_state_is_left_for_prefect_to_resolve() -> None:
    class NotPlain:
        pass

    mixed = ["a", NotPlain()]
    nested = [["a"], ["b"]]
    mapping = {"a": "b"}
    for value in (mixed, nested, mapping, "a string", 3, None):
        assert quoted_if_plain(value) is value
