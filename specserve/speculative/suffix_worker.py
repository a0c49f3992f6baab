"""SUFFIX: model-free drafts from suffix matches over the request's own tokens and over the
outputs of the requests before it (SuffixDecoding; the index: speculative/suffix_index.py).

Each request has an index over its prompt and output (kept with its RequestTokens, brought up to
date when it is asked for a hint or a draft); the engine has one global index over finished
requests' outputs, bounded by `cache_tokens` (the oldest outputs evicted first). A draft
is whichever of the two walks scores higher (its probabilities' sum, SuffixDecoding's choice; a
sampled request drafts from its own tokens only, so that its seeded tokens, which depend on the
drafts, do not depend on the requests before it),
at most `spec_factor` x the suffix matched, each token kept while its path holds at least
`min_prob` of the matched occurrences. Everything here is a function of the committed tokens in
commit order, which every tensor-parallel rank sees alike (a slot's output enters the global index
when the slot's next request starts), so the ranks' indexes and drafts agree without a collective;
the adaptive plan that uses them is rank 0's (speculative/policy.py).

The global index is shared by every request, so under `scope="request"` it is neither fed nor
read: a greedy request's speed (its accepted drafts) would otherwise reveal whether another
tenant's earlier output continued its text (docs/server.md, Security).

With a token table the drafts can be computed on the device instead (`drafts_on_device`, CUDA's
choice: speculative/suffix_device.py), the same walk over the same tokens (the earlier outputs
as of two launches back), so a launch never waits for the last step's tokens; the host indexes
then only give the adaptive policy its hints.
On CPU the host walk is the cheaper one (a few list reads against some hundred tensor ops).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Optional, Sequence

import torch

from specserve.errors import ConfigError
from specserve.names import Algorithm, SuffixScope
from specserve.runtime.stream import staged
from specserve.speculative.committed import RequestTokens, TokenTable
from specserve.speculative.suffix_device import DeviceDraft, DeviceSegments, WalkLimits, walk
from specserve.speculative.suffix_index import SuffixDraft, SuffixIndex
from specserve.speculative.worker import DraftContext, DraftInput, Drafts, WorkerDefaults

# The policy's hint buckets by the suffix matched (0: nothing to draft), like NGRAM's match lengths.
MATCH_BUCKETS = (2, 4, 8, 16)


# ServerArgs' fields of SuffixConfig's, in its order
SUFFIX_FLAGS = tuple(
    f"speculative_suffix_{n}" for n in ("max_tree_depth", "max_spec_factor", "min_token_prob", "cache_tokens", "scope")
)


@dataclass
class SuffixConfig:
    """The SUFFIX flags (SGLang/vLLM names; ServerArgs checks their ranges): tree depth, spec
    factor, token floor, the global index's budget, and whose tokens a draft may come from."""

    max_depth: int = 24
    spec_factor: float = 1.0
    min_prob: float = 0.1
    cache_tokens: int = 1 << 20
    scope: str = SuffixScope.GLOBAL

    def __post_init__(self) -> None:
        scopes = tuple(s.value for s in SuffixScope)
        if self.scope not in scopes:  # a typo must not quietly share outputs between requests
            raise ConfigError(f"speculative_suffix_scope must be one of {scopes}, got {self.scope!r}")

    @property
    def shares_outputs(self) -> bool:
        """Whether finished outputs are kept in the global index and drafted from."""
        return self.scope == SuffixScope.GLOBAL

    @staticmethod
    def of(args: object) -> "SuffixConfig":
        """From ServerArgs' SUFFIX flags."""
        return SuffixConfig(*(getattr(args, f) for f in SUFFIX_FLAGS))


class _Slot:
    """One request's index (of its RequestTokens' tokens) and its latest draft."""

    def __init__(self, max_depth: int):
        self.index = SuffixIndex(max_depth)
        self.draft: Optional[tuple[int, int, bool, SuffixDraft]] = None  # (tokens seen, gamma, global?, draft)

    def catch_up(self, tokens: list[int]) -> "_Slot":
        """Index the request's tokens committed since the last call."""
        if len(tokens) > len(self.index.tokens):
            self.index.extend(tokens[len(self.index.tokens) :])
        return self


class SuffixWorker(WorkerDefaults):
    """The SUFFIX drafter behind the worker seam (speculative/worker.py)."""

    name = Algorithm.SUFFIX
    reads_tokens = True

    def __init__(
        self,
        gamma: int,
        config: Optional[SuffixConfig] = None,
        token_table: Optional[TokenTable] = None,
        drafts_on_device: Optional[bool] = None,
    ):
        """drafts_on_device (needs token_table; None: on CUDA): draft from the device's tokens."""
        if gamma < 1:
            raise ConfigError(f"speculative_num_steps: must be >= 1, got {gamma}")
        self.gamma, self.config = gamma, config or SuffixConfig()
        self.global_index = SuffixIndex(self.config.max_depth)
        self._table = token_table
        self.segments = DeviceSegments(token_table.tokens.device) if token_table is not None else None
        if drafts_on_device is None:
            drafts_on_device = token_table is not None and token_table.tokens.device.type == "cuda"
        self.drafts_on_device = drafts_on_device  # chosen before the first request (the device state starts there)
        self._last_launch = 0

    @property
    def drafts_on_device(self) -> bool:
        return self._on_device

    @drafts_on_device.setter
    def drafts_on_device(self, on: bool) -> None:
        self._on_device = on
        self.advances = on  # the device segments drain as each step begins (`advance`)
        self.tokens_early = not on  # drafting from the host indexes needs the last step's tokens before the next launch

    @property
    def token_table(self) -> Optional[TokenTable]:
        """The request tokens on the device, when the drafts are walked there (CommitPath writes a
        table only while some drafter reads it)."""
        return self._table if self.drafts_on_device else None

    def advance(self, launch: Optional[int]) -> None:
        """Forward stream, every planned step: the device segments take the changes due by this
        launch, so they are never held back while nobody drafts with SUFFIX; the launch is the
        latest a later change (`forget_outputs`' clear) may be stamped with: the segments refuse
        one older than what they have released."""
        if launch is not None:
            self._last_launch = max(self._last_launch, launch)
        if self.drafts_on_device and self.segments is not None:
            self.segments.held(launch)

    # ------------------------------------------------------------ drafting

    def slot(self, request: RequestTokens) -> _Slot:
        """The request's index, up to date with its tokens."""
        return request.state(self.name, partial(_Slot, self.config.max_depth)).catch_up(request.tokens)

    def proposal(self, request: RequestTokens, gamma: int, use_global: bool = True) -> SuffixDraft:
        """The request's draft for its committed tokens so far (computed once per step and kept:
        the policy's hint and the drafting read the same); use_global: past outputs may draft."""
        slot = self.slot(request)
        key = (len(slot.index.tokens), gamma, use_global)
        if slot.draft is not None and slot.draft[:3] == key:
            return slot.draft[3]
        cfg = self.config
        context = slot.index.tokens[-cfg.max_depth - 1 :]
        best = slot.index.draft(context, gamma, cfg.min_prob, cfg.spec_factor)
        if use_global and cfg.shares_outputs:
            past = self.global_index.draft(context, gamma, cfg.min_prob, cfg.spec_factor)
            best = past if past.score > best.score else best
        slot.draft = (*key, best)
        return best

    def hints(self, requests: Sequence[RequestTokens], greedy: Optional[list[bool]] = None) -> list[tuple[int, int]]:
        """Per request (match bucket, tokens drafted): what the adaptive policy prices SUFFIX by;
        greedy[i]: request i decodes greedily (None: all do)."""
        out = []
        for i, request in enumerate(requests):
            d = self.proposal(request, self.gamma, greedy is None or greedy[i])
            out.append((sum(d.match_len >= b for b in MATCH_BUCKETS) if d.tokens else 0, len(d.tokens)))
        return out

    def draft(self, inp: DraftInput) -> Drafts:
        if self.drafts_on_device:
            return Drafts(self._device_draft(inp).filled(inp.anchors))
        proposals = []
        for request, anchor, params in zip(inp.requests, inp.anchors.tolist(), inp.params):
            toks = list(self.proposal(request, inp.gamma, params.is_greedy).tokens)
            fill = toks[-1] if toks else anchor  # past the walk: never verified by a plan that knows its length
            proposals.append(toks + [fill] * (inp.gamma - len(toks)))
        return Drafts(torch.tensor(proposals, dtype=torch.int64, device=inp.anchors.device))

    def _device_draft(self, inp: DraftInput) -> DeviceDraft:
        """The host proposal's walk on the device (suffix_device.py): the request's own tokens from
        the token table, the earlier outputs from the device segments (as of two launches back)."""
        assert self.token_table is not None and self.segments is not None, "drafts_on_device needs a token table"
        table, cfg = self.token_table, self.config
        width = min(inp.context_bound() + 1, table.scratch)
        own = table.tokens[inp.rows, :width]
        limits = WalkLimits(cfg.max_depth, cfg.spec_factor, cfg.min_prob)
        if inp.launch is not None:
            self._last_launch = max(self._last_launch, inp.launch)
        best = walk(own, inp.prefix_lens + 1, own, inp.prefix_lens, inp.gamma, limits)
        if not cfg.shares_outputs:
            return best
        past_tokens = self.segments.held(inp.launch)  # applies the host's changes due by this launch
        greedy = [p.is_greedy for p in inp.params]
        if past_tokens.shape[0] < 2 or not any(greedy):
            return best
        n = own.shape[0]
        searched = past_tokens.unsqueeze(0).expand(n, -1)
        visible = torch.full((n,), past_tokens.shape[0], dtype=torch.int64, device=own.device)
        past = walk(searched, visible, own, inp.prefix_lens, inp.gamma, limits)
        take = past.beats(best) & staged(greedy, torch.bool, own.device)
        return best.choose(past, take)

    # ------------------------------------------------------------ commits

    def retire(self, row: int, done: RequestTokens, launch: int) -> None:
        """The slot's previous request's output into the global index (within its budget), and
        the same change told to the device segments (at `launch`, the next request's commit)."""
        self._last_launch = max(self._last_launch, launch)
        if self.config.cache_tokens == 0 or not self.config.shares_outputs:
            return
        output = done.output[-self.config.cache_tokens :]
        if len(output) < 2:
            return
        index, segments = self.global_index, self.segments if self.drafts_on_device else None
        index.append_segment(output)
        if segments is not None:
            segments.change(launch, "append", output)
        while len(index) > self.config.cache_tokens:
            base = index.base
            index.evict_oldest()
            if segments is not None:
                segments.change(launch, "evict", index.base - base)

    def forget_outputs(self) -> None:
        """Empty the global index (a benchmark's fresh start; slots' own indexes stay)."""
        self.global_index = SuffixIndex(self.config.max_depth)
        if self.segments is not None and self.drafts_on_device:  # after every change told so far
            self.segments.change(self._last_launch, "clear")


def make_worker(ctx: DraftContext) -> SuffixWorker:
    return SuffixWorker(ctx.gamma, SuffixConfig.of(ctx.args), ctx.token_table)
