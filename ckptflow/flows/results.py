"""Flow options for flows whose return value stays in the process that ran them.

The per-event flows (``promote-part``, ``replicate-part``, ``promote``) return a row (what was
copied, how long it took) that reaches its reader in the same process: a parent flow, the CLI, a
test. What they did is also in the catalog and in the run's logs; nothing reads the return value
back from Prefect. With ``persist_result`` and ``result_storage`` left unset, Prefect asks the server
for its default result storage and its persistence default at the start of every run, after the run
is RUNNING (two requests: 20-60 ms of a part run's wall time on a loaded machine), for a result it
then never writes. Naming both on the flow skips the requests; nothing is persisted either way.
"""

from __future__ import annotations

from typing import Any

from prefect.settings import get_current_settings


def in_memory_result() -> dict[str, Any]:
    """``@flow`` options: the result is not persisted; the storage it would use is named (Prefect's
    own local default, as a path: a block would have to be saved on a server first) so that no run
    asks the server for one."""
    return {"persist_result": False, "result_storage": get_current_settings().results.local_storage_path}
