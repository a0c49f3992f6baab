"""Drafter training by self-distillation (the DeepSpec recipe).

Each step samples sequences from the corpus and several anchors S per sequence (inside the
response). A block is `[x_S, M, .., M]` at positions S..S+g-1 attending to the drafter context of
positions < S (from the target's captured hidden states) and bidirectionally inside itself,
exactly as at serving time (`DsparkDrafter.block_hidden`), so training and drafting share
`DraftLayer`. Slot k predicts x_{S+k+1}; the Markov head is teacher-forced (prev_k = x_{S+k}).

loss = sum_k w_k (0.1 CE + 0.9 TV + 1.0 BCE(c_k, 1 - TV_k)) / sum_k w_k,  w_k = exp(-k / 4)

TV is measured against the teacher's top-k (the rest of its mass lumped as one bucket): a lower
bound of the full TV, exact when the tails agree.
"""

from __future__ import annotations

import math
import os
import random
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

import torch
import torch.nn.functional as F

from specserve.errors import ConfigError
from specserve.models.dspark import DsparkConfig, DsparkDrafter
from specserve.train.corpus import Corpus, Sequence
from specserve.train.vocab_loss import picked_log_probs

CE_WEIGHT, TV_WEIGHT, CONF_WEIGHT = 0.1, 0.9, 1.0
POSITION_DECAY = 4.0
CHECKPOINT_FILE = "checkpoint.pt"


@dataclass
class TrainConfig:
    steps: int = 2000
    seqs_per_step: int = 16
    anchors_per_seq: int = 12
    lr: float = 1e-3
    warmup: int = 50
    weight_decay: float = 0.0
    seed: int = 0
    checkpoint_every: int = 100
    max_minutes: Optional[float] = None


@dataclass
class Blocks:
    """One training batch: A blocks of g slots in each of B padded sequences.

    The blocks of one sequence are grouped, so its context K/V is computed once and every block's
    queries attend to it under a mask (context columns < the block's anchor, and its own block).
    """

    hidden: torch.Tensor  # [B, T, L*H] target hidden states (context)
    anchors: torch.Tensor  # [B, A] S (0 for padding blocks)
    block_ids: torch.Tensor  # [B, A, g] x_S, M, .., M
    labels: torch.Tensor  # [B, A, g] x_{S+k+1}
    prev: torch.Tensor  # [B, A, g] x_{S+k} (teacher-forced Markov input)
    valid: torch.Tensor  # [B, A, g] label inside the sequence (False for padding blocks)
    top_ids: torch.Tensor  # [B, A, g, K]
    top_probs: torch.Tensor  # [B, A, g, K]


def make_blocks(seqs: list[Sequence], g: int, anchors_per_seq: int, mask_id: int, rng: random.Random) -> Blocks:
    """Up to `anchors_per_seq` anchors per sequence, drawn without replacement from its answer
    positions (0 or less: every answer position)."""
    T = max(len(s.ids) for s in seqs)
    chosen = []
    for s in seqs:
        candidates = range(s.prompt_len, len(s.ids) - 1)  # S with at least one label
        n = len(candidates) if anchors_per_seq <= 0 else min(anchors_per_seq, len(candidates))
        chosen.append(sorted(rng.sample(candidates, n)))
    B, A, k_top = len(seqs), max(len(c) for c in chosen), seqs[0].top_ids.shape[1]
    hidden = torch.zeros(B, T, seqs[0].hidden.shape[1], dtype=seqs[0].hidden.dtype)
    anchors = torch.zeros(B, A, dtype=torch.int64)
    block_ids = torch.full((B, A, g), mask_id, dtype=torch.int64)
    labels = torch.zeros(B, A, g, dtype=torch.int64)
    prev = torch.zeros(B, A, g, dtype=torch.int64)
    valid = torch.zeros(B, A, g, dtype=torch.bool)
    top_ids = torch.zeros(B, A, g, k_top, dtype=torch.int64)
    top_probs = torch.zeros(B, A, g, k_top)
    for b, (s, starts) in enumerate(zip(seqs, chosen)):
        hidden[b, :len(s.ids)] = s.hidden
        n = len(starts)
        S = torch.tensor(starts, dtype=torch.int64)
        anchors[b, :n] = S
        block_ids[b, :n, 0] = s.ids[S]
        k = torch.arange(g)
        label_pos = S.unsqueeze(1) + 1 + k  # [n, g]
        ok = label_pos < len(s.ids)
        valid[b, :n] = ok
        labels[b, :n] = torch.where(ok, s.ids[label_pos.clamp(max=len(s.ids) - 1)], 0)
        prev[b, :n] = torch.where(ok, s.ids[(label_pos - 1).clamp(max=len(s.ids) - 1)], 0)
        rows = (label_pos - 1 - s.prompt_len).clamp(max=s.top_ids.shape[0] - 1)  # teacher row r predicts r + 1
        top_ids[b, :n] = s.top_ids[rows] * ok.unsqueeze(-1)
        top_probs[b, :n] = s.top_probs[rows] * ok.unsqueeze(-1)
    return Blocks(hidden, anchors, block_ids, labels, prev, valid, top_ids, top_probs)


def training_dtype() -> torch.dtype:
    """bf16 (autocast) where the CPU multiplies bf16 natively (AVX512-BF16, which AMX CPUs have
    too); float32 elsewhere, where torch's bf16 matmuls are emulated and a small fraction of its
    float32 speed (`bench train-speed --dtypes float32,bfloat16` measures both)."""
    from specserve.kernels.dispatch import available_paths

    return torch.bfloat16 if "avx512_bf16" in available_paths() else torch.float32


class DrafterLoss:
    """Computes the recipe's loss and its parts for a batch of blocks, in the frozen weights'
    dtype: bf16 under autocast, or float32 throughout."""

    def __init__(self, drafter: DsparkDrafter, embed_weight: torch.Tensor, head_weight: torch.Tensor):
        self.drafter = drafter
        self.dtype = head_weight.dtype
        self.embed_weight = embed_weight  # frozen target embedding
        self.head_weight = head_weight  # frozen target LM head (its draft-vocabulary rows)
        self.target_to_draft = None  # target id -> draft id, -1 outside the draft vocabulary
        if drafter.reduced_vocab:
            d2t = drafter.draft_to_target
            self.head_weight = head_weight[d2t].contiguous()
            self.target_to_draft = torch.full((drafter.config.vocab_size,), -1, dtype=torch.int64)
            self.target_to_draft[d2t] = torch.arange(len(d2t))

    def autocast(self):
        """The precision context of a forward: bf16 autocast, or none for float32."""
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.dtype == torch.bfloat16)

    def to_draft(self, target_ids: torch.Tensor) -> torch.Tensor:
        return target_ids if self.target_to_draft is None else self.target_to_draft[target_ids]

    def block_hidden(self, blk: Blocks) -> torch.Tensor:
        """Final-normed hidden states of every block slot, [B, A, g, H]: the serving computation
        (`DraftLayer`), with each sequence's blocks side by side over one shared context."""
        d = self.drafter
        B, T, _ = blk.hidden.shape
        _, A, g = blk.block_ids.shape
        ctx = d.context(blk.hidden.view(B * T, -1).to(self.dtype))  # the teacher's states are cached in bf16
        ctx_cos, ctx_sin = d.rope.cos_sin(torch.arange(T).repeat(B), ctx.dtype)
        positions = (blk.anchors.unsqueeze(-1) + torch.arange(g)).reshape(-1)
        cos, sin = d.rope.cos_sin(positions, ctx.dtype)
        x = F.embedding(blk.block_ids.reshape(-1), self.embed_weight).to(ctx.dtype).view(B, A * g, -1)
        mask = self._mask(blk, ctx.dtype)  # [B, 1, A*g, T + A*g]: the same for every layer
        for layer in d.layers:
            k, v = layer.context_kv(ctx, ctx_cos, ctx_sin)
            x = layer(x, k.view(B, T, *k.shape[1:]), v.view(B, T, *v.shape[1:]), mask, cos, sin, d.ops)
        return d.norm(x).view(B, A, g, -1)

    @staticmethod
    def _mask(blk: Blocks, dtype: torch.dtype) -> torch.Tensor:
        """[B, 1, A*g, T + A*g] additive: slot (a, j) sees context t < S_a and the slots of block a."""
        B, T, _ = blk.hidden.shape
        _, A, g = blk.block_ids.shape
        ctx_ok = (torch.arange(T).view(1, 1, T) < blk.anchors.unsqueeze(-1))  # [B, A, T]
        ctx_ok = ctx_ok.unsqueeze(2).expand(B, A, g, T).reshape(B, A * g, T)
        block_of = torch.arange(A).repeat_interleave(g)
        own = (block_of.view(-1, 1) == block_of.view(1, -1)).expand(B, A * g, A * g)
        keep = torch.cat([ctx_ok, own], -1)
        return torch.zeros(keep.shape, dtype=dtype).masked_fill_(~keep, float("-inf")).unsqueeze(1)

    def __call__(self, blk: Blocks, hidden: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict[str, float]]:
        d = self.drafter
        g = blk.block_ids.shape[-1]
        hidden = self.block_hidden(blk) if hidden is None else hidden  # [B, A, g, H]
        h = hidden[blk.valid]  # [P, H]
        prev = d.markov_w1(blk.prev[blk.valid])  # [P, r]
        labels = blk.labels[blk.valid]
        draft_labels = self.to_draft(labels).unsqueeze(1)
        top = self.to_draft(blk.top_ids[blk.valid])
        ids = torch.cat([draft_labels, top], 1)  # -1: outside the draft vocabulary, masked below
        logq, pick = picked_log_probs(h, prev, self.head_weight, d.markov_w2.weight, ids.clamp(min=0))
        in_vocab = ids >= 0  # a label outside the draft vocabulary cannot be drafted: no CE
        ce = -logq[:, 0] * in_vocab[:, 0]
        q_top = logq[:, 1:].exp() * in_vocab[:, 1:]
        p_top = blk.top_probs[blk.valid]
        tv = 0.5 * ((p_top - q_top).abs().sum(1) + ((1 - p_top.sum(1)) - (1 - q_top.sum(1))).abs())
        conf_logit = d.confidence(torch.cat([h, prev], -1)).float().squeeze(-1)
        bce = F.binary_cross_entropy_with_logits(conf_logit, (1 - tv).detach().clamp(0, 1), reduction="none")
        slot = torch.arange(g).expand(blk.valid.shape)[blk.valid]
        w = torch.exp(-slot.float() / POSITION_DECAY)
        loss = (w * (CE_WEIGHT * ce + TV_WEIGHT * tv + CONF_WEIGHT * bce)).sum() / w.sum()
        hit = d.to_target(pick) == labels
        return loss, {"loss": float(loss.detach()), "ce": float(ce.detach().mean()), "tv": float(tv.detach().mean()),
                      "bce": float(bce.detach().mean()), "top1": float(hit.float().mean()), "positions": int(h.shape[0])}


@torch.no_grad()
def teacher_forced_accept_length(loss: DrafterLoss, corpus: Corpus, g: int, mask_id: int, seed: int = 1,
                                 anchors_per_seq: int = 16) -> dict[str, float]:
    """Greedy accept length on held-out sequences if the target's tokens were those of the corpus,
    at random anchors: 1 + the run of leading slots whose Markov-decoded argmax equals the label
    (the chain uses the drafter's own picks, as at serving time). `serving_walk.py` places the
    anchors where serving does instead."""
    if not corpus.sequences:
        return {"accept_length": None, "blocks": 0, "per_slot_survival": []}
    rng = random.Random(seed)
    d = loss.drafter
    lengths, per_slot = [], torch.zeros(g)
    for start in range(0, len(corpus.sequences), 16):
        blk = make_blocks(corpus.sequences[start:start + 16], g, anchors_per_seq, mask_id, rng)
        with loss.autocast():
            hidden = loss.block_hidden(blk)
            base = F.linear(hidden, loss.head_weight).float()
        real = blk.valid[..., 0]  # padding blocks have no label at all
        base, labels, valid = base[real], blk.labels[real], blk.valid[real]
        prev = blk.block_ids[real][:, 0]
        run = torch.ones(len(prev), dtype=torch.bool)
        accepted = torch.zeros(len(prev))
        for k in range(g):
            pick = d.to_target((base[:, k] + d.markov_w2(d.markov_w1(prev)).float()).argmax(-1))
            run = run & (pick == labels[:, k]) & valid[:, k]
            per_slot[k] += float(run.sum())
            accepted += run.float()
            prev = pick
        lengths.append(accepted + 1)
    all_lengths = torch.cat(lengths)
    return {"accept_length": float(all_lengths.mean()), "blocks": len(all_lengths),
            "per_slot_survival": [round(float(x) / len(all_lengths), 4) for x in per_slot]}


def train(drafter: DsparkDrafter, loss: DrafterLoss, corpus, cfg: TrainConfig, out_dir: str,
          on_step: Callable[[int, dict[str, float], float], None], resume_from: Optional[dict] = None,
          start_step: int = 0) -> int:
    """Run cfg.steps steps (or until cfg.max_minutes) after `start_step`, or after the step of
    `resume_from` (a `load_checkpoint` result, which also restores the optimizer and the rng);
    checkpoints to out_dir; returns the last step. `corpus`: a `Corpus` or a `TeacherCorpus`."""
    torch.manual_seed(cfg.seed)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    step, rng = start_step, random.Random(cfg.seed)
    ckpt = os.path.join(out_dir, CHECKPOINT_FILE)
    if resume_from is not None:
        drafter.load_state_dict(resume_from["drafter"], strict=False)
        opt.load_state_dict(resume_from["optimizer"])
        step = resume_from["step"]
        rng.setstate(resume_from["rng"])
    first, start = step, time.perf_counter()
    g, mask_id = drafter.config.block_size, drafter.config.mask_token_id
    sequence = corpus.sequence if hasattr(corpus, "sequence") else corpus.sequences.__getitem__
    while step - first < cfg.steps:
        if cfg.max_minutes is not None and time.perf_counter() - start > cfg.max_minutes * 60:
            break
        # Cosine over this run's budget: steps, or the wall-time budget when that runs out first.
        progress = (step - first) / cfg.steps
        if cfg.max_minutes is not None:
            progress = max(progress, (time.perf_counter() - start) / (cfg.max_minutes * 60))
        lr = cfg.lr * min(1.0, (step - first + 1) / cfg.warmup) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        for group in opt.param_groups:
            group["lr"] = lr
        picks = rng.sample(range(len(corpus)), min(cfg.seqs_per_step, len(corpus)))
        blk = make_blocks([sequence(i) for i in picks], g, cfg.anchors_per_seq, mask_id, rng)
        with loss.autocast():
            value, parts = loss(blk)
        opt.zero_grad(set_to_none=True)
        value.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        on_step(step, parts, lr)
        if step % cfg.checkpoint_every == 0:
            save_checkpoint(ckpt, drafter, opt, step, rng)
    save_checkpoint(ckpt, drafter, opt, step, rng, finished=True)
    return step


def save_checkpoint(path: str, drafter: DsparkDrafter, opt, step: int, rng: random.Random,
                    finished: bool = False) -> None:
    """Tensors and plain values only (the optimizer's state dict, the step, the rng state as a
    tuple of ints), so that `load_checkpoint` reads it with weights_only=True: no pickled objects.
    `finished` marks a run's last checkpoint: its run wrote a record, which a resume must find."""
    tmp = path + ".tmp"
    torch.save({"drafter": {k: v for k, v in drafter.state_dict().items() if not k.startswith("rope.")},
                "optimizer": opt.state_dict(), "step": step, "rng": rng.getstate(), "finished": finished}, tmp)
    os.replace(tmp, path)  # a crash mid-save leaves the previous checkpoint intact


def load_checkpoint(path: str) -> dict:
    """A checkpoint written by `save_checkpoint`, read with weights_only=True (a checkpoint that
    needs arbitrary unpickling is refused, not executed)."""
    try:
        state = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # unpickling refused or a damaged file: one clear line for --resume
        raise ConfigError(f"--resume: cannot read {path} as a weights-only checkpoint: "
                         f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    missing = {"drafter", "optimizer", "step", "rng"} - set(state if isinstance(state, dict) else ())
    if missing:
        raise ConfigError(f"--resume: {path} is not a drafter checkpoint (missing {sorted(missing)})")
    return state


def init_from_target(drafter: DsparkDrafter, target_weights: Mapping[str, torch.Tensor], layer: int) -> None:
    """Start every draft layer from a target decoder layer (same widths) and the Markov head at
    zero, so the untrained drafter already predicts with the target's head."""
    p = f"model.layers.{layer}."
    names = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
             "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
             "down_proj": "mlp.down_proj", "input_layernorm": "input_layernorm",
             "post_attention_layernorm": "post_attention_layernorm"}
    with torch.no_grad():
        for draft_layer in drafter.layers:
            for ours, theirs in names.items():
                w = target_weights.get(f"{p}{theirs}.weight")
                if w is not None and w.shape == getattr(draft_layer, ours).weight.shape:
                    getattr(draft_layer, ours).weight.copy_(w.float())
        drafter.markov_w2.weight.zero_()


def choose_draft_vocab(corpus, vocab_size: int, size: int, always: tuple[int, ...] = (),
                       held_out: Optional[Corpus] = None) -> tuple[torch.Tensor, float]:
    """The `size` target ids the target emits most in the corpus (answers and teacher top-1),
    plus `always` (e.g. stop tokens), sorted; returns them and the share of `held_out`'s answer
    tokens (default: the corpus's) they cover. `corpus`: a `Corpus` or a `TeacherCorpus`."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for answer, top1 in _answers_and_top1(corpus):
        counts += torch.bincount(answer, minlength=vocab_size)
        counts += torch.bincount(top1, minlength=vocab_size)
    counts[list(always)] = int(counts.max()) + 1
    ids = torch.sort(torch.argsort(counts, descending=True, stable=True)[:size]).values
    responses = torch.cat([a for a, _ in _answers_and_top1(held_out or corpus)])
    return ids, float(torch.isin(responses, ids).float().mean())


def _answers_and_top1(corpus):
    if hasattr(corpus, "answers_and_top1"):
        yield from corpus.answers_and_top1()
        return
    for s in corpus.sequences:
        yield s.ids[s.prompt_len:], s.top_ids[:, 0]


def drafter_config_for(target_cfg, num_layers: int, block_size: int, markov_rank: int,
                       num_context_layers: int, mask_token_id: int) -> DsparkConfig:
    return DsparkConfig.for_target(target_cfg, num_layers=num_layers, block_size=block_size, markov_rank=markov_rank,
                                   num_context_layers=num_context_layers, mask_token_id=mask_token_id)
