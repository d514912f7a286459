"""The frontend <-> worker wire protocol (sans-IO). See :mod:`server.protocol.wire`."""
