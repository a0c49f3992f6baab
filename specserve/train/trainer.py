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
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from specserve.models.dspark import DsparkConfig, DsparkDrafter
from specserve.train.corpus import Corpus, Sequence

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
    """One training batch: n blocks of g slots over B padded sequences."""

    hidden: torch.Tensor  # [B, T, L*H] target hidden states (context)
    seq_of_block: torch.Tensor  # [n]
    anchors: torch.Tensor  # [n] S
    block_ids: torch.Tensor  # [n, g] x_S, M, .., M
    labels: torch.Tensor  # [n, g] x_{S+k+1}
    prev: torch.Tensor  # [n, g] x_{S+k} (teacher-forced Markov input)
    valid: torch.Tensor  # [n, g] label inside the sequence
    top_ids: torch.Tensor  # [n, g, K]
    top_probs: torch.Tensor  # [n, g, K]


def make_blocks(seqs: list[Sequence], g: int, anchors_per_seq: int, mask_id: int, rng: random.Random) -> Blocks:
    T = max(len(s.ids) for s in seqs)
    hidden = torch.zeros(len(seqs), T, seqs[0].hidden.shape[1], dtype=seqs[0].hidden.dtype)
    rows = []  # (seq index, S)
    for b, s in enumerate(seqs):
        hidden[b, :len(s.ids)] = s.hidden
        candidates = range(s.prompt_len, len(s.ids) - 1)  # S with at least one label
        rows += [(b, S) for S in rng.sample(candidates, min(anchors_per_seq, len(candidates)))]
    n, k_top = len(rows), seqs[0].top_ids.shape[1]
    block_ids = torch.full((n, g), mask_id, dtype=torch.int64)
    labels = torch.zeros(n, g, dtype=torch.int64)
    prev = torch.zeros(n, g, dtype=torch.int64)
    valid = torch.zeros(n, g, dtype=torch.bool)
    top_ids = torch.zeros(n, g, k_top, dtype=torch.int64)
    top_probs = torch.zeros(n, g, k_top)
    for i, (b, S) in enumerate(rows):
        s = seqs[b]
        m = min(g, len(s.ids) - 1 - S)  # slots with a label
        block_ids[i, 0] = s.ids[S]
        labels[i, :m] = s.ids[S + 1:S + 1 + m]
        prev[i, :m] = s.ids[S:S + m]
        valid[i, :m] = True
        top_ids[i, :m] = s.top_ids[S - s.prompt_len:S - s.prompt_len + m]
        top_probs[i, :m] = s.top_probs[S - s.prompt_len:S - s.prompt_len + m]
    seq_of_block = torch.tensor([b for b, _ in rows])
    anchors = torch.tensor([S for _, S in rows])
    return Blocks(hidden, seq_of_block, anchors, block_ids, labels, prev, valid, top_ids, top_probs)


class DrafterLoss:
    """Computes the recipe's loss and its parts for a batch of blocks."""

    def __init__(self, drafter: DsparkDrafter, embed_weight: torch.Tensor, head_weight: torch.Tensor):
        self.drafter = drafter
        self.embed_weight = embed_weight  # frozen target embedding
        self.head_weight = head_weight  # frozen target LM head (its draft-vocabulary rows)
        self.target_to_draft = None  # target id -> draft id, -1 outside the draft vocabulary
        if drafter.reduced_vocab:
            d2t = drafter.draft_to_target
            self.head_weight = head_weight[d2t].contiguous()
            self.target_to_draft = torch.full((drafter.config.vocab_size,), -1, dtype=torch.int64)
            self.target_to_draft[d2t] = torch.arange(len(d2t))

    def to_draft(self, target_ids: torch.Tensor) -> torch.Tensor:
        return target_ids if self.target_to_draft is None else self.target_to_draft[target_ids]

    def block_hidden(self, blk: Blocks) -> torch.Tensor:
        d = self.drafter
        B, T, _ = blk.hidden.shape
        n, g = blk.block_ids.shape
        ctx = d.context(blk.hidden.view(B * T, -1))
        ctx_cos, ctx_sin = d.rope.cos_sin(torch.arange(T).repeat(B), ctx.dtype)
        positions = (blk.anchors.unsqueeze(1) + torch.arange(g)).reshape(-1)
        cos, sin = d.rope.cos_sin(positions, ctx.dtype)
        x = F.embedding(blk.block_ids.reshape(-1), self.embed_weight).to(ctx.dtype).view(n, g, -1)
        keep = torch.cat([torch.arange(T).unsqueeze(0) < blk.anchors.unsqueeze(1), torch.ones(n, g, dtype=torch.bool)], 1)
        mask = torch.zeros(keep.shape, dtype=ctx.dtype).masked_fill_(~keep, float("-inf")).view(n, 1, 1, -1)
        for layer in d.layers:
            k, v = layer.context_kv(ctx, ctx_cos, ctx_sin)
            k, v = k.view(B, T, *k.shape[1:]), v.view(B, T, *v.shape[1:])
            x = layer(x, k[blk.seq_of_block], v[blk.seq_of_block], mask, cos, sin)
        return d.norm(x)

    def __call__(self, blk: Blocks) -> tuple[torch.Tensor, dict[str, float]]:
        d = self.drafter
        n, g = blk.block_ids.shape
        hidden = self.block_hidden(blk)  # [n, g, H]
        h = hidden[blk.valid]  # [P, H]
        prev = d.markov_w1(blk.prev[blk.valid])  # [P, r]
        logits = F.linear(h, self.head_weight).float() + d.markov_w2(prev).float()
        logq = torch.log_softmax(logits, -1)
        labels = blk.labels[blk.valid]
        draft_labels = self.to_draft(labels)
        in_vocab = draft_labels >= 0  # a label outside the draft vocabulary cannot be drafted: no CE
        ce = -logq.gather(1, draft_labels.clamp(min=0).unsqueeze(1)).squeeze(1) * in_vocab
        top = self.to_draft(blk.top_ids[blk.valid])
        q_top = logq.gather(1, top.clamp(min=0)).exp() * (top >= 0)
        p_top = blk.top_probs[blk.valid]
        tv = 0.5 * ((p_top - q_top).abs().sum(1) + ((1 - p_top.sum(1)) - (1 - q_top.sum(1))).abs())
        conf_logit = d.confidence(torch.cat([h, prev], -1)).float().squeeze(-1)
        bce = F.binary_cross_entropy_with_logits(conf_logit, (1 - tv).detach().clamp(0, 1), reduction="none")
        slot = torch.arange(g).expand(n, g)[blk.valid]
        w = torch.exp(-slot.float() / POSITION_DECAY)
        loss = (w * (CE_WEIGHT * ce + TV_WEIGHT * tv + CONF_WEIGHT * bce)).sum() / w.sum()
        with torch.no_grad():
            hit = (d.to_target(logits.argmax(-1)) == labels).view(-1)
        return loss, {"loss": float(loss.detach()), "ce": float(ce.mean()), "tv": float(tv.mean()),
                      "bce": float(bce.mean()), "top1": float(hit.float().mean()), "positions": int(h.shape[0])}


@torch.no_grad()
def teacher_forced_accept_length(loss: DrafterLoss, corpus: Corpus, g: int, mask_id: int, seed: int = 1,
                                 anchors_per_seq: int = 16) -> dict[str, float]:
    """Greedy accept length on held-out sequences if the target's tokens were those of the corpus:
    1 + the run of leading slots whose Markov-decoded argmax equals the label (the chain uses the
    drafter's own picks, as at serving time)."""
    rng = random.Random(seed)
    d = loss.drafter
    lengths, per_slot = [], torch.zeros(g)
    for start in range(0, len(corpus.sequences), 16):
        blk = make_blocks(corpus.sequences[start:start + 16], g, anchors_per_seq, mask_id, rng)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden = loss.block_hidden(blk)
            base = F.linear(hidden, loss.head_weight).float()
        prev = blk.block_ids[:, 0]
        run = torch.ones(len(prev), dtype=torch.bool)
        accepted = torch.zeros(len(prev))
        for k in range(g):
            pick = d.to_target((base[:, k] + d.markov_w2(d.markov_w1(prev)).float()).argmax(-1))
            ok = (pick == blk.labels[:, k]) & blk.valid[:, k]
            run = run & ok
            per_slot[k] += float(run.sum())
            accepted += run.float()
            prev = pick
        lengths.append(accepted + 1)
    all_lengths = torch.cat(lengths)
    return {"accept_length": float(all_lengths.mean()), "blocks": len(all_lengths),
            "per_slot_survival": [round(float(x) / len(all_lengths), 4) for x in per_slot]}


def train(drafter: DsparkDrafter, loss: DrafterLoss, corpus: Corpus, cfg: TrainConfig, out_dir: str,
          on_step: Callable[[int, dict[str, float], float], None], resume: bool = False) -> int:
    """Run until cfg.steps or cfg.max_minutes; checkpoints to out_dir; returns the last step."""
    torch.manual_seed(cfg.seed)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    step, rng = 0, random.Random(cfg.seed)
    ckpt = os.path.join(out_dir, CHECKPOINT_FILE)
    if resume and os.path.isfile(ckpt):
        state = load_checkpoint(ckpt)
        drafter.load_state_dict(state["drafter"], strict=False)
        opt.load_state_dict(state["optimizer"])
        step = state["step"]
        rng.setstate(state["rng"])
    start = time.perf_counter()
    g, mask_id = drafter.config.block_size, drafter.config.mask_token_id
    while step < cfg.steps:
        if cfg.max_minutes is not None and time.perf_counter() - start > cfg.max_minutes * 60:
            break
        # Cosine over the budget: steps, or the wall-time budget when that runs out first.
        progress = step / cfg.steps
        if cfg.max_minutes is not None:
            progress = max(progress, (time.perf_counter() - start) / (cfg.max_minutes * 60))
        lr = cfg.lr * min(1.0, (step + 1) / cfg.warmup) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        for group in opt.param_groups:
            group["lr"] = lr
        blk = make_blocks(rng.sample(corpus.sequences, min(cfg.seqs_per_step, len(corpus.sequences))), g,
                          cfg.anchors_per_seq, mask_id, rng)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            value, parts = loss(blk)
        opt.zero_grad(set_to_none=True)
        value.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        on_step(step, parts, lr)
        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
            save_checkpoint(ckpt, drafter, opt, step, rng)
    save_checkpoint(ckpt, drafter, opt, step, rng)
    return step


def save_checkpoint(path: str, drafter: DsparkDrafter, opt, step: int, rng: random.Random) -> None:
    """Tensors and plain values only (the optimizer's state dict, the step, the rng state as a
    tuple of ints), so that `load_checkpoint` reads it with weights_only=True: no pickled objects."""
    tmp = path + ".tmp"
    torch.save({"drafter": {k: v for k, v in drafter.state_dict().items() if not k.startswith("rope.")},
                "optimizer": opt.state_dict(), "step": step, "rng": rng.getstate()}, tmp)
    os.replace(tmp, path)  # a crash mid-save leaves the previous checkpoint intact


def load_checkpoint(path: str) -> dict:
    """A checkpoint written by `save_checkpoint`, read with weights_only=True (a checkpoint that
    needs arbitrary unpickling is refused, not executed)."""
    try:
        state = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # unpickling refused or a damaged file: one clear line for --resume
        raise ValueError(f"--resume: cannot read {path} as a weights-only checkpoint: "
                         f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    missing = {"drafter", "optimizer", "step", "rng"} - set(state if isinstance(state, dict) else ())
    if missing:
        raise ValueError(f"--resume: {path} is not a drafter checkpoint (missing {sorted(missing)})")
    return state


def init_from_target(drafter: DsparkDrafter, target_weights: dict[str, torch.Tensor], layer: int) -> None:
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


def choose_draft_vocab(corpus: Corpus, vocab_size: int, size: int, always: tuple[int, ...] = (),
                       held_out: Optional[Corpus] = None) -> tuple[torch.Tensor, float]:
    """The `size` target ids the target emits most in the corpus (responses and teacher top-1),
    plus `always` (e.g. stop tokens), sorted; returns them and the share of `held_out`'s response
    tokens (default: the corpus's) they cover."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for s in corpus.sequences:
        counts += torch.bincount(s.ids[s.prompt_len:], minlength=vocab_size)
        counts += torch.bincount(s.top_ids[:, 0], minlength=vocab_size)
    counts[list(always)] = int(counts.max()) + 1
    ids = torch.sort(torch.argsort(counts, descending=True, stable=True)[:size]).values
    responses = torch.cat([s.ids[s.prompt_len:] for s in (held_out or corpus).sequences])
    return ids, float(torch.isin(responses, ids).float().mean())


def drafter_config_for(target_cfg, num_layers: int, block_size: int, markov_rank: int,
                       num_context_layers: int, mask_token_id: int) -> DsparkConfig:
    return DsparkConfig.for_target(target_cfg, num_layers=num_layers, block_size=block_size, markov_rank=markov_rank,
                                   num_context_layers=num_context_layers, mask_token_id=mask_token_id)
