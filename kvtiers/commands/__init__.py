"""Layer 3: the ``kvtiers`` command and every subcommand with its helpers.

Commands use the engine library (:mod:`kvtiers.engine`) and the SDK (:mod:`kvtiers`); nothing
below them imports a command. Plugins add their own commands through ``register_commands``.
"""
