"""Built-in plugins shipped with the ``asyncflow`` distribution.

Each module here is a plugin (a set of ``@hookimpl`` functions) named in
``asyncflow_core.plugins.manager.BUILTIN_PLUGINS``. Backends import their heavy
dependencies inside their factories so discovery stays cheap.
"""
