"""``python -m bastion`` (and ``torchrun ... -m bastion``): the ``bastion`` command."""

import sys

from bastion.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
