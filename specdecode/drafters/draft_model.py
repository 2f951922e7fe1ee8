"""A smaller model with the same vocabulary drafts autoregressively; its own cache follows the accepted tokens.

Chains by default. Each chain forward also reads the tokens prompt lookup guesses come next (`draft_lookup`): where
the draft's own next tokens are those guesses, their rows are already computed, so one forward drafts several
tokens (staged speculation, Spector and Re 2023). The drafts are the same as without: a guess only decides which
rows a forward computes, never which token is drawn.

With `draft_tree_nodes` it proposes an EAGLE-2 dynamic tree instead: each depth expands the
`draft_tree_width` best nodes so far (by cumulative draft log-probability) into their top children, in one
draft forward per depth, and the best `draft_tree_nodes` nodes of all depths are verified together.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from specdecode.acceptance.sampling import draw_drafts, logits_to_probs
from specdecode.config import MAX_DRAFT_TOKENS
from specdecode.drafters.base import Drafter, DrafterCaps, DrafterResources, NoOptions, option
from specdecode.drafters.capabilities import AutoMember, Batching, DeferredStart, MemorySizing
from specdecode.drafters.dynamic_tree import DynamicTree, tree_log_probs
from specdecode.drafters.ngram import find_continuations
from specdecode.drafters.registry import register
from specdecode.errors import SpecDecodeError
from specdecode.models.batch_invariance import batch_invariant
from specdecode.models.decoder.forward_inputs import forward_groups
from specdecode.models.decoder.kv_cache import CacheBatch, KVCache
from specdecode.models.formats.drafter_folder import trained_folder
from specdecode.models.heads.draft_vocab import counted_ids, frequent_ids, read_counts, reduced_head, spread_to_vocab
from specdecode.models.loader import LoadedModel
from specdecode.models.model_files import parameter_count
from specdecode.spec_types import DraftProposal, Sequence, TargetOutput, VerifyResult

log = logging.getLogger(__name__)

# The suffix lengths prompt lookup matches for draft_lookup's guesses.
LOOKUP_MIN, LOOKUP_MAX = 1, 4
# A catch-up reading more tokens than this (a prompt) reads no guesses: it comes once a request, and a recurrent
# draft model keeps no states inside a long read to roll back to (gated_deltanet.py's chunked form).
CATCH_UP_GUESSING = 16
# Guesses a forward read, each with the draft's next-token logits after it [V].
Guessed = list[tuple[int, torch.Tensor]]


@dataclass(frozen=True)
class DraftModelOptions(NoOptions):
    draft_p_min: float = option(0.0, "stop drafting a chain when the draft's top probability is below this "
                                "(0 = off)", llama_cpp="--draft-p-min", ge=0, lt=1)
    draft_tree_nodes: int = option(0, "propose an EAGLE-2 dynamic tree of at most this many nodes (0 = a chain)",
                                   ge=0, le=MAX_DRAFT_TOKENS)
    draft_tree_width: int = option(4, "in tree mode: nodes expanded per depth, and children per expanded node",
                                   ge=1, le=16)
    draft_lookup: int = option(3, "in each chain forward, also read up to N tokens prompt lookup guesses come "
                               "next, so a forward drafts several tokens where the draft agrees with them; the drafts "
                               "do not change (0 = one token per forward)", ge=0, le=MAX_DRAFT_TOKENS)
    draft_vocab: int = option(0, "draft over the N most frequent tokens only (those the target was counted "
                              "emitting most by `specdecode train vocab`, else the lowest ids of a byte-level BPE "
                              "vocabulary) and the end-of-turn tokens, through an output head cut to those rows "
                              "(0 = the whole vocabulary); the target verifies with its full head", ge=0,
                              within_vocab=True)


@register
class DraftModelDrafter(Drafter, AutoMember, Batching, DeferredStart, MemorySizing):
    name = "draft"
    auto_rank = 6  # about a third of a target step per drafted token: the costliest member
    caps = DrafterCaps(emits_probs=True, emits_trees=True, needs_draft_model=True)
    Options = DraftModelOptions
    vllm_method = "draft_model"
    tree_options = {"draft_tree_nodes": 8, "draft_tree_width": 3}

    def __init__(self, draft: LoadedModel, target_vocab: int, options: DraftModelOptions,
                 head: torch.nn.Module | None = None, head_ids: torch.Tensor | None = None):
        """`head`: the draft's output head cut to the ids `head_ids` [Vd] (draft_vocab), or None for its own."""
        self.draft = draft
        self.target_vocab = target_vocab
        self.options = options
        self.head, self.head_ids = head, head_ids

    @classmethod
    def check_resources(cls, resources: DrafterResources, options: DraftModelOptions | None = None) -> None:
        super().check_resources(resources, options)
        vocab = resources.target.config.vocab_size
        if options is not None and options.draft_vocab > vocab:  # as many as the whole vocabulary is the whole vocabulary
            raise SpecDecodeError(f"draft_vocab must be at most the target's vocabulary of {vocab} tokens (0: all of "
                                  f"them), got {options.draft_vocab}", "draft_vocab")

    @classmethod
    def create(cls, resources: DrafterResources, options: DraftModelOptions) -> DraftModelDrafter:
        cls.check_resources(resources, options)
        check_vocabularies(resources.target, resources.draft)
        if options.draft_tree_nodes and resources.draft.config.recurrent_layers:
            # Its tree levels would each start from states of nodes fed in earlier forwards, which the recurrent
            # cache does not keep (it rolls back over chains and over one forward's tree).
            raise SpecDecodeError(f"draft_tree_nodes needs a draft model with attention layers only; "
                                  f"{resources.draft.name} has recurrent layers (Gated DeltaNet), so it drafts chains "
                                  "(leave draft_tree_nodes at 0; the target verifies trees from other drafters)")
        vocab = resources.target.config.vocab_size
        if not options.draft_vocab or options.draft_vocab >= min(vocab, resources.draft.config.vocab_size):
            return cls(resources.draft, vocab, options)
        # The tokens the target was counted emitting most (`specdecode train vocab`), else the lowest ids.
        counts = read_counts(trained_folder("vocab", resources.target.name), vocab)
        ends = resources.target.tokenizer.eos_token_ids
        ids = frequent_ids(options.draft_vocab, vocab, ends) if counts is None else counted_ids(
            counts, options.draft_vocab, ends)
        key = f"draft-head:{options.draft_vocab}:{'counted' if counts is not None else 'lowest'}"
        if key not in resources.own_weights:  # one copy per Engine, whatever else a configuration differs in
            # In the draft model's own precision: its head is quantized as the rest of it was.
            resources.own_weights[key] = reduced_head(resources.draft.model, ids, resources.draft.quant)
        model = resources.draft.model
        return cls(resources.draft, vocab, options, resources.own_weights[key], ids.to(model.device))

    @property
    def tree(self) -> bool:
        return self.options.draft_tree_nodes > 0

    def max_nodes(self, budget: int) -> int:
        return self.options.draft_tree_nodes if self.tree else budget

    def start(self, seq: Sequence, prefill: TargetOutput) -> None:
        self.defer_start(seq)
        # The prompt now, in the prefill phase; the first generated token comes with the first proposal.
        self._feed(seq, seq.drafter_state[self.name], logits_at=slice(0, 0), upto=seq.prompt_len)

    def defer_start(self, seq: Sequence) -> None:
        # Room for the committed tokens plus what one proposal feeds beyond them (a chain, or a tree's levels).
        slack = seq.draft_limit * (self.options.draft_tree_width if self.tree else 1)
        # A recurrent draft model rolls back over a drafting step's rows and its catch-up's (families/qwen3_5/trunk.py).
        cache = self.draft.model.new_cache(seq.capacity + slack, rollback_rows=2 * slack + 2)
        reused = seq.reused_drafter_rows.get(self.name)
        if reused is not None:  # the prompt's beginning, as an earlier request read it (prefix_cache.py)
            cache.fill(*reused)
        seq.drafter_state[self.name] = cache  # the first catch-up reads the prompt (what the prefix cache did not give)

    def pending_tokens(self, seq: Sequence) -> int:
        return len(seq.tokens) - seq.drafter_state[self.name].lengths[0]

    @property
    def batch_invariant(self) -> bool:
        return batch_invariant(self.draft.model)

    def propose(self, seq: Sequence, budget: int) -> DraftProposal:
        cache = seq.drafter_state[self.name]
        if self.tree:
            return self._tree(seq, cache, self._catch_up_many([seq], [cache], [[]])[0][0], budget)
        return self._chains([seq], [cache], [budget])[0]

    def request_bytes(self, seq: Sequence) -> int:
        cache = seq.drafter_state.get(self.name)
        return cache.nbytes if cache is not None else 0

    def token_caches(self, seq: Sequence) -> dict[str, KVCache]:
        cache = seq.drafter_state.get(self.name)
        return {} if cache is None else {self.name: cache}

    def commit(self, seq: Sequence, result: VerifyResult, target: TargetOutput) -> None:
        # Keep only cached tokens that were accepted; everything after them is overwritten next time.
        cache = seq.drafter_state[self.name]
        cache.truncate(min(cache.lengths[0], len(seq.tokens) - 1))

    def propose_many(self, seqs: list[Sequence], budgets: list[int]) -> list[DraftProposal]:
        """Chains for several requests in shared forwards (one catch-up, then one per drafted position), when
        the draft model is batch-invariant (w4a8), so each chain is what `propose` drafts alone; else one by one."""
        if self.tree or not self.batch_invariant:
            return super().propose_many(seqs, budgets)

        def chains(asked: list[Sequence], asked_budgets: list[int]) -> list[DraftProposal]:
            return self._chains(asked, [seq.drafter_state[self.name] for seq in asked], asked_budgets)

        return self.proposals_for_asked(seqs, budgets, chains)

    def _chains(self, seqs: list[Sequence], caches: list[KVCache], budgets: list[int]) -> list[DraftProposal]:
        """Autoregressive chains after each sequence's catch-up; the sequences still drafting share each draft
        forward."""
        p_min = self.options.draft_p_min
        tokens: list[list[int]] = [[] for _ in seqs]
        rows: list[list[torch.Tensor]] = [[] for _ in seqs]  # the laws sampled drafts were drawn from, [V] each
        # Per sequence: the next-token logits [V], and the guesses its last forward read after them, each with the
        # draft's logits after it [V], valid while the drawn tokens follow the guesses.
        guesses = [lookup_guess(seq.tokens, min(self.options.draft_lookup, budget - 1))
                   if len(seq.tokens) - cache.lengths[0] <= CATCH_UP_GUESSING else []
                   for seq, cache, budget in zip(seqs, caches, budgets)]
        caught_up = self._catch_up_many(seqs, caches, guesses)
        logits = [row for row, _ in caught_up]
        ahead: list[Guessed] = [guessed for _, guessed in caught_up]
        drafting = [b for b, budget in enumerate(budgets) if budget > 0]
        while drafting:
            fed, read_ahead = [], []
            for b in drafting:
                position = len(seqs[b].tokens) + len(tokens[b])
                token, q, confidence = self._draw(seqs[b], logits[b], position, bool(p_min))
                # llama.cpp's --draft-p-min: an unsure draft is likely rejected, so stop spending time on it.
                if confidence is not None and confidence < p_min:
                    continue
                tokens[b].append(token)
                if q is not None:
                    rows[b].append(q)
                if len(tokens[b]) >= budgets[b]:
                    continue
                if ahead[b] and ahead[b][0][0] == token:  # the last forward read this token already
                    logits[b] = ahead[b].pop(0)[1]
                    read_ahead.append(b)
                else:
                    fed.append(b)
            if fed:
                for b, (row, guessed) in zip(fed, self._forward_drafts(seqs, caches, tokens, budgets, fed)):
                    logits[b], ahead[b] = row, guessed
            drafting = read_ahead + fed
        for seq, cache, drafted in zip(seqs, caches, tokens):
            # Drop the rows of guesses past the chain's newest fed draft; commit keeps those of the accepted drafts.
            cache.truncate(min(cache.lengths[0], len(seq.tokens) + max(len(drafted) - 1, 0)))
        # Greedy and coupled drafts are deterministic: verification must not see a q for them (it would bias sampling).
        return [DraftProposal.chain(t, torch.stack(r) if r else None, self.name) for t, r in zip(tokens, rows)]

    def _forward_drafts(self, seqs: list[Sequence], caches: list[KVCache], tokens: list[list[int]],
                        budgets: list[int], fed: list[int]) -> list[tuple[torch.Tensor, Guessed]]:
        """One draft forward over each fed sequence's newest draft and the tokens prompt lookup guesses follow it
        (no more than its budget could still draft); -> per fed sequence, (the next-token logits [V], each guess
        with the logits after it [V]).

        Sequences with fewer guesses are padded to the longest; the padding's rows are dropped after. In a batch
        each sequence gets as many guesses as the one with the least budget left may read."""
        model = self.draft.model
        # A padded row takes a cache slot too: no sequence's rows may pass what its budget could still draft.
        room = min(min(self.options.draft_lookup, budgets[b] - len(tokens[b]) - 1) for b in fed)
        guesses = [lookup_guess(seqs[b].tokens + tokens[b], room) for b in fed]
        width = 1 + max(len(guessed) for guessed in guesses)
        inputs = torch.zeros(len(fed), width, dtype=torch.long)  # [F, W]: the newest draft, its guesses, padding
        positions = torch.empty(len(fed), width, dtype=torch.long)  # [F, W]
        for row, (b, guessed) in enumerate(zip(fed, guesses)):
            # Drop rows of guesses an earlier forward read and the draws did not follow.
            start = len(seqs[b].tokens) + len(tokens[b]) - 1
            caches[b].truncate(start)
            inputs[row, : 1 + len(guessed)] = torch.tensor(tokens[b][-1:] + guessed)
            positions[row] = torch.arange(start, start + width).clamp(max=start + len(guessed))
        cache = caches[fed[0]] if len(fed) == 1 else CacheBatch([caches[b] for b in fed])
        out = self._to_target_vocab(model(inputs.to(model.device), positions.to(model.device), cache,
                                          head=self.head).logits)  # [F, W, V]
        results = []
        for row, (b, guessed) in enumerate(zip(fed, guesses)):
            caches[b].truncate(len(seqs[b].tokens) + len(tokens[b]) + len(guessed))
            results.append((out[row, 0], [(guess, out[row, 1 + i]) for i, guess in enumerate(guessed)]))
        return results

    @staticmethod
    def _draw(seq: Sequence, logits: torch.Tensor, position: int, confidence: bool
              ) -> tuple[int, torch.Tensor | None, float | None]:
        """The draft token for `position` from logits [V] -> (token, the law it was drawn from [V] or None when it
        is deterministic (greedy or coupled), the draft's top probability when `confidence` asks for it)."""
        if seq.sampling.greedy:
            top = float(torch.softmax(logits, dim=-1).max()) if confidence else None
            return int(logits.argmax()), None, top
        q = logits_to_probs(logits, seq.sampling)  # [V]
        token, law = draw_drafts(q[None], seq, position)  # [1], [1, V] or None
        return int(token[0]), None if law is None else q, float(q.max()) if confidence else None

    def _tree(self, seq: Sequence, cache: KVCache, logits: torch.Tensor, budget: int) -> DraftProposal:
        """Top-k children are deterministic drafts (no q): verification uses the one-hot rule, in sampling too."""
        model, width = self.draft.model, self.options.draft_tree_width
        prefix = cache.lengths[0]  # every committed token; the tree's levels go after it and are dropped after
        tree = DynamicTree(width)
        tree.add_children(-1, tree_log_probs(logits[None], seq.sampling), 0.0)
        for depth in range(2, budget + 1):
            expand = tree.best_of_depth(depth - 1)
            inputs = torch.tensor([[tree.tokens[n] for n in expand]], device=model.device)  # [1, W]
            positions = torch.full_like(inputs, len(seq.tokens) - 2 + depth)  # [1, W]: depth d-1 sits at root + d-1
            mask = tree.feed(expand).to(model.device).unsqueeze(0)  # [1, W, fed + W]
            out = model(inputs, positions, cache, attn_mask=mask, head=self.head).logits[0]  # [W, V_draft]
            log_probs = tree_log_probs(self._to_target_vocab(out), seq.sampling)  # [W, V]
            for row, node in enumerate(expand):
                tree.add_children(node, log_probs[row : row + 1], tree.scores[node])
        cache.truncate(prefix)
        tokens, parents = tree.select(self.options.draft_tree_nodes)
        return DraftProposal(torch.tensor(tokens), torch.tensor(parents), None, self.name)

    def _catch_up_many(self, seqs: list[Sequence], caches: list[KVCache], guesses: list[list[int]]
                       ) -> list[tuple[torch.Tensor, Guessed]]:
        """Feed every committed token not yet in each draft cache (the target's corrected or bonus token, the
        accepted path of a tree, or a stretch another drafter of a chain won), for several sequences in as few
        forwards as their caches' room allows, each also reading the tokens `guesses` says follow its last;
        -> per sequence, (its next-token logits [V], each guess with the logits after it [V]). Each one's rows
        are padded to the longest (the padding's slots are dropped after)."""
        model = self.draft.model
        seen = [cache.lengths[0] for cache in caches]
        fed = [seq.tokens[start:] + guessed for seq, start, guessed in zip(seqs, seen, guesses)]
        results: list = [None] * len(seqs)
        for group in forward_groups(seen, [len(rows) for rows in fed], [cache.capacity for cache in caches]):
            longest = max(len(fed[b]) for b in group)
            tokens = torch.zeros(len(group), longest, dtype=torch.long)  # [G, P]
            positions = torch.empty(len(group), longest, dtype=torch.long)  # [G, P]
            read = torch.empty(len(group), 1 + max(len(guesses[b]) for b in group), dtype=torch.long)  # [G, R]
            for row, b in enumerate(group):
                tokens[row, : len(fed[b])] = torch.tensor(fed[b])
                positions[row] = torch.arange(seen[b], seen[b] + longest).clamp(max=seen[b] + len(fed[b]) - 1)
                # The last committed token's row, then each guess's (padding repeats the last real row).
                last = len(fed[b]) - 1 - len(guesses[b])
                read[row] = torch.arange(last, last + read.shape[1]).clamp(max=len(fed[b]) - 1)
            cache = caches[group[0]] if len(group) == 1 else CacheBatch([caches[b] for b in group])
            out = self._to_target_vocab(model(tokens.to(model.device), positions.to(model.device), cache,
                                              logits_at=read.to(model.device), head=self.head).logits)  # [G, R, V]
            for row, b in enumerate(group):
                caches[b].truncate(len(seqs[b].tokens) + len(guesses[b]))
                results[b] = (out[row, 0], [(guess, out[row, 1 + i]) for i, guess in enumerate(guesses[b])])
        return results

    def _feed(self, seq: Sequence, cache: KVCache, logits_at: slice, upto: int) -> torch.Tensor:
        model, seen = self.draft.model, cache.lengths[0]
        pending = torch.tensor([seq.tokens[seen:upto]], device=model.device)  # [1, P]
        positions = torch.arange(seen, upto, device=model.device).unsqueeze(0)  # [1, P]
        return model(pending, positions, cache, logits_at=logits_at, head=self.head).logits  # [1, P', V_draft]

    def _to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [..., V_draft] -> [..., V_target]: padded embedding rows differ between sizes of one family, and
        a reduced head scores only its ids.

        Ids the draft did not score get -inf, so they are never drafted and q stays the law drafts follow.
        """
        if self.head_ids is not None:
            return spread_to_vocab(logits, self.head_ids, self.target_vocab)  # [..., V_target]
        size = logits.shape[-1]
        if size >= self.target_vocab:
            return logits[..., : self.target_vocab]
        return torch.nn.functional.pad(logits, (0, self.target_vocab - size), value=float("-inf"))


def lookup_guess(context: list[int], count: int) -> list[int]:
    """Up to `count` tokens prompt lookup guesses follow `context` (the continuation of the most recent earlier
    occurrence of its longest recurring suffix), or [] when no suffix recurs."""
    found = find_continuations(context, count, LOOKUP_MIN, LOOKUP_MAX) if count > 0 else []
    return found[0] if found else []


def check_vocabularies(target: LoadedModel, draft: LoadedModel) -> None:
    """Same token strings for the same ids, or one clear error naming both models."""
    target_tokens, draft_tokens = target.tokenizer.token_strings(), draft.tokenizer.token_strings()
    if target_tokens != draft_tokens:
        shared = min(len(target_tokens), len(draft_tokens))
        first = next((i for i in range(shared) if target_tokens[i] != draft_tokens[i]), shared)
        raise SpecDecodeError(
            f"vocabulary mismatch: draft model {draft.name!r} ({len(draft_tokens)} tokens) and target "
            f"{target.name!r} ({len(target_tokens)} tokens) differ first at id {first}; "
            "a draft model must share the target's tokenizer"
        )
    target_params, draft_params = parameter_count(target.config), parameter_count(draft.config)
    if draft_params >= target_params:
        log.warning("draft model %s (%.2fB parameters) is not smaller than the target %s (%.2fB): "
                    "drafting will likely slow generation down", draft.name, draft_params / 1e9,
                    target.name, target_params / 1e9)
