"""``python -m ckptflow.cli``: the ``ckptflow`` command where no console script is installed."""

from ckptflow.cli.base import main

if __name__ == "__main__":
    main()
