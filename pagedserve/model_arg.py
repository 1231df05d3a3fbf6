"""MODEL as a positional argument, as in `vllm serve MODEL`: every command that has a
`--model` flag (serve, generate, executor, the bench commands) also takes it positionally.
Both set the one setting (pagedserve.executor.config.ExecutorConfig.model); given both, the later on
the command line wins, as with any flag given twice."""
from __future__ import annotations

import argparse


def add_model_positionals(parser: argparse.ArgumentParser) -> list[str]:
    """Add the positional MODEL to `parser` and every subcommand under it that has `--model`
    and no positional of its own; returns their prog names."""
    added = []
    actions = parser._actions
    model = next((a for a in actions if "--model" in a.option_strings), None)
    if model is not None and not any(not a.option_strings for a in actions):
        parser.add_argument("model", nargs="?", default=argparse.SUPPRESS, metavar="MODEL",
                            help="same as --model: " + (model.help or ""))
        added.append(parser.prog)
    for action in actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in {id(p): p for p in action.choices.values()}.values():
                added += add_model_positionals(sub)
    return added
