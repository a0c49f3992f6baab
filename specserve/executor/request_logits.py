"""The runner's per-request logit work: penalties, bias and grammar masks on every target row, and logprobs.

Penalties and grammars need the tokens before each row, and the runner is the only place that
knows them in time: in the overlap loop the scheduler learns step N's tokens after step N+1 was
launched. So the runner keeps, per request slot, the token counts of each request it penalises,
on the device, and the grammar state of each it constrains, on the host: set when a prefill
samples (the whole sequence, also after a retraction), then advanced by every token a decode or
verify step commits, whichever drafter proposed it. The counts advance on the forward stream from
the step's own results (`commit_counts`), so a penalised request never makes the host wait; a
grammar advances on the host (`commit`), so a constrained request does (its next mask depends on
the token). A verify row is shaped as if the window's drafts before it were committed (penalty
counts, grammar state), which they are exactly when the row's token is kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from specserve.executor.step_io import PromptLogprobs, StepInput
from specserve.logits.grammar import GrammarCompiler, GrammarSpec, GrammarState
from specserve.logits.logprobs import DeviceLogprobs, device_logprobs, token_logprobs
from specserve.logits.penalties import seen_tokens, shape_by_counts, token_counts
from specserve.runtime.stream import staged
from specserve.sampling_params import SamplingParams


@dataclass
class WindowDrafts:
    """Per shaped verify row, the drafts before it in its window: the first lens[r] of ids[r]
    (device tokens [n, gamma]; lens known on the host)."""

    ids: torch.Tensor
    lens: list[int]

    def counts(self, rows: list[int], vocab: int) -> torch.Tensor:
        """[len(rows), V] float32: these rows' drafts counted (no read back)."""
        dev = self.ids.device
        ids = self.ids.index_select(0, staged(rows, torch.int64, dev))
        lens = staged([self.lens[r] for r in rows], torch.int64, dev)
        before = torch.arange(ids.shape[1], device=dev).unsqueeze(0) < lens.unsqueeze(1)
        counts = torch.zeros(len(rows), vocab, dtype=torch.float32, device=dev)
        return counts.scatter_add_(1, ids, before.float())

    def host(self) -> list[list[int]]:
        """The drafts as host lists (a read back: a grammar's mask needs them)."""
        return [row[:n] for row, n in zip(self.ids.tolist(), self.lens)]


class _Penalised:
    """A penalised request's token counts on the device: its output's, and its prompt's tokens
    (made at the first shaping, which knows the vocabulary and device)."""

    def __init__(self, prompt: list[int], output: list[int]):
        self.prompt, self.output = prompt, output
        self.counts: Optional[torch.Tensor] = None  # [V] float32
        self.prompt_seen: Optional[torch.Tensor] = None  # [V] bool

    def tensors(self, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self.counts is None or self.prompt_seen is None:
            self.counts = token_counts([self.output], 1, vocab, device)[0]
            self.prompt_seen = seen_tokens([self.prompt], 1, vocab, device)[0]
        return self.counts, self.prompt_seen


Windows = Union[WindowDrafts, Sequence[Sequence[int]]]


class RequestLogits:
    """Token counts and grammar states of the requests whose logits are shaped, and the shaping and
    logprobs of a step's rows."""

    def __init__(self, grammars: Optional[GrammarCompiler] = None) -> None:
        self.grammars = grammars
        self._penalised: dict[int, _Penalised] = {}
        self._states: dict[int, GrammarState] = {}

    def start(self, row: int, params: SamplingParams, fill: Sequence[int], out_len: int) -> None:
        """Slot `row` holds a request whose tokens so far are `fill`, the last `out_len` of them output."""
        cut = len(fill) - out_len
        self._penalised.pop(row, None), self._states.pop(row, None)
        if params.penalises:
            self._penalised[row] = _Penalised(list(fill[:cut]), list(fill[cut:]))
        spec = GrammarSpec.of(params)
        if spec is not None:
            if self.grammars is None:
                raise RuntimeError("a constrained request reached a runner without a grammar compiler")
            self._states[row] = state = self.grammars.state(spec)
            state.commit(fill[cut:])

    def commit(self, row: int, tokens: Sequence[int]) -> None:
        """Host side: a constrained request's grammar advances by its committed tokens."""
        if row in self._states:
            self._states[row].commit(tokens)

    def commit_counts(self, rows: Sequence[int], tokens: torch.Tensor, lens: torch.Tensor) -> None:
        """Forward stream: the penalised requests among `rows` count their committed tokens, the
        first lens[i] of tokens[i] (device values, never read back)."""
        kept = None
        for i, row in enumerate(rows):
            state = self._penalised.get(row)
            if state is None:
                continue
            assert state.counts is not None, "a penalised request's logits were shaped before its tokens commit"
            if kept is None:  # [n, W]: which of each row's tokens were committed
                kept = (torch.arange(tokens.shape[1], device=tokens.device) < lens.unsqueeze(1)).float()
            state.counts.index_put_((tokens[i],), kept[i], accumulate=True)

    @property
    def counts_tokens(self) -> bool:
        """Some request slot counts its tokens (commit_counts has work)."""
        return bool(self._penalised)

    def draft_limits(self, rows: Sequence[int], drafts: list[list[int]]) -> Optional[list[int]]:
        """Verify length per window when a grammar ends some early (1 + the drafts it allows), else None."""
        if not any(row in self._states for row in rows):
            return None
        return [1 + (self._states[row].valid_prefix(d) if row in self._states else len(d)) for row, d in zip(rows, drafts)]

    def shape(
        self, logits: torch.Tensor, rows: Sequence[int], params: Sequence[SamplingParams], windows: Optional[Windows] = None
    ) -> torch.Tensor:
        """logits [n, V], one row per (slot, params) -> the same logits, shaped where a request asks for it.
        `windows[r]`: tokens between the request's committed output and row r (a verify row's drafts)."""
        penalised = [r for r, p in enumerate(params) if p.penalises]
        constrained = [r for r, p in enumerate(params) if p.constrained]
        if not penalised and not constrained:
            return logits
        out = logits.clone()  # never write into a captured step's logits buffer
        if penalised:
            sel = staged(penalised, torch.int64, out.device)
            out.index_copy_(0, sel, self._penalties(logits, rows, params, penalised, sel, windows))
        host_windows: Optional[Sequence[Sequence[int]]] = None  # a grammar's mask needs the drafts as values
        if constrained and windows is not None:
            host_windows = windows.host() if isinstance(windows, WindowDrafts) else windows
        for r in constrained:
            allowed = self._states[rows[r]].mask_after(host_windows[r] if host_windows else ())
            out[r].masked_fill_(~allowed.to(out.device), float("-inf"))
        return out

    def _penalties(
        self, logits, rows, params, penalised: list[int], sel: torch.Tensor, windows: Optional[Windows]
    ) -> torch.Tensor:
        """The penalised rows' (indices `penalised`, on the device `sel`) shaped logits, from the
        device counts (plus each row's drafts)."""
        vocab, device = logits.shape[1], logits.device
        counts, seen = zip(*(self._penalised[rows[r]].tensors(vocab, device) for r in penalised))
        total = torch.stack(counts)
        if isinstance(windows, WindowDrafts):
            total = total + windows.counts(penalised, vocab)
        elif windows:
            total = total + token_counts([windows[r] for r in penalised], len(penalised), vocab, device)
        shaped = shape_by_counts(logits.index_select(0, sel), [params[r] for r in penalised], total, torch.stack(seen))
        return shaped.to(logits.dtype)

    def shape_windows(
        self,
        logits: torch.Tensor,
        rows: Sequence[int],
        params: Sequence[SamplingParams],
        ids: torch.Tensor,
        layout: list[tuple[int, int]],
    ) -> torch.Tensor:
        """A verify step's logits (rows per `layout`), each row shaped after the drafts before it in its
        window `ids` [bs, W]; untouched (and no host work) when no request shapes its logits."""
        if not any(p.shapes_logits for p in params):
            return logits
        drafts = ids[:, 1:].index_select(0, staged([i for i, _ in layout], torch.int64, ids.device))
        windows = WindowDrafts(drafts, [j for _, j in layout])
        return self.shape(logits, [rows[i] for i, _ in layout], [params[i] for i, _ in layout], windows)

    @staticmethod
    def record_logprobs(
        indices: Sequence[int], logits: torch.Tensor, params: Sequence[SamplingParams], tokens: torch.Tensor
    ) -> Optional[DeviceLogprobs]:
        """A decode or prefill step's logprobs (one token per row, `tokens` on the device) of the
        rows whose request asks, by request index (`indices[r]`); None when none asks."""
        wanted = [r for r, p in enumerate(params) if p.logprobs]
        if not wanted:
            return None
        sel = staged(wanted, torch.int64, logits.device)
        top = [params[r].top_logprobs for r in wanted]
        return device_logprobs(logits.index_select(0, sel), tokens.index_select(0, sel), top, [indices[r] for r in wanted])

    @staticmethod
    def window_logprobs(
        params: Sequence[SamplingParams], logits: torch.Tensor, layout: list[tuple[int, int]], out_tokens: torch.Tensor
    ) -> Optional[DeviceLogprobs]:
        """A verify step's logprobs: row (i, j) of `layout` predicted window column j's token,
        out_tokens[i, j] (an accepted draft or the bonus, when committed: DeviceLogprobs.read
        keeps the columns below each request's commit length)."""
        picked = [r for r, (i, _) in enumerate(layout) if params[i].logprobs]
        if not picked:
            return None
        dev = logits.device
        req, col = [layout[r][0] for r in picked], [layout[r][1] for r in picked]
        tokens = out_tokens[staged(req, torch.int64, dev), staged(col, torch.int64, dev)]
        rows = logits.index_select(0, staged(picked, torch.int64, dev))
        return device_logprobs(rows, tokens, [params[i].top_logprobs for i in req], req, col)

    @staticmethod
    def prompt_logprobs(into: dict[int, PromptLogprobs], step: StepInput, logits: torch.Tensor) -> torch.Tensor:
        """A prefill step computed every row of the requests scoring their prompt: record the logprobs
        of the prompt tokens those rows predict (raw logits: no penalties apply inside a prompt) and
        return the logits of each sampling request's last row, as a plain prefill has them."""
        kept, offset = [], 0
        for i, (p, n, sampled) in enumerate(zip(step.prefix_lens, step.extend_lens, step.sample)):
            if not step.prompt_logprobs[i]:
                kept += [offset] if sampled else []
                offset += 1 if sampled else 0
                continue
            fill = step.fills[i]
            assert fill is not None, "the batch fills in the tokens of every request scoring its prompt"
            prompt_len = len(fill) - step.out_lens[i]
            scored = min(n, prompt_len - 1 - p)  # row p + k predicts token p + k + 1, while in the prompt
            if scored > 0:
                top = step.params[i].top_logprobs
                into[i] = PromptLogprobs(
                    p + 1, token_logprobs(logits[offset : offset + scored], fill[p + 1 : p + 1 + scored], [top] * scored)
                )
            kept += [offset + n - 1] if sampled else []
            offset += n
        return logits[kept]


def verify_row_layout(bs: int, width: int, keep: Optional[torch.Tensor]) -> list[tuple[int, int]]:
    """(request, window column) of each row of a verify step's logits: every row, or the kept ones packed."""
    if keep is None:
        return [(i, j) for i in range(bs) for j in range(width)]
    return [tuple(ij) for ij in keep.nonzero().tolist()]
