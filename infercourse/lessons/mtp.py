"""Multi-token prediction (MTP), small enough to train on a laptop.

A language model's last hidden state h_t is trained to predict one token, t+1. Nothing
stops it from holding information about t+2, t+3 too. MTP adds extra *heads* that read it:

- **Medusa heads** (Cai et al. 2024, arXiv:2401.10774): head j maps h_t through one small
  residual block, h + SiLU(W_j h), into the model's own output head, to predict token
  t+1+j. Each head guesses blind: it does not know which token came at t+1.
- **A sequential MTP module** (DeepSeek-V3, arXiv:2412.19437 §2.2): module j also reads
  the *embedding of the token before its target* (the base model's own t+1 for j = 1, the
  previous module's guess after that) and the state of module j−1, so its guesses chain.
  DeepSeek-V3 trains one such module (with a full transformer block) alongside the model;
  here each module is a projection and a residual block.

At decode time the heads are a drafter that costs almost nothing: the hidden state is
already computed by the pass that verified the last tokens (self-speculative decoding,
`lessons.draft_verify.speculative_greedy`; the heads as its drafter: `lessons.mtp_decode`).

Here the base model stays frozen and only the heads learn (Medusa-1 style), from the base
model's *own* predictions (self-distillation): the label for head j at position t is the
token the base model would pick at t+j. Three shortcuts keep training to a minute on a
CPU, each said where it matters: hidden states are computed once and reused every step;
the heads' softmax runs over the thousand or so tokens that occur in the training text or
that the base model predicts there (`vocab`), not all 49,152 (EAGLE-3 and FR-Spec also draft from a reduced
vocabulary); and the text is small (`data/eval_prose.txt` plus sampled answers of the base
model to a few dozen prompts). Trained heads are cached under `cache_dir()/mtp/` by a
content hash of everything that shaped them, so a re-run loads them in a second. What a
run showed, in words written from its tables, is in `lessons.mtp_claims`.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

import numpy as np

from infercourse.core.hashing import content_hash
from infercourse.models.embedded import cache_dir

__all__ = ["TRAIN_TOPICS", "HELDOUT_TOPICS", "chat_ids", "generate_docs", "trunk_features",
           "make_heads", "train_heads", "heldout_acceptance", "trained_heads"]

TRAIN_TOPICS = ["a lighthouse keeper", "how bread rises", "the water cycle", "a chess opening",
                "why cats purr", "how a bicycle stays upright", "a rainy market day", "volcanoes",
                "how to brew tea", "the moon's phases", "a robot gardener", "how vaccines work",
                "a mountain village", "the history of maps", "how bees make honey", "a night train",
                "recycling plastic", "how a compiler works", "a lost umbrella", "the first computers",
                "why the sky is blue", "a desert fox", "how to learn a language", "ocean tides"]
HELDOUT_TOPICS = ["a clockmaker's shop", "how glaciers move", "a friendly dragon", "how radio works"]


def chat_ids(tokenizer, topic: str) -> list[int]:
    """Token ids of a chat prompt asking for a short paragraph about `topic`."""
    msgs = [{"role": "user", "content": f"Write a short paragraph about {topic}."}]
    out = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def generate_docs(model, tokenizer, topics: Sequence[str], new_tokens: int, *,
                  temperature: float = 0.0, seed: int = 0, max_time: float | None = None) -> list[list[int]]:
    """The base model's own answers (prompt ids + generated ids), batched.

    Args:
        topics: one prompt per topic (`chat_ids`).
        new_tokens: tokens generated per answer (fewer if it ends).
        temperature: 0 = greedy (held-out text: what decoding will see), > 0 = sampled
            (training text: more varied contexts).
        seed: torch seed for sampling.
        max_time: seconds after which generation stops (transformers' own `max_time`):
            a slow machine gets shorter answers instead of a longer wait.
    """
    import torch
    prompts = [chat_ids(tokenizer, t) for t in topics]
    width, pad = max(map(len, prompts)), tokenizer.pad_token_id or 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left-padded
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    torch.manual_seed(seed)
    sample = dict(do_sample=True, temperature=temperature, top_k=50, top_p=1.0) if temperature > 0 \
        else dict(do_sample=False, temperature=None, top_k=None, top_p=None)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, pad_token_id=pad,
                             max_time=max_time, **sample)
    eos = set(np.atleast_1d(model.generation_config.eos_token_id).tolist())
    docs = []
    for p, row in zip(prompts, out[:, width:].tolist()):
        gen = row[:next((i for i, t in enumerate(row) if t in eos), len(row))]
        docs.append(p + gen)
    return docs


def trunk_features(model, docs: Sequence[Sequence[int]], *, window: int = 512) -> list[dict]:
    """Per document: token ids X, the frozen model's last hidden states H (after the final
    norm) and its greedy next-token choice A at every position (A[t] follows X[..t]).
    Documents longer than `window` are cut into windows."""
    import torch
    head, out = model.get_output_embeddings(), []
    with torch.no_grad():  # not inference_mode: the heads train on these tensors
        for doc in docs:
            for s in range(0, len(doc), window):
                x = torch.tensor([list(doc[s:s + window])])
                if x.shape[1] < 3:
                    continue
                h = model.base_model(x).last_hidden_state[0]
                out.append({"X": x[0], "H": h, "A": head(h).argmax(-1)})
    return out


def make_heads(model, n_heads: int, kind: str, vocab):
    """Untrained heads on `model`'s frozen output head, restricted to `vocab` (token ids).
    They start as copies of the next-token head (zero residual), so training begins from
    "guess that t+2 is what t+1 would be"."""
    import torch
    from torch import nn
    if kind not in ("medusa", "mtp") or n_heads < 1:
        raise ValueError(f"kind must be 'medusa' or 'mtp' and n_heads >= 1, got {kind!r}, {n_heads}")
    d = model.config.hidden_size

    class Heads(nn.Module):
        def __init__(self):
            super().__init__()
            self.kind, self.n_heads = kind, n_heads
            self.register_buffer("vocab", torch.as_tensor(vocab, dtype=torch.long))
            self.res = nn.ModuleList(nn.Linear(d, d) for _ in range(n_heads))
            for lin in self.res:
                nn.init.zeros_(lin.weight), nn.init.zeros_(lin.bias)
            if kind == "mtp":  # [state; normalised embedding of the token before the target] -> state
                self.proj = nn.ModuleList(nn.Linear(2 * d, d, bias=False) for _ in range(n_heads))
                for p in self.proj:
                    with torch.no_grad():
                        p.weight.zero_(), p.weight[:, :d].copy_(torch.eye(d))
            # frozen and shared with the model: not parameters, not saved
            self.out_w = model.get_output_embeddings().weight.detach()[self.vocab]
            self.emb = model.get_input_embeddings().weight.detach()

        def forward(self, h, toks=None):
            """Logits over `vocab` for each head; toks[:, j] = token before head j's target."""
            g, outs = h, []
            for j in range(self.n_heads):
                z = g = self.mtp_step(j, g, toks[:, j]) if self.kind == "mtp" else \
                    h + nn.functional.silu(self.res[j](h))
                outs.append(z @ self.out_w.T)
            return outs

        def mtp_step(self, j, g, tok):
            e = self.emb[tok]
            g = self.proj[j](torch.cat([g, e * torch.rsqrt(e.pow(2).mean(-1, keepdim=True) + 1e-6)], -1))
            return g + nn.functional.silu(self.res[j](g))

        @torch.inference_mode()
        def draft(self, h, last_token: int, min_prob: float = 0.0) -> list[int]:
            """Greedy guesses for the n_heads tokens after `last_token`, from hidden state h
            (the position whose next token is `last_token`); stops at the first guess whose
            probability is under `min_prob` (a guess likely to be rejected costs a verified
            position and buys nothing)."""
            g, tok, guesses = h[None], last_token, []
            medusa = self(h[None]) if self.kind == "medusa" else None
            for j in range(self.n_heads):  # an MTP module reads its predecessor's guess
                if medusa is None:
                    g = self.mtp_step(j, g, torch.tensor([tok]))
                logits = medusa[j][0] if medusa is not None else (g @ self.out_w.T)[0]
                p, i = torch.softmax(logits, -1).max(-1)
                if p < min_prob:
                    break
                tok = int(self.vocab[i])
                guesses.append(tok)
            return guesses

    return Heads()


def _samples(feats: list[dict], n_heads: int):
    """Positions t with all n_heads targets inside the document: H[t], tokens X[t+1..t+K]
    (the token before each target) and labels A[t+1..t+K] (the base model's choices)."""
    import torch
    H, T, L = [], [], []
    for f in feats:
        n = len(f["X"]) - n_heads
        if n <= 0:
            continue
        H.append(f["H"][:n])
        T.append(torch.stack([f["X"][j + 1:j + 1 + n] for j in range(n_heads)], 1))
        L.append(torch.stack([f["A"][j + 1:j + 1 + n] for j in range(n_heads)], 1))
    return torch.cat(H), torch.cat(T), torch.cat(L)


def train_heads(model, feats: list[dict], *, n_heads: int = 2, kind: str = "medusa", steps: int = 150,
                batch: int = 256, lr: float = 2e-3, seed: int = 0, budget_s: float | None = None,
                min_steps: int = 20):
    """Train heads on frozen features (`trunk_features`); returns (heads, log) where log has
    the loss per step, the steps run and asked, the vocabulary size, samples and seconds.

    Args:
        model: the frozen base model (its output head and embeddings are shared).
        feats: training features.
        n_heads: extra heads (head j predicts token t+1+j).
        kind: "medusa" (each head reads h_t only) or "mtp" (chained, reads the token too).
        steps, batch, lr, seed: Adam steps, positions per step, learning rate, seed.
        budget_s: stop after this many seconds of training (at least `min_steps` run):
            the log says how many steps fit, so a slow machine reports fewer, not waits longer.
    """
    import torch
    t0 = time.perf_counter()
    H, T, L = _samples(feats, n_heads)
    vocab = torch.unique(torch.cat([L.flatten(), T.flatten()]))  # the drafter's vocabulary: tokens seen here
    index = torch.full((model.config.vocab_size,), -100, dtype=torch.long)
    index[vocab] = torch.arange(len(vocab))
    torch.manual_seed(seed)
    heads = make_heads(model, n_heads, kind, vocab)
    opt = torch.optim.AdamW(heads.parameters(), lr=lr, weight_decay=0.01)
    losses, t_train = [], time.perf_counter()
    for step in range(steps):
        if budget_s is not None and step >= min_steps and time.perf_counter() - t_train > budget_s:
            break
        i = torch.randint(0, len(H), (min(batch, len(H)),))
        outs = heads(H[i], T[i])
        loss = sum(torch.nn.functional.cross_entropy(o, index[L[i, j]]) for j, o in enumerate(outs)) / n_heads
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    heads.eval()
    return heads, {"losses": losses, "steps": len(losses), "steps_asked": steps, "vocab_size": len(vocab),
                   "samples": len(H), "train_s": time.perf_counter() - t0}


def heldout_acceptance(heads, feats: list[dict], start: Sequence[int]):
    """How often each head's guess is what the base model then writes, on greedy held-out
    text, from position `start[i]` of document i on (the generated part, not the prompt).

    Returns a DataFrame, one row per head: `head_alone` (its guess right, whatever the
    others did), `chain` (it and every earlier head right: only then does speculative
    decoding get to keep it), the expected tokens per target pass 1 + Σ chain, and
    `always_most_common`: how often one fixed guess, the commonest token at that offset,
    would be right (what a head that learned nothing about the context could reach).
    """
    import pandas as pd
    import torch
    right, labels = [], []
    with torch.inference_mode():
        for f, s in zip(feats, start):
            H, T, L = _samples([f], heads.n_heads)
            if len(H) <= s:
                continue
            if heads.kind == "medusa":
                guess = torch.stack([heads.vocab[o.argmax(-1)] for o in heads(H[s:], T[s:])], 1)
            else:  # free-running chain, as at decode time: each module reads the previous guess
                guess = torch.tensor([heads.draft(h, int(x)) for h, x in zip(H[s:], T[s:, 0])])
            right.append((guess == L[s:]).numpy())
            labels.append(L[s:].numpy())
    if not right:
        raise ValueError("no held-out positions: documents shorter than n_heads + start")
    ok, lab = np.concatenate(right), np.concatenate(labels)
    chain = np.cumprod(ok, axis=1).mean(0)
    common = [np.unique(lab[:, j], return_counts=True)[1].max() / len(lab) for j in range(lab.shape[1])]
    return pd.DataFrame({"head": [f"t+{j + 2}" for j in range(ok.shape[1])], "head_alone": ok.mean(0),
                         "chain": chain, "positions": len(ok), "tokens_per_pass": 1 + np.cumsum(chain),
                         "always_most_common": common})


def trained_heads(model, tokenizer, base_id: str, *, kinds: Sequence[str] = ("medusa", "mtp"),
                  n_heads: int = 2, steps: int = 150, train_topics: int = 24, train_tokens: int = 80,
                  prose: str | None = None, heldout_tokens: int = 64, seed: int = 0,
                  budget_s: float | None = None):
    """Heads of each kind, trained once per configuration and then loaded from
    `cache_dir()/mtp/<content hash>.pt`; returns ({kind: heads}, {kind: log}, held-out).

    Training text: the base model's sampled answers (temperature 0.8) to `train_topics`
    prompts of `TRAIN_TOPICS`, plus `prose`. Held-out text: its greedy answers to
    `HELDOUT_TOPICS` (what decoding will see), returned as {"docs", "start"} (where each
    answer starts) and cached with the heads, so a re-run generates nothing.

    Args:
        model, tokenizer: the frozen base model (transformers).
        base_id: identifies the base model's weights in the cache key (e.g. its sha256).
        kinds: "medusa" and/or "mtp" (see `make_heads`).
        n_heads, steps: heads per kind, training steps per kind.
        train_topics, train_tokens: prompts and generated tokens per prompt for training.
        prose: extra training text (e.g. data/eval_prose.txt).
        heldout_tokens: greedy tokens per held-out prompt.
        seed: sampling and initialisation seed.
        budget_s: seconds for the whole first run on this machine (None: no bound): the
            sampled text gets 40% (`max_time`) and each kind of head an equal share of what
            is left (at least 20 steps each). The held-out text is never cut by the clock:
            acceptance is measured on it (a busy machine once left it too short to measure),
            and `heldout_tokens` bounds it. The logs say how many steps and tokens fitted;
            the cache key includes the budget.
    """
    import torch
    key = {"v": 4, "base": base_id, "kinds": list(kinds), "n_heads": n_heads, "steps": steps,
           "topics": TRAIN_TOPICS[:train_topics], "train_tokens": train_tokens, "heldout": HELDOUT_TOPICS,
           "heldout_tokens": heldout_tokens, "prose": content_hash(prose), "seed": seed, "budget_s": budget_s}
    path = Path(cache_dir()) / "mtp" / f"{content_hash(key)[:16]}.pt"
    if path.is_file():
        blob = torch.load(path, weights_only=False)
        heads = {}
        for kind, state in blob["state"].items():
            heads[kind] = make_heads(model, n_heads, kind, state["vocab"])
            heads[kind].load_state_dict(state)
            heads[kind].eval()
        return heads, {k: {**v, "cached": str(path)} for k, v in blob["log"].items()}, blob["heldout"]
    share = (lambda f: None) if budget_s is None else (lambda f: f * budget_s)   # noqa: E731
    t0 = time.perf_counter()
    heldout = {"docs": generate_docs(model, tokenizer, HELDOUT_TOPICS, heldout_tokens),
               "start": [len(chat_ids(tokenizer, t)) for t in HELDOUT_TOPICS]}
    docs = generate_docs(model, tokenizer, TRAIN_TOPICS[:train_topics], train_tokens, temperature=0.8, seed=seed,
                         max_time=share(0.4))
    feats = trunk_features(model, docs + ([tokenizer(prose)["input_ids"]] if prose else []))
    prep_s = time.perf_counter() - t0
    left = None if budget_s is None else max(budget_s - prep_s, 0.0) / len(kinds)
    heads, logs = {}, {}
    for kind in kinds:
        heads[kind], logs[kind] = train_heads(model, feats, n_heads=n_heads, kind=kind, steps=steps, seed=seed,
                                              budget_s=left)
        logs[kind].update(prep_s=prep_s, train_text_tokens=sum(len(f["X"]) for f in feats), cached=None,
                          budget_s=budget_s)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{time.monotonic_ns()}")
    torch.save({"state": {k: h.state_dict() for k, h in heads.items()}, "log": logs, "heldout": heldout,
                "key": key}, tmp)
    tmp.replace(path)  # appears only when complete
    return heads, logs, heldout
