"""The public surface of ``server`` is explicit, complete, and cheap for worker processes."""

import subprocess
import sys

import server


def test_every_public_name_resolves():
    for name in server.__all__:
        assert getattr(server, name) is not None
    assert set(server.__all__) >= {
        "open_engine", "EngineConfig", "SamplingParams", "RequestOutput", "RequestStream",
        "create_app", "serve", "ServerError", "ClientError", "EngineError",
    }


def test_unknown_name_is_an_attribute_error():
    try:
        server.no_such_thing  # noqa: B018 - the attribute lookup is the test
    except AttributeError:
        pass
    else:
        raise AssertionError("expected AttributeError")


def test_a_worker_process_does_not_import_trio_or_http():
    code = (
        "import sys, server.workers.main; "
        "print(sorted(m for m in ('trio', 'quart', 'hypercorn') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
