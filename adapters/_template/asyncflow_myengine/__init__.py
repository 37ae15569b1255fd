"""asyncflow adapter ``myengine``: a RolloutEngine template to copy and rename.

The plugin module (``plugin.py``) is what the ``asyncflow`` entry point names;
it imports only the cheap ``config`` module, so ``asyncflow plugins`` lists
this engine without importing torch. The engine itself is in ``engine.py``.
"""
