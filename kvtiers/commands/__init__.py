"""Layer 3: the ``kvtiers`` command (:mod:`kvtiers.commands.cli`) and every subcommand with
its helpers, one module or folder per command: ``demo/``, ``simulate/``, ``bench/``,
``events``, ``new/``; shared helpers ``progress``, ``plot``, ``tinymodel``.

Commands use the engine library (:mod:`kvtiers.engine`) and the SDK (:mod:`kvtiers`); nothing
below them imports a command. Plugins add their own commands through ``register_commands``.
"""
