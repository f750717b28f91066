"""The ``bastion`` command line."""
