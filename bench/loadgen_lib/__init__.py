"""The streaming load generator behind ``bench/loadgen.py`` (see that file for its use).

It shares a small machine with the server, so it is built to cost little CPU: raw sockets
(``trio.open_tcp_stream``), keep-alive connections, a hand-written HTTP/1.1 request writer,
an incremental response parser and SSE parser that do no I/O (sans-IO, tested on byte strings
split at every position by ``tests/test_loadgen_parse.py``), one task per connection sending
the requests and one reactor task reading all responses through a private epoll set. Linux
only (epoll, ``/proc``).

Modules, from the wire up:

* ``http11``: sans-IO HTTP/1.1 request writer and response parser
* ``sse``: sans-IO ``text/event-stream`` parser
* ``openai_api``: request bodies, reading an OpenAI stream's events, error messages
* ``target``: loopback-only URLs, the server's address, connections, a one-shot GET
* ``reactor``: the task that reads and parses the responses of all connections
* ``client``: the clients that send the requests, and what they share
* ``stats``: per-request results, their aggregation, percentiles
* ``procstat``: processes and their CPU time from ``/proc``
* ``runner``: one whole benchmark run
* ``report``: progress line, summary, table, plot
* ``spawn``: ``--spawn-server``
* ``cli``: options and ``main``

and ``smoke``: the ``--smoke`` option of every bench script (tests/test_bench_smoke.py).
"""
