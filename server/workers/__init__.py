"""Engine worker processes: the loop (``main``, or ``listen`` as a network service) and what
every engine shares (``base``, ``prepare``, ``pulse``); the engines are in :mod:`server.engines`."""
