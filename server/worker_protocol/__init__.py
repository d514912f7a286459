"""The frontend <-> worker wire protocol (sans-IO). See :mod:`server.worker_protocol.wire`."""
