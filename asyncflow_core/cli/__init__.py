"""The ``asyncflow`` command line."""
