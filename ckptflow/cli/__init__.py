"""The ``ckptflow`` command line: the console script ``ckptflow``, or ``python -m ckptflow.cli``.

One module per group of commands, each registering itself on :data:`app`:

- :mod:`.base`: the typer app and ``ls``, ``verify``, ``cadence``, ``catalog sync``
- :mod:`.pipeline`: ``services up|down|status``, ``promote``, ``agent``, ``reconcile``, ``scrub``
- :mod:`.retention`: ``retention plan|apply``, ``cost``
- :mod:`.drill`: ``drill run|history``
- :mod:`.status`: ``status``; :mod:`.restore`: ``restore``; :mod:`.import_checkpoint`: ``import``;
  :mod:`.plan`: ``plan``

and what they share: :mod:`.errors` (how every command reports bad input: one line, exit 2) and
:mod:`.progress` (transfer progress bars).
"""

from ckptflow.cli.base import app, main

__all__ = ["app", "main"]
