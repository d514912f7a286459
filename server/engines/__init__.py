"""The engines a worker process can serve, one package each: ``sim``, ``transformers``, ``vllm``.

An engine is a synchronous step machine (:mod:`server.workers.base`); the worker loop
(:mod:`server.workers.main`) picks one by its ``--engine`` name and drives it.
"""
