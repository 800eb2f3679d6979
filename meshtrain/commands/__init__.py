"""Sub-commands of the ``meshtrain`` CLI: one module each, with ``add_parser(sub)`` and ``run(args)``."""
