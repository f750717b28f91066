"""``python -m bastion`` (and ``torchrun ... -m bastion``): the ``bastion`` command."""

import os
import sys

from bastion.cli.main import main


def _exit(code: int) -> None:
    """Exit with ``code``. A rank of a multi-process launch (``WORLD_SIZE`` > 1) leaves without the
    interpreter's final clean-up, once its output is flushed: its process group is already destroyed,
    and at that clean-up the distributed backend's native threads could still abort the process
    (``terminate called without an active exception``) after a run that had succeeded."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    _exit(main())
