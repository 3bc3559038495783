"""``python -m kvtiers_p2p serve|keygen``: the commands of ``kvtiers p2p``, without loading
every plugin's commands first (what :func:`kvtiers_p2p.spawn.start_server` runs)."""

import sys

from .cli import p2p

if __name__ == "__main__":
    sys.exit(p2p.main(prog_name="python -m kvtiers_p2p"))
