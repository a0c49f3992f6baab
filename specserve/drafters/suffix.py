"""SUFFIX: model-free drafts from suffix matches over the request's tokens and earlier outputs
(SuffixDecoding; speculative/suffix_worker.py); its hint is the matched-suffix bucket and how many
tokens its walk found, a lookup per request, asked only where the plan may depend on it."""

from typing import Any

from specserve.drafters.declaration import Drafter, Hints
from specserve.errors import ConfigError
from specserve.names import SuffixScope

SCOPES = tuple(s.value for s in SuffixScope)  # plain strings: argparse lists its choices by repr


def check_flags(args: Any) -> None:
    if args.speculative_suffix_max_tree_depth < 2:
        raise ConfigError(f"speculative_suffix_max_tree_depth must be >= 2, got {args.speculative_suffix_max_tree_depth}")
    if args.speculative_suffix_cache_tokens < 0:
        raise ConfigError(f"speculative_suffix_cache_tokens must be >= 0, got {args.speculative_suffix_cache_tokens}")
    if args.speculative_suffix_scope not in SCOPES:
        raise ConfigError(f"speculative_suffix_scope must be one of {SCOPES}, got {args.speculative_suffix_scope!r}")
    if not (args.speculative_suffix_max_spec_factor > 0 and 0 <= args.speculative_suffix_min_token_prob <= 1):
        raise ConfigError("speculative_suffix_max_spec_factor must be > 0 and speculative_suffix_min_token_prob in [0, 1]")


DRAFTER = Drafter.lookup(
    "SUFFIX",
    "suffix matches over the request's tokens and earlier outputs",
    "specserve.speculative.suffix_worker:make_worker",
    # per matched-suffix bucket (none, 2-3, 4-7, 8-15, 16+); a walk that found nothing drafts nothing
    priors=(0.0, 0.3, 0.45, 0.6, 0.7),
    hints=Hints.ON_DEMAND,
    caps_drafts=True,
    check=check_flags,
)
