"""`pagedserve generate`: one prompt in, completions out, in process or from a gateway (--server)."""
from __future__ import annotations

import argparse
import json
import sys

from pagedserve.engine_config import EngineConfig, add_engine_flags
from pagedserve.wire.protocol import SamplingParams


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt",
                       description="Generate completions for one prompt with the offline engine.")
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--chat", action="store_true",
                   help="treat the prompt as a user message rendered with the model's chat template")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens at most (default: 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 is off")
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    p.add_argument("--n", type=int, default=1,
                   help="completions to generate; with --beam-width, the n best beams (default: 1)")
    p.add_argument("--beam-width", type=int, default=1,
                   help="beam search with this many beams (default: 1, no beam search)")
    p.add_argument("--length-penalty", type=float, default=1.0,
                   help="beam search: score = sum of logprobs / length ** this (default: 1.0)")
    p.add_argument("--early-stopping", action="store_true",
                   help="beam search: stop once beam-width hypotheses have finished")
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object per completion instead of streaming text")
    p.add_argument("--server", metavar="ADDR", default=None,
                   help="generate on a running gateway (host:port) instead of in process; "
                        "--model then names the served model and the engine flags are ignored")
    add_engine_flags(p)
    p.set_defaults(run=run)


def run(args) -> int:
    sampling = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, seed=args.seed, n=args.n, stop=args.stop,
        ignore_eos=args.ignore_eos, beam_width=args.beam_width, length_penalty=args.length_penalty,
        early_stopping=args.early_stopping,
    )
    try:
        sampling.validate()
    except ValueError as e:
        print(f"pagedserve generate: {e}", file=sys.stderr)
        return 2
    if args.server:
        return _run_remote(args, sampling)
    from pagedserve.gateway.request_intake import RequestError
    from pagedserve.engine import LLMEngine

    from pagedserve.executor.errors import ModelLoadError

    try:
        engine = LLMEngine(EngineConfig.from_args(args))
    except (ValueError, ModelLoadError) as e:  # a bad flag, or a model that cannot be loaded
        print(f"pagedserve generate: {e}", file=sys.stderr)
        return 2
    try:
        engine.add_request(args.prompt, sampling, chat=args.chat, request_id="cli")
        return print_stream(engine.stream(), args)
    except RequestError as e:
        print(f"pagedserve generate: {e}", file=sys.stderr)
        return 2
    finally:
        engine.close()


def _run_remote(args, sampling: SamplingParams) -> int:
    import grpc

    from pagedserve.client import GenerationClient

    with GenerationClient(args.server) as client:
        try:
            return print_stream(client.generate(args.prompt, sampling, chat=args.chat,
                                                model=args.model or ""), args)
        except grpc.RpcError as e:
            print(f"pagedserve generate: {e.details() or e.code().name}", file=sys.stderr)
            return 2 if e.code() == grpc.StatusCode.INVALID_ARGUMENT else 1


def print_stream(deltas, args) -> int:
    """Print deltas as they come (one completion) or at the end (--json, --n > 1)."""
    results: dict[int, dict] = {}
    for delta in deltas:
        r = results.setdefault(delta.index, {"index": delta.index, "text": "", "token_ids": []})
        r["text"] += delta.text
        r["token_ids"] += delta.token_ids
        r.update(prompt_tokens=delta.prompt_tokens, completion_tokens=delta.completion_tokens,
                 cached_tokens=delta.cached_tokens)
        if delta.finish_reason:
            r["finish_reason"] = delta.finish_reason
        if delta.error:
            print(f"pagedserve generate: {delta.error}", file=sys.stderr)
            return 1
        if not args.json and args.n == 1:
            print(delta.text, end="", flush=True)
    if args.json:
        for i in sorted(results):
            print(json.dumps(results[i]))
    elif args.n > 1:
        for i in sorted(results):
            print(f"--- completion {i} ({results[i].get('finish_reason')})\n{results[i]['text']}")
    else:
        print()
    return 0
